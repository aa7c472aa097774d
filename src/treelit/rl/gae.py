"""Generalized advantage estimation (GAE) on a tree: per (token, branch), from shared values.

A value is a function of the prefix, so a tree token has one value, shared by every branch
through it. Advantages and returns are not shared: each branch has its own future. They are
computed here for every (branch, token) pair of a row's *flat* branch list
(``TreeBatch.branch_ptr`` / ``branch_tokens``), in float64, from the tree tokens' values.

Definition (per branch ``b``; the reference tests write it again from scratch):

* the branch's **actions** are its target tokens ``a_1 .. a_T`` in order (loss mask 1,
  never position 0); other tokens (prompt, tool output) are not time steps;
* ``V_i`` is the value of the state before ``a_i`` (read from the hidden state of
  ``a_i``'s parent, where ``a_i``'s log-prob is read too);
* rewards: ``r_T = reward_b`` (the branch's ``reward``), or per token from the branch's
  ``token_rewards`` (one number per token; a reward on a token that is not an action is
  credited to the last action before it);
* ``delta_i = r_i + gamma V_{i+1} - V_i`` with ``V_{T+1} = 0`` (the branch ends);
  ``A_i = delta_i + gamma lam A_{i+1}``; the return is ``R_i = A_i + V_i``.

Whitening (optional, :func:`whiten`) centres and scales the advantages of every action pair
of the step by their mean and standard deviation, summed over the micro-batches and ranks
by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["PairGAE", "check_gae_options", "branch_rewards", "gae_pairs", "whiten", "value_sums", "explained_variance"]


def check_gae_options(gamma: Any, lam: Any) -> Tuple[float, float]:
    """``objective.gamma`` and ``objective.lam`` as floats in [0, 1], or one line naming the option."""
    out = []
    for name, v in (("gamma", gamma), ("lam", lam)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= float(v) <= 1.0) or math.isnan(v):
            raise ValueError(f"objective.{name}={v!r}: must be a number in [0, 1]")
        out.append(float(v))
    return out[0], out[1]


@dataclass
class PairGAE:
    """Per flat branch position ``[F]`` (float64 numpy): ``action`` (bool), ``adv`` and ``ret``
    (NaN where not an action), ``value`` (the value read at that action, NaN elsewhere)."""

    action: np.ndarray
    adv: np.ndarray
    ret: np.ndarray
    value: np.ndarray


def branch_rewards(fields, b: int, length: int, where: str = "") -> np.ndarray:
    """Branch ``b``'s per-token rewards ``[length]`` from its ``token_rewards`` or, failing that,
    its ``reward`` (at its last token); one line naming the branch when it has neither."""
    tok = (fields.get("token_rewards") or [None] * (b + 1))[b] if fields else None
    if tok is not None:
        arr = np.array([0.0 if x is None else float(x) for x in tok], dtype=np.float64)
        if arr.shape[0] != length:
            raise ValueError(f"{where}branch {b}: {arr.shape[0]} token_rewards for {length} tokens")
        if not np.isfinite(arr).all():
            raise ValueError(f"{where}branch {b}: token_rewards must be finite numbers")
        return arr
    r = (fields.get("reward") or [None] * (b + 1))[b] if fields else None
    if r is None or not math.isfinite(float(r)):
        raise ValueError(f"{where}branch {b} has no reward: GAE (critic) needs a finite 'reward' or 'token_rewards' "
                         "on every branch")
    arr = np.zeros(length, dtype=np.float64)
    arr[-1] = float(r)
    return arr


def _branch_gae(values: np.ndarray, rewards: np.ndarray, targets: np.ndarray, gamma: float, lam: float,
                name: str = ""):
    """One branch: ``values [L]`` (the value before each token), ``rewards [L]``, ``targets [L]``
    (bool: the actions). Returns ``(adv [L], ret [L])``, NaN off the actions."""
    L = len(targets)
    adv = np.full(L, np.nan)
    ret = np.full(L, np.nan)
    act = np.flatnonzero(targets)
    if not len(act):
        return adv, ret
    # a reward on a non-action token goes to the last action before it; before the first action nothing the
    # policy did caused it, and it is refused rather than dropped
    owner = np.searchsorted(act, np.arange(L), side="right") - 1
    r = np.zeros(len(act))
    keep = owner >= 0
    early = np.flatnonzero(~keep & (rewards != 0))
    if len(early):
        raise ValueError(f"{name}a reward ({rewards[early[0]]:g}) at token {int(early[0])}, before the branch's first "
                         f"action (token {int(act[0])}): no action of the policy earned it; put it on an action "
                         "or a later token")
    np.add.at(r, owner[keep], rewards[keep])
    v = values[act]
    last = 0.0
    for i in range(len(act) - 1, -1, -1):
        nxt = v[i + 1] if i + 1 < len(act) else 0.0
        delta = r[i] + gamma * nxt - v[i]
        last = delta + gamma * lam * last
        adv[act[i]] = last
        ret[act[i]] = last + v[i]
    return adv, ret


def gae_pairs(branch_ptr: np.ndarray, branch_tokens: np.ndarray, branch_mask: np.ndarray, token_values: np.ndarray,
              fields, gamma: float, lam: float, where: str = "") -> PairGAE:
    """GAE of every (branch, token) pair of a row.

    ``branch_ptr [B+1]``, ``branch_tokens [F]`` (tree index of every flat position),
    ``branch_mask [F]``: the row's branch tables (:class:`~treelit.tree.batch.TreeBatch`);
    ``token_values [N]``: the value of each tree token's state (read at its parent), for
    every target token; ``fields``: the row's ``branch_fields`` (``reward`` / ``token_rewards``)."""
    F = len(branch_tokens)
    action = np.zeros(F, dtype=bool)
    adv = np.full(F, np.nan)
    ret = np.full(F, np.nan)
    value = np.full(F, np.nan)
    for b in range(len(branch_ptr) - 1):
        s, e = int(branch_ptr[b]), int(branch_ptr[b + 1])
        targets = branch_mask[s:e].astype(bool).copy()
        targets[0] = False  # nothing predicts a branch's first token
        if not targets.any():
            continue
        vals = token_values[branch_tokens[s:e]]
        if np.isnan(vals[targets]).any():
            raise ValueError(f"{where}branch {b}: a target token has no value")
        a, r = _branch_gae(vals, branch_rewards(fields, b, e - s, where), targets, gamma, lam,
                           f"{where}branch {b}: ")
        action[s:e], adv[s:e], ret[s:e] = targets, a, r
        value[s:e] = np.where(targets, vals, np.nan)
    return PairGAE(action, adv, ret, value)


