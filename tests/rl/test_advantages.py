"""Advantage estimators from their definitions."""

from __future__ import annotations

import numpy as np
import pytest

from treelit.rl.advantages import compute_advantages

R = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 3.0]
G = ["a", "a", "a", "a", "b", "b", None]


def test_grpo_is_group_normalised():
    adv = compute_advantages("grpo", R, G, eps=0.0)
    a = np.array(R[:4])
    np.testing.assert_allclose(adv[:4], (a - a.mean()) / a.std(ddof=1))
    b = np.array(R[4:6])
    np.testing.assert_allclose(adv[4:6], (b - b.mean()) / b.std(ddof=1))
    assert adv[6] == 0.0  # a group of one has no relative signal


def test_rloo_uses_the_other_samples():
    adv = compute_advantages("rloo", R, G)
    for i in range(4):
        others = [R[j] for j in range(4) if j != i]
        assert adv[i] == pytest.approx(R[i] - np.mean(others))
    assert adv[6] == 0.0


def test_reinforce_pp_and_raw():
    adv = compute_advantages("reinforce_pp", R, G, eps=0.0)
    centred = np.array([r - np.mean(R[:4]) for r in R[:4]] + [r - np.mean(R[4:6]) for r in R[4:6]] + [0.0])
    np.testing.assert_allclose(adv, centred / centred.std())
    np.testing.assert_allclose(compute_advantages("raw", R, G), R)


def test_errors():
    with pytest.raises(KeyError, match="unknown advantage 'ppo'.*grpo"):
        compute_advantages("ppo", R, G)
    with pytest.raises(ValueError, match="one reward per branch"):
        compute_advantages("grpo", R[:3], G)
    with pytest.raises(ValueError, match="finite"):
        compute_advantages("grpo", [1.0, float("nan")], ["a", "a"])
