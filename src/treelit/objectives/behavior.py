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

Before the proximal log-probs overwrite the records' ``old_logprobs``,
:func:`split_behavior` keeps the latter as the behaviour log-probs
(``token_behav_logp``/``branch_behav_logp`` of a ``TreeBatch``, ``behav`` of
:class:`~treelit.loss.branches.Branches`).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch

__all__ = ["CORRECTIONS", "check_behavior_options", "behavior_weights", "behavior_metrics", "split_behavior",
           "tree_behavior", "branch_behavior"]

CORRECTIONS = ("none", "tis", "decoupled")


def check_behavior_options(correction: str, cap: Optional[float]) -> Tuple[str, Optional[float]]:
    """Validated ``(objective.behavior_correction, objective.behavior_is_cap)``."""
    if correction not in CORRECTIONS:
        raise ValueError(f"objective.behavior_correction must be one of {', '.join(CORRECTIONS)}, got {correction!r}")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"objective.behavior_is_cap must be a positive number or null (no cap), got {cap!r}")
        cap = float(cap)
    return correction, cap


def behavior_weights(prox: torch.Tensor, behav: torch.Tensor, correction: str, cap: Optional[float]) -> torch.Tensor:
    """Per-token weight (float64, no gradient) from proximal and behaviour log-probs ``[M]``."""
    rho = torch.exp(prox.detach().double() - behav.detach().double())
    if cap is None:
        return rho
    if correction == "tis":
        return rho.clamp(max=cap)
    if correction == "decoupled":
        return torch.where(rho <= cap, rho, torch.zeros_like(rho))
    raise ValueError(f"no behaviour weight for objective.behavior_correction={correction!r}")


def behavior_metrics(prox: torch.Tensor, behav: torch.Tensor, W: torch.Tensor, cap: Optional[float]) -> Dict[str, float]:
    """``behavior/ratio_mean`` (weighted by the token weights ``W``), ``behavior/ratio_max`` (over
    tokens with a non-zero weight), ``behavior/truncated_frac`` (weighted share of tokens whose
    ratio exceeds the cap) and ``behavior/kl``: KL(behaviour || proximal), estimated from the
    sampled tokens with k3 = rho - 1 - log rho (non-negative, unbiased)."""
    d = prox.detach().double() - behav.detach().double()
    rho = torch.exp(d)
    W = W.detach().double()
    Wsum = max(float(W.sum()), 1e-30)
    live = W != 0
    over = (rho > cap).double() if cap is not None else torch.zeros_like(rho)
    return {
        "behavior/ratio_mean": float((W * rho).sum()) / Wsum,
        "behavior/ratio_max": float(rho[live].max()) if bool(live.any()) else 1.0,
        "behavior/truncated_frac": float((W * over).sum()) / Wsum,
        "behavior/kl": float((W * (rho - 1.0 - d)).sum()) / Wsum,
    }


def split_behavior(x) -> None:
    """Keep the records' ``old_logprobs`` of ``x`` (a ``TreeBatch`` or ``Branches``) as its
    behaviour log-probs, before the proximal ones replace them."""
    if hasattr(x, "token_old_logp"):
        x.token_behav_logp = x.token_old_logp
        x.branch_behav_logp = x.branch_old_logp
    else:
        x.behav = x.old


def _missing(correction: str) -> ValueError:
    return ValueError(
        f"objective.behavior_correction={correction} needs the sampler's log-probs (old_logprobs in the records) on "
        "every target token, kept as behaviour log-probs while old_logprobs=rollout recomputes the proximal ones")


def tree_behavior(batch, sel: torch.Tensor, prox: torch.Tensor, W: torch.Tensor, correction: str,
                  cap: Optional[float]) -> Tuple[Optional[torch.Tensor], Dict[str, float]]:
    """Weights ``[M]`` of the tree tokens ``sel`` (None without correction) and their metrics."""
    if correction == "none":
        return None, {}
    behav = getattr(batch, "token_behav_logp", None)
    if behav is None or torch.isnan(behav[sel]).any():
        raise _missing(correction)
    behav = behav[sel].to(prox.device)
    return behavior_weights(prox, behav, correction, cap), behavior_metrics(prox, behav, W, cap)


def branch_behavior(br, b: int, prox: torch.Tensor, correction: str, cap: Optional[float]) -> Optional[torch.Tensor]:
    """Branch ``b``'s weights for its tokens 1.. (1 where it has no target), per branch: no tree."""
    if correction == "none":
        return None
    m = br.masks[b][1:]
    behav = None if br.behav is None else br.behav[b][1:]
    if behav is None or np.isnan(behav[m]).any():
        raise _missing(correction)
    behav = torch.from_numpy(np.where(m, behav, 0.0)).to(prox.device)
    w = behavior_weights(prox, behav, correction, cap)
    return torch.where(torch.from_numpy(m).to(w.device), w, torch.ones_like(w))
