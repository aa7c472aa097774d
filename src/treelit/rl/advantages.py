"""Advantage estimators (registry kind ``advantage``).

Each estimator maps per-sample rewards and group keys (samples sharing a key are
rollouts of the same prompt/task) to per-sample advantages. Its ``scope`` says what
it normalises over:

* ``grpo`` (scope ``group``): ``(r - mean_group) / (std_group + eps)`` with the
  unbiased (n - 1) standard deviation of the group; ``scale_by_std=False`` keeps only
  the centring (``r - mean_group``, as in Dr. GRPO);
* ``rloo`` (scope ``group``): ``r - mean of the other samples of the group``;
* ``reinforce_pp`` (scope ``batch``): REINFORCE++ as published: the reward centred and
  scaled over the whole batch, ``(r - mean_batch) / (std_batch + eps)`` (population
  standard deviation); groups play no part;
* ``reinforce_pp_baseline`` (scope ``group``): REINFORCE++ with a group baseline,
  ``r - mean_group``, then scaled by the standard deviation of those values over the batch;
* ``raw`` (scope ``sample``): ``r``.

A group with one sample has no relative signal: the group-scoped estimators give it
advantage 0. :func:`compute_advantages` warns with the number of such groups, and
refuses when every group is a singleton (training would have no signal at all), naming
the group key so the data can be fixed. Non-finite results (e.g. ``eps=0`` on a group
whose rewards are all equal) are refused with the estimator and the group named.
"""

from __future__ import annotations

import logging
from typing import Dict, Hashable, List, Sequence

import numpy as np

from treelit.registry import get_registry

__all__ = ["ADVANTAGES", "AdvantageError", "compute_advantages", "estimator_scope"]

log = logging.getLogger(__name__)

ADVANTAGES = get_registry("advantage", ["treelit.rl.advantages"])


class AdvantageError(ValueError):
    """Rewards that give no usable advantages (every group a singleton, non-finite values)."""


def _scoped(scope: str):
    def mark(fn):
        fn.scope = scope
        return fn

    return mark


def groups_of(keys: Sequence[Hashable]) -> Dict[Hashable, List[int]]:
    """Indices per group key; a ``None`` key is a group of its own."""
    out: Dict[Hashable, List[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(("__single__", i) if k is None else k, []).append(i)
    return out


@ADVANTAGES.register("grpo")
@_scoped("group")
def grpo(rewards: np.ndarray, keys: Sequence[Hashable], eps: float = 1e-6, scale_by_std: bool = True) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in groups_of(keys).values():
        r = rewards[idx]
        centred = r - r.mean()
        if scale_by_std and len(idx) > 1:
            with np.errstate(invalid="ignore", divide="ignore"):
                centred = centred / (r.std(ddof=1) + eps)
        adv[idx] = centred
    return adv


@ADVANTAGES.register("rloo")
@_scoped("group")
def rloo(rewards: np.ndarray, keys: Sequence[Hashable]) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in groups_of(keys).values():
        r = rewards[idx]
        n = len(idx)
        adv[idx] = 0.0 if n == 1 else r - (r.sum() - r) / (n - 1)
    return adv


@ADVANTAGES.register("reinforce_pp")
@_scoped("batch")
def reinforce_pp(rewards: np.ndarray, keys: Sequence[Hashable], eps: float = 1e-6) -> np.ndarray:
    centred = rewards - rewards.mean()
    with np.errstate(invalid="ignore", divide="ignore"):
        return centred / (centred.std() + eps)


@ADVANTAGES.register("reinforce_pp_baseline")
@_scoped("group")
def reinforce_pp_baseline(rewards: np.ndarray, keys: Sequence[Hashable], eps: float = 1e-6) -> np.ndarray:
    adv = np.zeros_like(rewards)
    for idx in groups_of(keys).values():
        adv[idx] = rewards[idx] - rewards[idx].mean()
    if len(adv) < 2:
        return adv
    with np.errstate(invalid="ignore", divide="ignore"):
        return adv / (adv.std() + eps)


@ADVANTAGES.register("raw")
@_scoped("sample")
def raw(rewards: np.ndarray, keys: Sequence[Hashable]) -> np.ndarray:
    return rewards.astype(np.float64).copy()


def estimator_scope(name: str) -> str:
    """``group``, ``batch`` or ``sample``: what the estimator ``name`` normalises over."""
    return getattr(ADVANTAGES.get(name), "scope", "group")


def compute_advantages(
    name: str, rewards: Sequence[float], keys: Sequence[Hashable], *, key_name: str = "group",
    check_singletons: bool = True, **options
) -> np.ndarray:
    """Advantages of the samples with ``rewards`` grouped by ``keys`` (``None``: a group of one).

    ``key_name`` is the data field the keys come from; it is named in warnings and errors.
    ``check_singletons=False`` leaves the singleton-group warning and refusal to the caller
    (a builder that sees the groups piece by piece counts them over the whole data).
    Raises :class:`AdvantageError` when every group is a singleton (group-scoped estimators),
    when a batch-scoped estimator gets fewer than two samples, or when an advantage is not finite.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(r) != len(keys):
        raise ValueError(f"need one reward per branch: {len(r)} rewards for {len(keys)} group keys")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    fn = ADVANTAGES.get(name)
    scope = getattr(fn, "scope", "group")
    groups = groups_of(keys)
    if scope == "group" and len(r) and check_singletons:
        single = sum(1 for idx in groups.values() if len(idx) == 1)
        if single == len(groups):
            raise AdvantageError(
                f"advantage estimator {name!r}: {'the only group' if len(groups) == 1 else f'all {len(groups)} groups'} "
                f"(samples sharing '{key_name}') {'has' if len(groups) == 1 else 'have'} a single sample, so every "
                "advantage would be 0 and training would have no signal; give the rollouts of one "
                f"prompt the same '{key_name}' value, or use advantage=reinforce_pp (normalised over the batch)"
            )
        if single:
            log.warning(
                "advantage estimator %r: %d of %d groups (samples sharing '%s') %s a single sample; "
                "%s advantage is 0", name, single, len(groups), key_name,
                "has" if single == 1 else "have", "its" if single == 1 else "their",
            )
    if scope == "batch" and len(r) < 2:
        raise AdvantageError(f"advantage estimator {name!r} normalises over the batch and needs at least two samples, got {len(r)}")
    adv = np.asarray(fn(r, list(keys), **options), dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(adv))
    if bad.size:
        i = int(bad[0])
        if scope == "group" and keys[i] is not None:
            where, members = f"the group {key_name}={keys[i]!r}", groups[keys[i]]
        else:
            where, members = "the batch", list(range(len(r)))
        raise AdvantageError(
            f"advantage estimator {name!r} gave a non-finite advantage in {where} "
            f"(rewards {r[members][:8].tolist()}, options {options}); with eps=0 a group whose rewards are all "
            "equal divides 0 by 0: use eps > 0"
        )
    return adv
