"""Advantage estimators from their definitions, and the refusals that keep RL from training on nothing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from treelit.rl.advantages import AdvantageError, compute_advantages, estimator_scope

R = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 3.0]
G = ["a", "a", "a", "a", "b", "b", None]


def test_grpo_is_group_normalised_with_the_unbiased_std():
    adv = compute_advantages("grpo", R, G, eps=0.0)
    a = np.array(R[:4])
    np.testing.assert_allclose(adv[:4], (a - a.mean()) / a.std(ddof=1))
    b = np.array(R[4:6])
    np.testing.assert_allclose(adv[4:6], (b - b.mean()) / b.std(ddof=1))
    assert adv[6] == 0.0  # a group of one has no relative signal
    centred = compute_advantages("grpo", R, G, scale_by_std=False)
    np.testing.assert_allclose(centred[:4], a - a.mean())


def test_rloo_uses_the_other_samples():
    adv = compute_advantages("rloo", R, G)
    for i in range(4):
        others = [R[j] for j in range(4) if j != i]
        assert adv[i] == pytest.approx(R[i] - np.mean(others))
    assert adv[6] == 0.0


def test_reinforce_pp_is_batch_normalised_and_ignores_groups():
    """REINFORCE++: (r - batch mean) / batch std; the groups play no part."""
    adv = compute_advantages("reinforce_pp", R, G, eps=0.0)
    r = np.array(R)
    np.testing.assert_allclose(adv, (r - r.mean()) / r.std())
    np.testing.assert_allclose(compute_advantages("reinforce_pp", R, [None] * len(R), eps=0.0), adv)
    assert estimator_scope("reinforce_pp") == "batch"
    with pytest.raises(AdvantageError, match="needs at least two samples"):
        compute_advantages("reinforce_pp", [1.0], [None])


def test_reinforce_pp_baseline_and_raw():
    adv = compute_advantages("reinforce_pp_baseline", R, G, eps=0.0)
    centred = np.array([r - np.mean(R[:4]) for r in R[:4]] + [r - np.mean(R[4:6]) for r in R[4:6]] + [0.0])
    np.testing.assert_allclose(adv, centred / centred.std())
    np.testing.assert_allclose(compute_advantages("raw", R, G), R)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_singleton_groups_warn_with_their_count(name, caplog):
    with caplog.at_level(logging.WARNING, logger="treelit.rl.advantages"):
        compute_advantages(name, [1.0, 0.0, 1.0, 2.0], ["a", "a", "b", None], key_name="task_id")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "2 of 3 groups" in msgs[0] and "'task_id'" in msgs[0], msgs


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_all_singleton_groups_are_refused_naming_the_key(name):
    with pytest.raises(AdvantageError, match=r"all 3 groups \(samples sharing 'task_id'\) have a single sample"):
        compute_advantages(name, [1.0, 0.0, 1.0], ["a", "b", None], key_name="task_id")
    # reinforce_pp needs no group
    assert np.all(compute_advantages("reinforce_pp", [1.0, 0.0, 1.0], ["a", "b", None]) != 0)


def test_eps_zero_on_an_all_equal_group_names_estimator_and_group():
    with pytest.raises(AdvantageError, match=r"'grpo' gave a non-finite advantage in the group prompt='p2'.*eps > 0"):
        compute_advantages("grpo", [1.0, 0.0, 1.0, 1.0], ["p1", "p1", "p2", "p2"], eps=0.0, key_name="prompt")
    with pytest.raises(AdvantageError, match=r"'reinforce_pp' gave a non-finite advantage in the batch"):
        compute_advantages("reinforce_pp", [1.0, 1.0], [None, None], eps=0.0)


def test_errors():
    with pytest.raises(KeyError, match="unknown advantage 'ppo'.*grpo"):
        compute_advantages("ppo", R, G)
    with pytest.raises(ValueError, match="one reward per branch"):
        compute_advantages("grpo", R[:3], G)
    with pytest.raises(ValueError, match="finite"):
        compute_advantages("grpo", [1.0, float("nan")], ["a", "a"])
