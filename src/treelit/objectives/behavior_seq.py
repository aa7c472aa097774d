"""Sequence-level off-policy corrections on the tree: one weight per branch, from path sums.

With ``objective.behavior_is_level=sequence|geometric`` the correction
(:mod:`treelit.objectives.behavior`) reads one ratio per branch b instead of one per token:

    log rho_b = sum over b's target tokens t of (prox_t - behav_t)     (sequence)
    log rho_b = that sum / n_b                                        (geometric: n_b targets)

and every target token of b carries the branch's weight ``w_b = f(rho_b)`` (``tis``:
``min(rho_b, cap)``; ``mis``: ``rho_b`` inside ``[low, cap]``, else 0; ``decoupled``:
``rho_b`` up to the cap, else 0). A token's log-ratio is one number for every branch
through it, so the sums are path sums on the tree (:func:`~treelit.objectives.paths.branch_target_sums`),
computed once per row and cached on it: the proximal and behaviour log-probs are constants
of the step. The weights are constants too (no gradient), so they fold where the advantage
folds: PPO's per-token sums ``P_t = sum_{A_b > 0} c_{b,t} w_b A_b`` (and ``N_t``) are one
scatter of the branches' target positions into the tree tokens, and GSPO's branch term is
multiplied by ``w_b``. Everything stays on the device: the plans come from the row's host
copies (``batch.host``) and the metrics are 0-d tensors.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from treelit.objectives.behavior import BehaviorOptions, check_tree_behavior, out_of_bounds, ratio_weights
from treelit.objectives.paths import branch_target_sums
from treelit.utils.dispatch import upload

__all__ = ["tree_branch_weights", "folded_advantages", "refuse_token_advantages"]


def _targets(batch) -> Tuple[np.ndarray, np.ndarray]:
    """Host plan: per flat branch position, whether it is a target; per branch, its target count."""
    ptr = batch.host("branch_ptr")
    target = batch.host("branch_mask").copy()
    target[ptr[:-1]] = False  # a branch's first token is never a target
    n = np.add.reduceat(target.astype(np.float64), ptr[:-1]) if len(target) else np.zeros(0)
    return target, n


def refuse_token_advantages(opts: BehaviorOptions) -> ValueError:
    return ValueError(f"objective.behavior_is_level={opts.level} weights whole branches, and a critic's advantages are "
                      "per token: use objective.behavior_is_level=token with a critic")


def tree_branch_weights(batch, opts: BehaviorOptions) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``w [B]`` (float64, on the row's device) and the sequence metrics, once per row and step."""
    prox = batch.token_old_logp
    if prox is None:
        raise ValueError(f"objective.behavior_is_level={opts.level} needs the proximal log-probs of every target token "
                         "(old_logprobs=rollout)")
    behav = check_tree_behavior(batch, opts.kind)
    cached = getattr(batch, "_seq_behavior", None)
    if cached is not None and cached[0] == opts and cached[1] is prox and cached[2] is behav:
        return cached[3]
    target = (batch.target_count != 0) & (batch.parent >= 0)  # where a log-ratio is read: on the device
    d = prox.double() - behav.to(prox.device).double()
    x = torch.where(target.to(prox.device), d, torch.zeros_like(d))
    S = branch_target_sums(batch, x)  # the branches' summed log-ratios: path sums, one pass over the tree
    _, n = _targets(batch)
    live = np.where(n > 0, batch.host("branch_weight"), 0.0)  # trained branches, by their weights
    plan = upload(np.stack([np.maximum(n, 1.0), live]), prox.device)
    log_rho = S / plan[0] if opts.level == "geometric" else S
    rho = torch.exp(log_rho)
    w = ratio_weights(rho, opts)
    live_t = plan[1]
    Ws = live_t.sum().clamp(min=1e-30)
    top = torch.where(live_t != 0, rho, torch.full_like(rho, -float("inf"))).max() if rho.numel() else rho.new_ones(())
    over = rho > opts.cap if opts.cap is not None else torch.zeros_like(rho, dtype=torch.bool)
    metrics = {
        "behavior/seq_ratio_mean": (live_t * rho).sum() / Ws,
        "behavior/seq_ratio_max": torch.where(torch.isfinite(top), top, torch.ones_like(top)),
        "behavior/seq_truncated_frac": (live_t * over.double()).sum() / Ws,
        "behavior/seq_masked_frac": (live_t * out_of_bounds(rho, opts).double()).sum() / Ws,
    }
    batch._seq_behavior = (opts, prox, behav, (w, metrics))
    return w, metrics


def folded_advantages(batch, opts: BehaviorOptions, aggregation: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """PPO's folded ``(P [N], N [N])`` with each branch's advantage weighted by its ``w_b``."""
    if getattr(batch, "critic_pairs", None) is not None:
        raise refuse_token_advantages(opts)
    w, _ = tree_branch_weights(batch, opts)
    cached = getattr(batch, "_seq_folds", None)
    if cached is not None and cached[0] is w and aggregation in cached[1]:
        return cached[1][aggregation]
    target, n = _targets(batch)
    ptr = batch.host("branch_ptr")
    branch_of = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
    scale = np.divide(1.0, n, out=np.zeros_like(n), where=n > 0) if aggregation == "seq-mean-token-mean" else np.ones_like(n)
    c = (batch.host("branch_weight") * scale)[branch_of] * target
    a = batch.host("branch_adv")[branch_of]
    keep = np.flatnonzero(c != 0)
    # one upload: tree token, branch, c max(A, 0), c min(A, 0) of each trained position (float64 holds indices exactly)
    plan = upload(np.stack([batch.host("branch_tokens")[keep].astype(np.float64), branch_of[keep].astype(np.float64),
                            (c * np.maximum(a, 0.0))[keep], (c * np.minimum(a, 0.0))[keep]]), w.device)
    tok, br = plan[0].long(), plan[1].long()
    wb = w[br]
    zeros = torch.zeros(batch.num_tokens, dtype=torch.float64, device=w.device)
    folds = (zeros.index_add(0, tok, plan[2] * wb), zeros.index_add(0, tok, plan[3] * wb))
    store = cached[1] if cached is not None and cached[0] is w else {}
    store[aggregation] = folds
    batch._seq_folds = (w, store)
    return folds
