"""Masked importance sampling and sequence-level corrections == per-branch formulas.

``objective.behavior_correction=tis|mis|decoupled`` with ``behavior_is_level=token|sequence|geometric``.
The references are written one branch at a time from the definitions, with no treelit loss code:
each branch runs through the model as its own sequence; per target token t of branch b, with
proximal log-prob ``prox``, behaviour log-prob ``behav`` and trained log-prob ``lp``:

    token level:      rho = exp(prox_t - behav_t)                      (one ratio per token)
    sequence level:   rho = exp(sum_t (prox_t - behav_t))              (one ratio per branch)
    geometric level:  rho = exp(mean_t (prox_t - behav_t))             (one ratio per branch)
    tis:        w = min(rho, cap)
    mis:        w = rho if low <= rho <= cap else 0     (low: 1/cap unless given)
    decoupled:  w = rho if rho <= cap else 0
    PPO/GRPO:   term = -c_b w min(r A_b, clip(r) A_b),  r = exp(lp - prox)
    GSPO:       term_b = -(sum_t c_b w) min(s_b A_b, clip(s_b) A_b),  s_b = exp(mean_t (lp - prox))

The tree (unpartitioned and partitioned) and the objective's per-branch form are compared with
them in float64, loss and every parameter gradient; every example trains something (one branch's
tokens keep ratio 1 on both sides, so it is neither clipped nor masked).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treelit
from helpers import assert_equivalent, cached_model
from strategies import forests
from treelit.objectives import make_objective
from treelit.partition import tree_backward

from test_behavior_correction import corrected_batch, corrected_branches  # noqa: E402  (the corrected rows)
from test_rl import branch_logprobs, counts, norm, scale  # noqa: E402  (the per-branch pieces of the RL tests)


def weight(rho: float, kind: str, cap, low) -> float:
    if cap is None:
        return rho
    if kind == "tis":
        return min(rho, cap)
    if kind == "mis":
        lo = 1.0 / cap if low is None else low
        return rho if lo <= rho <= cap else 0.0
    return rho if rho <= cap else 0.0


def target_weights(case, prox_b, behav_b, targets):
    """{t: w} for branch b's target positions, from the definition at the case's level."""
    kind, cap, low = case["behavior_correction"], case.get("behavior_is_cap", 2.0), case.get("behavior_is_cap_low")
    level = case.get("behavior_is_level", "token")
    if level == "token":
        return {t: weight(math.exp(prox_b[t] - behav_b[t]), kind, cap, low) for t in targets}
    log_rho = sum(prox_b[t] - behav_b[t] for t in targets)
    if level == "geometric":
        log_rho /= len(targets)
    w = weight(math.exp(log_rho), kind, cap, low)
    return {t: w for t in targets}


def reference(case, model, br, masks, w, adv, prox, behav, agg):
    obj = make_objective(**case)
    n = counts(masks)

    def loss():
        total = torch.zeros((), dtype=torch.float64)
        for b, ids in enumerate(br):
            targets = [t for t in range(1, len(ids)) if masks[b][t]]
            if not targets:
                continue
            lp, _ = branch_logprobs(model, ids)
            wt = target_weights(case, prox[b], behav[b], targets)
            c = w[b] * scale(agg, n[0][b])
            A = adv[b]
            if case["name"] == "gspo":
                s = torch.exp(sum(lp[t - 1] - prox[b][t] for t in targets) / len(targets))
                J = torch.minimum(s * A, torch.clamp(s, 1 - obj.clip_low, 1 + obj.clip_high) * A)
                total = total - c * sum(wt.values()) * J
                continue
            for t in targets:
                r = torch.exp(lp[t - 1] - prox[b][t])
                J = torch.minimum(r * A, torch.clamp(r, 1 - obj.clip_low, 1 + obj.clip_high) * A)
                if case.get("dual_clip") is not None and A < 0:
                    J = torch.maximum(J, torch.tensor(case["dual_clip"] * A, dtype=J.dtype))
                total = total - c * wt[t] * J
        Z = norm(agg, n)
        return total / Z if Z else total * 0.0

    return loss


def anchored_rollout(model, br, masks, w, seed, spread=(0.3, 0.6)):
    """Proximal and behaviour log-probs per branch token: the current log-prob plus per-prefix
    offsets (branches sharing a token agree), wide enough to clip, truncate and mask; the
    tokens of the first trained branch keep offsets 0 (ratios 1), so every example trains."""
    rng = np.random.default_rng(seed)
    anchor = next(b for b, ids in enumerate(br) if w[b] and any(masks[b][1:]))
    offsets = {tuple(br[anchor][: t + 1]): (0.0, 0.0) for t in range(1, len(br[anchor]))}
    prox, behav = [], []
    for ids in br:
        lp = branch_logprobs(model, ids)[0] if len(ids) > 1 else torch.zeros(0)
        p, q = [None], [None]
        for t in range(1, len(ids)):
            key = tuple(ids[: t + 1])
            if key not in offsets:
                offsets[key] = (float(rng.normal(0, spread[0])), float(rng.normal(0, spread[1])))
            p.append(min(float(lp[t - 1]) + offsets[key][0], 0.0 if offsets[key][0] == 0 else -1e-3))  # log-probs
            q.append(min(p[-1] + offsets[key][1], p[-1] if offsets[key][1] == 0 else -1e-3))
        prox.append(p)
        behav.append(q)
    return prox, behav


def check_all_paths(case, model, br, masks, w, adv, prox, behav, agg, budget):
    obj = make_objective(**case)
    ref = reference(case, model, br, masks, w, adv, prox, behav, agg)
    what = "/".join(str(case.get(k)) for k in ("name", "behavior_correction", "behavior_is_level")) + f"/{agg}"
    batch = corrected_batch(br, masks, w, adv, prox, behav)
    assert_equivalent(model, lambda: obj.tree_loss(model, batch, aggregation=agg, normalizer=None, attention="segment")[0],
                      ref, torch.float64, what, forest=(br, masks, w))
    branches = corrected_branches(br, masks, w, adv, prox, behav)
    assert_equivalent(model, lambda: obj.linear_loss(model, branches, aggregation=agg, normalizer=None)[0],
                      ref, torch.float64, what + "/linear")

    def partitioned():  # cut into sub-trees under `budget` tokens per chain
        v = tree_backward(model, batch, agg, budget_tokens=budget, attention="segment", objective=obj)
        return torch.tensor(v, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(model, partitioned, ref, torch.float64, what + f"/partitioned({budget})")
    return obj, batch


# a tree with a branch that is a prefix of another and a duplicate branch; two trees in the row
FIXED = (
    [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4], [1, 2, 3, 7, 8, 9], [1, 2, 3, 7, 8, 9], [1, 2, 10, 0, 5], [9, 8, 7, 6]],
    [[0, 1, 1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1]],
    [1.0, 1.0, 2.0, 1.0, 0.5, 1.0],
)
FIXED_ADV = [1.0, -0.5, 2.0, -1.5, 0.7, -0.3]


def test_mis_and_geometric_correction_match_the_per_branch_formula():
    """The default-suite case: token-level MIS (PPO with dual clip) and geometric-level MIS
    and TIS (GRPO, GSPO) on a fixed row, tree, per-branch and partitioned; the bounds bite."""
    model = cached_model("qwen2_tiny", torch.float64)
    br, masks, w = FIXED
    with torch.no_grad():
        prox, behav = anchored_rollout(model, br, masks, w, seed=8, spread=(0.15, 0.8))
    cases = [
        dict(name="ppo", behavior_correction="mis", behavior_is_cap=1.5, behavior_is_cap_low=0.6, dual_clip=3.0),
        dict(name="grpo", behavior_correction="mis", behavior_is_level="geometric", behavior_is_cap=1.3),
        dict(name="gspo", behavior_correction="tis", behavior_is_level="geometric", behavior_is_cap=1.1,
             clip_low=0.05, clip_high=0.08),
    ]
    for case, agg in zip(cases, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")):
        obj, batch = check_all_paths(case, model, br, masks, w, FIXED_ADV, prox, behav, agg, budget=7)
        _, m = obj.tree_loss(model, batch, aggregation=agg, normalizer=None)
        if case.get("behavior_is_level", "token") == "token":
            assert 0 < m["behavior/masked_frac"] < 1, m
        elif case["behavior_correction"] == "mis":
            assert 0 < m["behavior/seq_masked_frac"] < 1, m
        else:
            assert 0 < m["behavior/seq_truncated_frac"] < 1 and m["behavior/seq_masked_frac"] == 0, m


def test_sequence_metrics_from_the_definitions():
    """Branch ratios, their maximum and the (branch-weighted) shares truncated and masked."""
    model = cached_model("qwen2_tiny", torch.float64)
    br = [[1, 2, 3], [1, 2, 4], [1, 2, 4], [5, 6]]
    masks = [[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 0]]  # the last branch trains nothing
    w = [1.0, 2.0, 1.0, 1.0]
    prox = [[None, -1.0, -2.0], [None, -1.0, -0.5], [None, -1.0, -0.5], [None, -1.0]]
    behav = [[None, -1.5, -1.0], [None, -1.5, -0.5], [None, -1.5, -0.5], [None, -3.0]]
    batch = corrected_batch(br, masks, w, [1.0, -1.0, 0.5, 0.2], prox, behav)
    _, m = make_objective("grpo", behavior_correction="mis", behavior_is_level="geometric", behavior_is_cap=1.2,
                          behavior_is_cap_low=0.9).tree_loss(model, batch, aggregation="token-mean", normalizer=None)
    rho = np.array([math.exp((0.5 - 1.0) / 2), math.exp(0.5 / 2), math.exp(0.5 / 2)])  # branches 0, 1, 2
    bw = np.array([1.0, 2.0, 1.0])
    assert m["behavior/seq_ratio_mean"] == pytest.approx(float((bw * rho).sum() / bw.sum()), rel=1e-12)
    assert m["behavior/seq_ratio_max"] == pytest.approx(float(rho.max()), rel=1e-12)
    out = (rho < 0.9) | (rho > 1.2)  # exp(-0.25) = 0.78 below, exp(0.25) = 1.28 above: all three masked
    assert out.all()
    assert m["behavior/seq_masked_frac"] == pytest.approx(1.0, rel=1e-12)
    assert m["behavior/seq_truncated_frac"] == pytest.approx(3.0 / 4.0, rel=1e-12)
    _, m = make_objective("ppo", behavior_correction="mis", behavior_is_cap=1.5).tree_loss(
        model, batch, aggregation="token-mean", normalizer=None)
    # target tokens, branch-weighted: [1,2] in three branches (rho e^0.5: above 1.5), 3 (e^-1: below 1/1.5),
    # 4 in two (rho 1); the untrained branch counts nowhere
    W = np.array([4.0, 1.0, 3.0])
    tok_rho = np.array([math.exp(0.5), math.exp(-1.0), 1.0])
    assert m["behavior/masked_frac"] == pytest.approx(5.0 / 8.0, rel=1e-12)
    assert m["behavior/truncated_frac"] == pytest.approx(4.0 / 8.0, rel=1e-12)
    assert m["behavior/ratio_mean"] == pytest.approx(float((W * tok_rho).sum() / 8.0), rel=1e-12)


CASES = [
    dict(name="ppo", behavior_correction="mis", behavior_is_cap=1.5),
    dict(name="ppo", behavior_correction="mis", behavior_is_cap=2.0, behavior_is_cap_low=0.8, dual_clip=3.0,
         clip_high=0.28),
    dict(name="grpo", behavior_correction="tis", behavior_is_level="geometric", behavior_is_cap=1.2),
    dict(name="grpo", behavior_correction="mis", behavior_is_level="geometric", behavior_is_cap=1.3),
    dict(name="grpo", behavior_correction="mis", behavior_is_level="sequence", behavior_is_cap=2.0),
    dict(name="ppo", behavior_correction="tis", behavior_is_level="sequence", behavior_is_cap=1.5),
    dict(name="ppo", behavior_correction="decoupled", behavior_is_level="geometric", behavior_is_cap=1.2),
    dict(name="gspo", behavior_correction="mis", behavior_is_cap=1.5, clip_low=0.05, clip_high=0.08),
    dict(name="gspo", behavior_correction="mis", behavior_is_level="geometric", behavior_is_cap=1.2,
         clip_low=0.05, clip_high=0.08),
    dict(name="gspo", behavior_correction="tis", behavior_is_level="sequence", behavior_is_cap=1.5,
         clip_low=0.05, clip_high=0.08),
]
IDS = ["-".join(str(c.get(k, "token")) for k in ("name", "behavior_correction", "behavior_is_level")) + f"-{i}"
       for i, c in enumerate(CASES)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=forests(max_branches=5, max_len=8), agg=st.sampled_from(treelit.AGGREGATIONS), seed=st.integers(0, 99),
       extra=st.integers(0, 6))
def test_corrections_match_per_branch_formula(case, data, agg, seed, extra):
    model = cached_model("qwen2_tiny", torch.float64)
    br, masks, w = data
    masks = [[bool(v) for v in m] for m in masks]
    adv = [float(a) or 0.5 for a in np.random.default_rng(seed).normal(0, 1, len(br))]
    with torch.no_grad():
        prox, behav = anchored_rollout(model, br, masks, w, seed)
    check_all_paths(case, model, br, masks, w, adv, prox, behav, agg, budget=max(map(len, br)) + extra)


def test_bad_bounds_are_one_line_naming_the_option():
    with pytest.raises(ValueError, match=r"^objective.behavior_is_cap_low=3 must be below objective.behavior_is_cap=2: "
                                         r"the bounds \[low, high\] of behavior_correction=mis are reversed$"):
        make_objective("grpo", behavior_correction="mis", behavior_is_cap=2.0, behavior_is_cap_low=3.0)
    with pytest.raises(ValueError, match="objective.behavior_is_cap_low=0.5 is the lower bound of behavior_correction=mis"):
        make_objective("grpo", behavior_correction="tis", behavior_is_cap_low=0.5)
    with pytest.raises(ValueError, match="objective.behavior_is_cap_low must be a positive number"):
        make_objective("grpo", behavior_correction="mis", behavior_is_cap_low=-1.0)
    with pytest.raises(ValueError, match="objective.behavior_is_cap must be a number, not null"):
        make_objective("ppo", behavior_correction="mis", behavior_is_cap=None)
    with pytest.raises(ValueError, match="objective.behavior_is_level must be one of token, sequence, geometric"):
        make_objective("ppo", behavior_correction="tis", behavior_is_level="seq")
    with pytest.raises(ValueError, match="objective.behavior_is_level=geometric .* needs objective.behavior_correction"):
        make_objective("ppo", behavior_is_level="geometric")
    from treelit.cli.config import ConfigError, compose, validate_config

    cfg = compose(["objective=grpo", "objective.behavior_correction=mis", "objective.behavior_is_cap=1.5",
                   "objective.behavior_is_cap_low=2.0", "old_logprobs=rollout"])
    with pytest.raises((ConfigError, ValueError)) as err:
        validate_config(cfg)
    assert "objective.behavior_is_cap_low=2 must be below objective.behavior_is_cap=1.5" in str(err.value)
    assert "\n" not in str(err.value)
    validate_config(compose(["objective=gspo", "objective.behavior_correction=mis", "objective.behavior_is_level=geometric",
                             "old_logprobs=rollout"]))


def test_trainer_recomputes_proximal_and_trains_with_a_geometric_mask():
    """Through the training module (``old_logprobs=rollout``): the records' log-probs stay as the
    behaviour ones, the proximal ones are recomputed (tree, partitioned tree, linear), and the loss
    equals the per-branch formula with the proximal model's log-probs."""
    import copy

    from helpers import randomize_
    from treelit.lightning.module import TreeLitModule
    from treelit.loss.branches import Branches

    model = cached_model("qwen2_tiny", torch.float64)
    prox_model = randomize_(copy.deepcopy(model), seed=5, std=0.3)
    br, masks, w = FIXED
    with torch.no_grad():
        _, behav = anchored_rollout(model, br, masks, w, seed=8, spread=(0.15, 0.8))
        prox = [[None] + [float(x) for x in branch_logprobs(prox_model, ids)[0]] for ids in br]
    case = dict(name="grpo", behavior_correction="mis", behavior_is_level="geometric", behavior_is_cap=1.5)
    obj = make_objective(**case)
    ref = reference(case, model, br, masks, w, FIXED_ADV, prox, behav, "token-mean")
    for mode, partition in (("tree", "none"), ("tree", "redundancy_free"), ("linear", "none")):
        batch = treelit.TokenTree.from_branches(br, masks, w, advantages=FIXED_ADV, old_logprobs=behav).to_batch()
        batch.source_branches = Branches.build(br, masks, w, advantages=FIXED_ADV, old_logprobs=behav)
        module = TreeLitModule(prox_model, obj, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), mode=mode,
                               old_logprobs="rollout", partition=partition, budget_tokens=7)
        module.record_rollout_logprobs([batch])
        if mode == "tree":
            loss = lambda: obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None)[0]  # noqa: E731
        else:
            loss = lambda: obj.linear_loss(model, batch.source_branches, aggregation="token-mean",  # noqa: E731
                                           normalizer=None)[0]
        assert_equivalent(model, loss, ref, torch.float64, f"{mode}/{partition}")


