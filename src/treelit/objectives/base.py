"""The objective interface and registry.

An objective computes one micro-batch's share of the step loss twice over: on the
tree (``tree_loss``, from a ``TreeBatch``) and per branch (``linear_loss``, the reference,
from :class:`~treelit.loss.branches.Branches`: no tree built). Both return
``(loss, metrics)`` where ``loss`` is already divided by the step-global normaliser,
so that summing micro-batch losses (and their gradients) gives the step's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from treelit.registry import get_registry
from treelit.tree.batch import global_normalizer

__all__ = ["OBJECTIVES", "Objective", "make_objective"]

OBJECTIVES = get_registry("objective", ["treelit.objectives.sft", "treelit.objectives.rl"])

Metrics = Dict[str, float]


class Objective:
    name = "?"

    def norm_contribution(self, batch, aggregation: str) -> float:
        """This micro-batch's share of the step normaliser (summed over micro-batches and ranks)."""
        return batch.norm_contribution(aggregation)

    def data_needs(self) -> Optional[Dict[str, bool]]:
        """What this objective reads from the data, checked per record before training:
        ``advantage`` (an advantage, or a reward and an estimator, on every branch),
        ``old_logprobs`` (read when present), ``ref_logprobs`` (a reference log-prob on every
        target token), ``pairs`` (DPO ``pair``/``chosen`` on every branch). Fields an
        objective does not read are dropped before trees are built. None: unknown (a
        plugin objective that does not say), every field is kept and nothing is required."""
        return None

    def normalizer(self, micro_batches, aggregation: str) -> float:
        """The step normaliser ``Z`` of ``micro_batches`` for this objective: pass it as
        ``normalizer=Z`` to each micro-batch's loss (gradient accumulation; under data
        parallelism sum the contributions over ranks as well)."""
        return global_normalizer(micro_batches, aggregation, objective=self)

    def tree_loss(
        self,
        model,
        batch,
        *,
        aggregation: str,
        normalizer: Optional[float],
        attention: Any = "auto",
        chunk_rows: Optional[int] = None,
    ) -> Tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    def linear_loss(
        self,
        model,
        branches,
        *,
        aggregation: str,
        normalizer: Optional[float],
        chunk_rows: Optional[int] = None,
        max_tokens: int = 8192,
    ) -> Tuple[torch.Tensor, Metrics]:
        """The per-branch reference: ``branches`` (:class:`~treelit.loss.branches.Branches`; a
        ``TreeBatch`` is read back into one with ``as_branches``) each run as its own causal
        sequence, in padded micro-batches of at most ``max_tokens``. No tree code."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_objective(name: str, **options: Any) -> Objective:
    """Instantiate the objective registered as ``name`` with its options."""
    return OBJECTIVES.get(name)(**options)
