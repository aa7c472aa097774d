"""Off-policy correction between the sampler's policy and the trainer's, per token.

An asynchronous sampler draws tokens from a *behaviour* policy: the weights it loaded
(possibly several versions old) run through its own engine numerics. Its per-token
log-probs arrive in the records as ``old_logprobs``. With ``old_logprobs=rollout`` the
trainer recomputes the same tokens' log-probs under its current weights before the first
update of the step: the *proximal* policy. The clipped surrogate's ratio is
``r_t = pi_theta / pi_prox``; the behaviour ratio ``rho_t = pi_prox / pi_behav`` corrects
for sampling from ``pi_behav``:

* ``tis`` (truncated importance sampling): the per-token clipped surrogate is multiplied by
  ``min(rho_t, cap)``.
* ``decoupled`` (decoupled PPO, as in AReaL): the clip acts on ``pi_theta / pi_prox`` and
  the term is weighted by ``rho_t``; with a cap, a token whose ``rho_t`` exceeds it is
  left out (weight 0) rather than truncated.

Both weights are constants (neither policy is the one being trained), read per *tree
token*: the proximal log-prob of a token is one number for every branch through it, and
the behaviour log-prob is too, because the tree builder refuses (or splits, with
``tree_builder.logprob_conflict=split``) branches that disagree on a shared token's
``old_logprobs``. So the weight multiplies the folded surrogate of each token exactly as
it multiplies each branch's term (see :mod:`treelit.objectives.rl`).

* ``mis`` (masked importance sampling): the term is weighted by ``rho_t`` where
  ``low <= rho_t <= cap`` and left out (weight 0) elsewhere; ``low`` defaults to ``1/cap``.

``behavior_is_level`` says whose ratio the weight reads: ``token`` (each token's
``rho_t``), ``sequence`` (the product of a branch's ratios over its trained tokens) or
``geometric`` (their geometric mean); the last two give one weight per branch,
computed on the tree as path sums (:mod:`treelit.objectives.behavior_seq`). The names
and definitions follow verl's rollout importance sampling (``rollout_is_mode``
truncate/mask, ``rollout_is_level``, ``rollout_is_threshold``/``_lower``).

Before the proximal log-probs overwrite the records' ``old_logprobs``,
:func:`split_behavior` keeps the latter as the behaviour log-probs
(``token_behav_logp``/``branch_behav_logp`` of a ``TreeBatch``, ``behav`` of
:class:`~treelit.loss.branches.Branches`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch

__all__ = ["CORRECTIONS", "LEVELS", "BehaviorOptions", "check_behavior_options", "ratio_weights", "behavior_weights",
           "behavior_metrics", "split_behavior", "tree_behavior", "branch_behavior"]

CORRECTIONS = ("none", "tis", "mis", "decoupled")
LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class BehaviorOptions:
    """The validated correction: ``kind`` (a :data:`CORRECTIONS` value), ``cap`` (the upper
    bound, None: none), ``low`` (``mis``'s lower bound) and ``level`` (a :data:`LEVELS` value)."""

    kind: str = "none"
    cap: Optional[float] = None
    low: Optional[float] = None
    level: str = "token"


def _bound(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"objective.{name} must be a positive number or null, got {value!r}")
    return float(value)


def check_behavior_options(correction: str, cap: Optional[float], low: Optional[float] = None,
                           level: str = "token") -> BehaviorOptions:
    """Validated ``objective.behavior_correction``, ``behavior_is_cap``, ``behavior_is_cap_low`` and
    ``behavior_is_level``; a bad value is one ValueError line naming the option."""
    if correction not in CORRECTIONS:
        raise ValueError(f"objective.behavior_correction must be one of {', '.join(CORRECTIONS)}, got {correction!r}")
    if level not in LEVELS:
        raise ValueError(f"objective.behavior_is_level must be one of {', '.join(LEVELS)}, got {level!r}")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap)
                            or cap <= 0):
        raise ValueError(f"objective.behavior_is_cap must be a positive number or null (no cap), got {cap!r}")
    cap = None if cap is None else float(cap)
    low = _bound("behavior_is_cap_low", low)
    if correction == "none" and level != "token":
        raise ValueError(f"objective.behavior_is_level={level} weights by the sampler's ratio: it needs "
                         "objective.behavior_correction=tis|mis|decoupled")
    if correction == "mis":
        if cap is None:
            raise ValueError("objective.behavior_correction=mis keeps ratios inside [behavior_is_cap_low, "
                             "behavior_is_cap]: objective.behavior_is_cap must be a number, not null")
        low = 1.0 / cap if low is None else low
        if not low < cap:
            raise ValueError(f"objective.behavior_is_cap_low={low:g} must be below objective.behavior_is_cap={cap:g}: "
                             "the bounds [low, high] of behavior_correction=mis are reversed")
    elif low is not None:
        raise ValueError(f"objective.behavior_is_cap_low={low:g} is the lower bound of behavior_correction=mis; "
                         f"behavior_correction={correction} has none: remove it (null)")
    if level == "sequence" and correction != "none" and cap is None:
        raise ValueError("objective.behavior_is_level=sequence multiplies a branch's ratios, which overflows "
                         "without a bound: objective.behavior_is_cap must be a number, not null")
    return BehaviorOptions(correction, cap, low, level)


