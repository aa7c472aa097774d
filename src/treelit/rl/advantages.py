"""Advantage estimators (registry kind ``advantage``).

Each estimator maps per-branch rewards and group keys (branches sharing a key are
samples of the same prompt/task) to per-branch advantages:

* ``grpo``: ``(r - mean_group) / (std_group + eps)`` (group-relative, unbiased std
  optional; a group of one gets 0);
* ``rloo``: ``r - mean of the other samples of the group`` (leave-one-out baseline);
* ``reinforce_pp``: REINFORCE++ with a group baseline: ``r - mean_group``, then
  normalised by the standard deviation over the whole batch;
* ``raw``: ``r``.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Sequence

import numpy as np

from treelit.registry import get_registry

__all__ = ["ADVANTAGES", "compute_advantages"]

ADVANTAGES = get_registry("advantage", ["treelit.rl.advantages"])


def _groups(keys: Sequence[Hashable]) -> Dict[Hashable, List[int]]:
    out: Dict[Hashable, List[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(("__single__", i) if k is None else k, []).append(i)
    return out


@ADVANTAGES.register("grpo")
def grpo(rewards: np.ndarray, keys: Sequence[Hashable], eps: float = 1e-6, scale_by_std: bool = True) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in _groups(keys).values():
        r = rewards[idx]
        centred = r - r.mean()
        adv[idx] = centred / (r.std(ddof=1) + eps) if scale_by_std and len(idx) > 1 else centred
    return adv


@ADVANTAGES.register("rloo")
def rloo(rewards: np.ndarray, keys: Sequence[Hashable]) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in _groups(keys).values():
        r = rewards[idx]
        n = len(idx)
        adv[idx] = 0.0 if n == 1 else r - (r.sum() - r) / (n - 1)
    return adv


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards: np.ndarray, keys: Sequence[Hashable], eps: float = 1e-6) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in _groups(keys).values():
        adv[idx] = rewards[idx] - rewards[idx].mean()
    return adv / (adv.std() + eps) if len(adv) > 1 else adv


@ADVANTAGES.register("raw")
def raw(rewards: np.ndarray, keys: Sequence[Hashable]) -> np.ndarray:
    return rewards.astype(np.float64).copy()


def compute_advantages(name: str, rewards: Sequence[float], keys: Sequence[Hashable], **options) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(r) != len(keys):
        raise ValueError(f"need one reward per branch: {len(r)} rewards for {len(keys)} group keys")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    return ADVANTAGES.get(name)(r, list(keys), **options)