def whiten(advs: Sequence[np.ndarray], total: Tuple[float, float, float], eps: float = 1e-8) -> List[np.ndarray]:
    """``(a - mean) / (std + eps)`` of every action pair, with ``total = (count, sum, sum of
    squares)`` over the whole step (all micro-batches, all ranks); population standard deviation."""
    n, s, ss = total
    if n <= 0:
        return list(advs)
    mean = s / n
    std = math.sqrt(max(ss / n - mean * mean, 0.0))
    return [(a - mean) / (std + eps) for a in advs]


def value_sums(values: np.ndarray, returns: np.ndarray) -> np.ndarray:
    """``[n, sum R, sum R^2, sum (R - V), sum (R - V)^2]`` of action pairs: summed over
    micro-batches and ranks, :func:`explained_variance` reads them."""
    d = returns - values
    return np.array([len(returns), returns.sum(), (returns * returns).sum(), d.sum(), (d * d).sum()], dtype=np.float64)


def explained_variance(sums: Sequence[float]) -> float:
    """``1 - Var(R - V) / Var(R)`` from :func:`value_sums` (NaN when the returns do not vary)."""
    n, sr, sr2, sd, sd2 = (float(x) for x in sums)
    if n <= 0:
        return float("nan")
    var_r = sr2 / n - (sr / n) ** 2
    if var_r <= 1e-12 * max(sr2 / n, 1e-300):
        return float("nan")
    return 1.0 - (sd2 / n - (sd / n) ** 2) / var_r