def ratio_weights(rho: torch.Tensor, opts: BehaviorOptions) -> torch.Tensor:
    """The weight of each ratio ``rho`` (a token's or a branch's) under the correction ``opts``."""
    if opts.cap is None:
        return rho
    if opts.kind == "tis":
        return rho.clamp(max=opts.cap)
    if opts.kind == "decoupled":
        return torch.where(rho <= opts.cap, rho, torch.zeros_like(rho))
    if opts.kind == "mis":
        return torch.where((rho >= opts.low) & (rho <= opts.cap), rho, torch.zeros_like(rho))
    raise ValueError(f"no behaviour weight for objective.behavior_correction={opts.kind!r}")


def out_of_bounds(rho: torch.Tensor, opts: BehaviorOptions) -> torch.Tensor:
    """Where the correction leaves the ratio out (weight 0): ``mis`` outside ``[low, cap]``,
    ``decoupled`` above the cap; ``tis`` leaves nothing out."""
    if opts.cap is None or opts.kind == "tis":
        return torch.zeros_like(rho, dtype=torch.bool)
    if opts.kind == "mis":
        return (rho < opts.low) | (rho > opts.cap)
    return rho > opts.cap


def behavior_weights(prox: torch.Tensor, behav: torch.Tensor, correction: str, cap: Optional[float],
                     low: Optional[float] = None) -> torch.Tensor:
    """Per-token weight (float64, no gradient) from proximal and behaviour log-probs ``[M]``."""
    rho = torch.exp(prox.detach().double() - behav.detach().double())
    if correction == "mis" and low is None and cap is not None:
        low = 1.0 / cap
    return ratio_weights(rho, BehaviorOptions(correction, cap, low))


def _share(W: torch.Tensor, flag: torch.Tensor, Wsum: torch.Tensor) -> torch.Tensor:
    return (W * flag.double()).sum() / Wsum


def behavior_metrics(prox: torch.Tensor, behav: torch.Tensor, W: torch.Tensor, cap: Optional[float],
                     opts: Optional[BehaviorOptions] = None) -> Dict[str, torch.Tensor]:
    """``behavior/ratio_mean`` (weighted by the token weights ``W``), ``behavior/ratio_max`` (over
    tokens with a non-zero weight), ``behavior/kl``: KL(behaviour || proximal), estimated from the
    sampled tokens with k3 = rho - 1 - log rho (non-negative, unbiased); at the token level also
    ``behavior/truncated_frac`` (weighted share of tokens whose ratio exceeds the cap) and
    ``behavior/masked_frac`` (share left out: ``mis`` outside its bounds, ``decoupled`` above the cap).
    0-d tensors: read to the host once with the loss's other metrics (``host_floats``)."""
    opts = opts or BehaviorOptions("tis", cap)
    d = prox.detach().double() - behav.detach().double()
    rho = torch.exp(d)
    W = W.detach().double()
    Wsum = W.sum().clamp(min=1e-30)
    live = W != 0
    top = torch.where(live, rho, torch.full_like(rho, -math.inf)).max() if rho.numel() else rho.new_ones(())
    out = {
        "behavior/ratio_mean": (W * rho).sum() / Wsum,
        "behavior/ratio_max": torch.where(torch.isfinite(top), top, torch.ones_like(top)),
        "behavior/kl": (W * (rho - 1.0 - d)).sum() / Wsum,
    }
    if opts.level == "token":
        out["behavior/truncated_frac"] = _share(W, rho > cap, Wsum) if cap is not None else W.new_zeros(())
        out["behavior/masked_frac"] = _share(W, out_of_bounds(rho, opts), Wsum)
    return out