def test_a_sequence_level_refuses_per_token_advantages():
    """A critic's GAE advantages are per token: a branch-level weight has no single advantage to
    fold into, so both forms refuse in one line."""
    model = cached_model("qwen2_tiny", torch.float64)
    br, masks, w = FIXED
    with torch.no_grad():
        prox, behav = anchored_rollout(model, br, masks, w, seed=8)
    obj = make_objective("ppo", behavior_correction="tis", behavior_is_level="geometric")
    batch = corrected_batch(br, masks, w, FIXED_ADV, prox, behav)
    batch.critic_pairs = object()  # what GAE with a critic leaves on the row
    with pytest.raises(ValueError, match=r"^objective.behavior_is_level=geometric weights whole branches, and a critic's"):
        obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None)
    branches = corrected_branches(br, masks, w, FIXED_ADV, prox, behav)
    branches.token_adv = [np.zeros(len(ids)) for ids in br]
    with pytest.raises(ValueError, match="use objective.behavior_is_level=token with a critic"):
        obj.linear_loss(model, branches, aggregation="token-mean", normalizer=None)
    from treelit.cli.config import ConfigError, compose, validate_config

    with pytest.raises(ConfigError, match="critic=shared with objective.behavior_is_level=geometric: a sequence-level"):
        validate_config(compose(["experiment=ppo_critic", "old_logprobs=rollout", "objective.behavior_correction=tis",
                                 "objective.behavior_is_level=geometric"]))
