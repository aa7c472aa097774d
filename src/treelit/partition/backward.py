"""Redundancy-free partitioned forward/backward: every token forwarded once, memory bounded.

The row is cut into partitions (:mod:`treelit.partition.plan`) and processed depth
first over the partition tree:

1. *forward* a partition with its ancestors' per-layer K/V (and, for recurrent layers,
   their boundary states) given as **leaf tensors that require grad**, gathered from the
   ancestor partitions' own leaf copies of what they produced (:mod:`.passes`);
2. its loss covers its own targets plus the first token of each child partition, whose
   log-prob is read from this partition's hidden state of that token's parent;
3. before a partition that is not a descendant is forwarded, the finished partitions
   are *backwarded* deepest first: ``backward([loss, K, V, ...], [1, dK, dV, ...])``
   where ``dK, dV`` are the gradients its descendants accumulated into its leaf copies.
   That relays every descendant's gradient into the partition's graph and on into its
   own ancestors' leaves.

Only partitions on the current root-to-leaf chain hold graphs. Any objective runs
partitioned (:mod:`treelit.objectives.folding`): token-level ones fold their terms per
partition; sequence-level ones (GSPO, DPO) first take every target's log-prob in a
no-gradient pass. The result equals the unpartitioned loss and gradients (tested in
float64 to 1e-9). Multi-process execution and the pass alignment under FSDP2 live in
:mod:`.engine`; this module is the single-call entry point.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from treelit.attention.base import AttentionBackend
from treelit.loss.tree import prepare_batch
from treelit.objectives.base import make_objective
from treelit.partition.engine import PartitionStats, run_micro_batch
from treelit.tree.batch import TreeBatch, global_normalizer
from treelit.tree.token_tree import TokenTree

__all__ = ["tree_backward", "PartitionStats"]


def tree_backward(
    model,
    batch: Union[TreeBatch, TokenTree],
    aggregation: str = "token-mean",
    partition: str = "redundancy_free",
    budget_tokens: Optional[int] = None,
    *,
    normalizer: Optional[float] = None,
    attention: Union[str, AttentionBackend, None] = "auto",
    chunk_rows: Optional[int] = None,
    stats: Optional[PartitionStats] = None,
    objective: Any = "sft",
    router_normalizer: Optional[float] = None,
    **objective_options: Any,
) -> float:
    """Forward and backward the loss of ``batch`` (accumulating ``.grad``); return its value.

    Args:
        partition: ``redundancy_free`` (cut into partitions when the row exceeds
            ``budget_tokens``) or ``none`` (one pass).
        budget_tokens: tokens allowed along any chain of partitions (>= the longest branch).
        normalizer: the step-global normaliser Z (default: this row's own, for the objective).
        stats: filled with partition counts and token-forward counts when given.
        objective: ``sft`` (default), any registered objective name (with its options as
            keyword arguments) or an objective instance.
        router_normalizer: a mixture-of-experts model's router-loss step normaliser (see
            :func:`treelit.tree_loss`; default: this batch's own).
    """
    if partition not in ("none", "redundancy_free"):
        raise ValueError(f"unknown partition strategy {partition!r}; known: none, redundancy_free")
    if isinstance(objective, str):
        objective = make_objective(objective, **objective_options)
    elif objective_options:
        raise TypeError("objective options are given with an objective name, not with an objective instance")
    batch = prepare_batch(model, batch)
    if normalizer is None:
        Z = global_normalizer([batch], aggregation, objective=objective)
    else:
        Z = float(normalizer)
    stats = stats if stats is not None else PartitionStats()
    budget = None if partition == "none" else budget_tokens
    result = run_micro_batch(model, objective, batch, aggregation=aggregation, normalizer=Z, budget_tokens=budget,
                             attention=attention, chunk_rows=chunk_rows, stats=stats,
                             router_normalizer=router_normalizer)
    if result.failed:
        raise torch.OutOfMemoryError(f"out of memory in a partition pass (budget {budget} tokens)")
    return result.loss