def split_behavior(x) -> None:
    """Keep the records' ``old_logprobs`` of ``x`` (a ``TreeBatch`` or ``Branches``) as its
    behaviour log-probs, before the proximal ones replace them (a row keeps its host copy)."""
    if hasattr(x, "token_old_logp"):
        known = x._host_copy("token_old_logp") if hasattr(x, "_host_copy") else None
        x.token_behav_logp = x.token_old_logp
        x.branch_behav_logp = x.branch_old_logp
        if known is not None:
            x._host_copies["token_behav_logp"] = (x.token_behav_logp, known)
    else:
        x.behav = x.old


def _missing(correction: str) -> ValueError:
    return ValueError(
        f"objective.behavior_correction={correction} needs the sampler's log-probs (old_logprobs in the records) on "
        "every target token, kept as behaviour log-probs while old_logprobs=rollout recomputes the proximal ones")


def check_tree_behavior(batch, correction: str) -> torch.Tensor:
    """The row's behaviour log-probs ``[N]``, checked once on the host copy: known on every target token."""
    behav = getattr(batch, "token_behav_logp", None)
    if behav is None:
        raise _missing(correction)
    if getattr(batch, "_behav_checked", None) is not behav:
        target = (batch.host("target_count") != 0) & (batch.host("parent") >= 0)
        if np.isnan(batch.host("token_behav_logp")[target]).any():
            raise _missing(correction)
        batch._behav_checked = behav
    return behav


def tree_behavior(batch, sel: torch.Tensor, prox: torch.Tensor, W: torch.Tensor,
                  opts: BehaviorOptions) -> Tuple[Optional[torch.Tensor], Dict[str, torch.Tensor]]:
    """Token level: weights ``[M]`` of the tree tokens ``sel`` (None without correction, or at a
    sequence level, whose per-branch weights :mod:`treelit.objectives.behavior_seq` folds) and
    the per-token metrics."""
    if opts.kind == "none":
        return None, {}
    behav = check_tree_behavior(batch, opts.kind)[sel].to(prox.device)
    metrics = behavior_metrics(prox, behav, W, opts.cap, opts)
    if opts.level != "token":
        return None, metrics
    rho = torch.exp(prox.detach().double() - behav.detach().double())
    return ratio_weights(rho, opts), metrics


def branch_behavior(br, b: int, prox: torch.Tensor, opts: BehaviorOptions) -> Optional[torch.Tensor]:
    """Branch ``b``'s weights for its tokens 1.. (1 where it has no target), per branch: no tree.
    At a sequence level every target token of the branch carries the branch's one weight."""
    if opts.kind == "none":
        return None
    m = br.masks[b][1:]
    behav = None if br.behav is None else br.behav[b][1:]
    if behav is None or np.isnan(behav[m]).any():
        raise _missing(opts.kind)
    behav = torch.from_numpy(np.where(m, behav, 0.0)).to(prox.device)
    mask = torch.from_numpy(m).to(prox.device)
    if opts.level == "token":
        w = ratio_weights(torch.exp(prox.detach().double() - behav), opts)
    else:  # the branch's log-ratio: summed over its targets (sequence), or their mean (geometric)
        d = torch.where(mask, prox.detach().double() - behav, torch.zeros_like(behav)).sum()
        if opts.level == "geometric":
            d = d / max(int(m.sum()), 1)
        w = ratio_weights(torch.exp(d), opts).expand(len(m))
    return torch.where(mask, w, torch.ones_like(w))
