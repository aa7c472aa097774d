"""Objectives as functions of the tree tokens' log-probs: what partitioned training needs.

Partitioned training (:mod:`treelit.partition`) never holds the whole tree's graph, so
an objective must be evaluated from log-probs that arrive partition by partition.
:func:`loss_from_logprobs` is each objective's micro-batch loss given the log-probs
``logp [M]`` (and entropies) of the target tokens ``sel [M]`` - exactly what its
``tree_loss`` computes after its forward pass, with the same normaliser.

Two kinds, by :func:`fold_spec`:

* **token-separable** (``sft``, ``ppo``, ``grpo``, with KL and entropy terms): the loss
  is a sum over target tokens of a term that depends on that token's log-prob alone
  (advantages and weights are folded per token). Each partition adds the terms of its
  own targets: the sum over partitions is the loss, and its gradient is exact.
* **sequence-level** (``gspo``, ``dpo``, anything else): a branch's term depends on a
  sum over all its target tokens, which lie in several partitions. The log-probs are
  first computed in a no-gradient pass over the partitions; the loss ``L(logp)`` and
  ``g = dL/dlogp`` (and ``dL/dH``) come from them; the gradient passes then backward
  the surrogate ``sum_t g_t logp_t (+ g^H_t H_t)``, whose parameter gradient is
  ``sum_t dL/dlogp_t dlogp_t/dtheta = dL/dtheta`` by the chain rule.

A plugin objective takes part by defining ``loss_from_logprobs`` with this signature
(and ``token_separable = True`` when it is a per-token sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from treelit.objectives.base import Objective
from treelit.objectives.paths import branch_target_sums
from treelit.objectives.rl import DPO, GSPO, _pairs, _PolicyObjective
from treelit.objectives.sft import SFT
from treelit.tree.batch import check_aggregation, global_normalizer
from treelit.utils.dispatch import host_floats

__all__ = ["FoldSpec", "fold_spec", "loss_from_logprobs", "target_selection"]

Metrics = Dict[str, float]


@dataclass(frozen=True)
class FoldSpec:
    token_separable: bool  # per-partition folding; otherwise a no-gradient log-prob pass first
    needs_entropy: bool  # the loss reads the entropy of each predicting distribution
    reference_model: bool  # reference log-probs come from a frozen reference model's forward
    fused_sft: bool  # plain SFT: the fused weighted-NLL head applies


def fold_spec(objective: Objective) -> FoldSpec:
    if hasattr(objective, "loss_from_logprobs"):
        return FoldSpec(bool(getattr(objective, "token_separable", False)),
                        bool(getattr(objective, "needs_entropy", False)), False, False)
    if type(objective) is SFT:
        return FoldSpec(True, False, False, True)
    if isinstance(objective, DPO):
        return FoldSpec(False, False, objective.reference != "data", False)
    if isinstance(objective, _PolicyObjective):
        ref = bool(objective.kl_coef) and objective.reference != "data"
        return FoldSpec(not isinstance(objective, GSPO), bool(objective.entropy_coef), ref, False)
    raise NotImplementedError(
        f"objective {getattr(objective, 'name', type(objective).__name__)!r} cannot run partitioned: define "
        "loss_from_logprobs(batch, sel, logp, ent, aggregation=, normalizer=, ref=) on it (see treelit.objectives.folding)"
    )


def target_selection(batch) -> torch.Tensor:
    """Tree tokens whose log-prob any objective reads: targets of some branch (``[M]`` long)."""
    return batch.targets()


def loss_from_logprobs(
    objective: Objective,
    batch,
    sel: torch.Tensor,
    logp: torch.Tensor,
    ent: Optional[torch.Tensor] = None,
    *,
    aggregation: str,
    normalizer: Optional[float],
    ref: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """The micro-batch loss (already divided by the normaliser) from target log-probs.

    Args:
        sel: ``[M]`` tree-token indices (a subset of :func:`target_selection` for a
            token-separable objective, all of it otherwise).
        logp, ent: ``[M]`` log-probs (and entropies) of those tokens.
        ref: ``[N]`` float64 reference log-probs of every tree token (NaN where unknown),
            from a reference model's pass; None: the objective reads them from the data.
    """
    check_aggregation(aggregation)
    if hasattr(objective, "loss_from_logprobs"):
        return objective.loss_from_logprobs(batch, sel, logp, ent, aggregation=aggregation, normalizer=normalizer, ref=ref)
    if type(objective) is SFT:
        Z = global_normalizer([batch], aggregation) if normalizer is None else float(normalizer)
        W = batch.token_weights(aggregation)[sel]
        coef = W / Z if Z > 0 else torch.zeros_like(W)
        return -(coef.to(logp.dtype) * logp).sum(), {}
    if isinstance(objective, DPO):
        x = torch.zeros(batch.num_tokens, dtype=logp.dtype, device=logp.device).index_put((sel,), logp)
        pi = branch_target_sums(batch, x)
        if ref is not None:
            ref_seq = branch_target_sums(batch, torch.nan_to_num(ref.to(torch.float64)))
        else:
            ref_seq = objective._ref_seq(None, batch, None)
        Z = objective._Z(batch, aggregation, normalizer)
        return objective._loss_from_seq(pi, ref_seq.to(pi.device), _pairs(batch), batch.branch_weight, Z), {}
    if isinstance(objective, _PolicyObjective):
        check = getattr(objective, "_check_advantages", None)
        if check is not None:
            check(batch)
        Z = objective._Z(batch, aggregation, normalizer)
        old = objective._old_or_current(None if batch.token_old_logp is None else batch.token_old_logp[sel], logp)
        W = batch.token_weights(aggregation)[sel]
        main, metrics = objective._tree_term(batch, sel, logp, old, aggregation)
        r = None
        if objective.kl_coef:
            if ref is not None:
                r = ref[sel].to(torch.float64)
                if torch.isnan(r).any():
                    raise ValueError("reference log-probs are missing for some target tokens")
            else:
                r = objective._tree_ref(None, batch, sel, None)
        reg, m2 = objective._regularisers(logp, ent, W, r)
        total = main + reg
        return (total / Z if Z > 0 else total * 0.0), host_floats({**metrics, **m2})
    fold_spec(objective)  # raises with the explanation
    raise AssertionError("unreachable")
