"""Off-policy correction (``behavior_correction=tis|decoupled``) == per-branch formulas.

The references are written one branch at a time from the definitions: each branch runs
through the model as its own sequence; per target token t, with proximal log-prob
``prox``, behaviour log-prob ``behav`` and the trained log-prob ``lp``:

    rho = exp(prox - behav),  r = exp(lp - prox)
    tis:        w = min(rho, cap)
    decoupled:  w = rho if rho <= cap else 0
    PPO/GRPO:   term = -c_b w min(r A_b, clip(r) A_b)          (dual clip as usual)
    GSPO:       term_b = -(sum_t c_b w_t) min(s_b A_b, clip(s_b) A_b),  s_b = exp(mean_t (lp - prox))

No tree code is used in the references. Tree mode, the objective's own per-branch form,
and partitioned training are compared with them (loss and every gradient, float64).
"""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treelit
from helpers import assert_equivalent, cached_model, randomize_
from strategies import forests
from treelit.loss.branches import Branches
from treelit.objectives import make_objective
from treelit.objectives.behavior import split_behavior
from treelit.partition import tree_backward

from test_rl import branch_logprobs, counts, norm, scale  # noqa: E402  (the per-branch pieces of the RL tests)


def weight(rho: float, kind: str, cap) -> float:
    if cap is None:
        return rho
    if kind == "tis":
        return min(rho, cap)
    return rho if rho <= cap else 0.0


def ref_ppo(model, br, masks, w, adv, prox, behav, agg, kind, cap, eps_lo, eps_hi, dual=None):
    n = counts(masks)
    total = torch.zeros((), dtype=torch.float64)
    for b, ids in enumerate(br):
        if len(ids) < 2:
            continue
        lp, _ = branch_logprobs(model, ids)
        for t in range(1, len(ids)):
            if not masks[b][t]:
                continue
            c = w[b] * scale(agg, n[0][b])
            wt = weight(math.exp(prox[b][t] - behav[b][t]), kind, cap)
            r = torch.exp(lp[t - 1] - prox[b][t])
            A = adv[b]
            J = torch.minimum(r * A, torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * A)
            if dual is not None and A < 0:
                J = torch.maximum(J, torch.tensor(dual * A, dtype=J.dtype))
            total = total - c * wt * J
    Z = norm(agg, n)
    return total / Z if Z else torch.zeros(()) * 0


def ref_gspo(model, br, masks, w, adv, prox, behav, agg, kind, cap, eps_lo, eps_hi):
    n = counts(masks)
    total = torch.zeros((), dtype=torch.float64)
    for b, ids in enumerate(br):
        nb = n[0][b]
        if nb == 0:
            continue
        lp, _ = branch_logprobs(model, ids)
        targets = [t for t in range(1, len(ids)) if masks[b][t]]
        s = torch.exp(sum(lp[t - 1] - prox[b][t] for t in targets) / nb)
        A = adv[b]
        J = torch.minimum(s * A, torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * A)
        wsum = sum(weight(math.exp(prox[b][t] - behav[b][t]), kind, cap) for t in targets)
        total = total - w[b] * scale(agg, nb) * wsum * J
    Z = norm(agg, n)
    return total / Z if Z else torch.zeros(()) * 0


def rollout(model, br, seed):
    """Proximal and behaviour log-probs per branch token: the current log-prob plus per-prefix
    offsets (branches sharing a token agree), wide enough to clip and to pass the cap."""
    rng = np.random.default_rng(seed)
    offsets = {}
    prox, behav = [], []
    for ids in br:
        lp, _ = branch_logprobs(model, ids) if len(ids) > 1 else (torch.zeros(0), None)
        p, q = [None], [None]
        for t in range(1, len(ids)):
            key = tuple(ids[: t + 1])
            if key not in offsets:
                offsets[key] = (float(rng.normal(0, 0.3)), float(rng.normal(0, 0.6)))
            pt = min(float(lp[t - 1]) + offsets[key][0], -1e-3)
            p.append(pt)
            q.append(min(pt + offsets[key][1], -1e-3))
        prox.append(p)
        behav.append(q)
    return prox, behav


def corrected_batch(br, masks, w, adv, prox, behav):
    """The tree row as the trainer holds it after ``old_logprobs=rollout``: behaviour log-probs
    kept from the records, old log-probs replaced by the proximal ones."""
    batch = treelit.TokenTree.from_branches(br, masks, w, advantages=adv, old_logprobs=behav).to_batch()
    split_behavior(batch)
    prox_batch = treelit.TokenTree.from_branches(br, masks, w, advantages=adv, old_logprobs=prox).to_batch()
    assert torch.equal(batch.branch_tokens, prox_batch.branch_tokens)  # the same tree
    batch.token_old_logp, batch.branch_old_logp = prox_batch.token_old_logp, prox_batch.branch_old_logp
    return batch


def corrected_branches(br, masks, w, adv, prox, behav):
    out = Branches.build(br, masks, w, advantages=adv, old_logprobs=prox)
    out.behav = Branches.build(br, masks, w, old_logprobs=behav).old
    return out


CASES = [
    dict(name="ppo", behavior_correction="tis", behavior_is_cap=1.5),
    dict(name="ppo", behavior_correction="decoupled", behavior_is_cap=1.5, dual_clip=3.0, clip_high=0.28),
    dict(name="grpo", behavior_correction="decoupled", behavior_is_cap=None),
    dict(name="grpo", behavior_correction="tis", behavior_is_cap=2.0),
    dict(name="gspo", behavior_correction="tis", behavior_is_cap=1.5, clip_low=0.05, clip_high=0.08),
    dict(name="gspo", behavior_correction="decoupled", behavior_is_cap=1.5, clip_low=0.05, clip_high=0.08),
]
IDS = [f"{c['name']}-{c['behavior_correction']}-cap{c['behavior_is_cap']}" for c in CASES]


def reference(case, model, br, masks, w, adv, prox, behav, agg):
    obj = make_objective(**case)
    kind, cap = case["behavior_correction"], case["behavior_is_cap"]
    if case["name"] == "gspo":
        return functools.partial(ref_gspo, model, br, masks, w, adv, prox, behav, agg, kind, cap,
                                 obj.clip_low, obj.clip_high)
    return functools.partial(ref_ppo, model, br, masks, w, adv, prox, behav, agg, kind, cap,
                             obj.clip_low, obj.clip_high, case.get("dual_clip"))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=forests(max_branches=5, max_len=8), agg=st.sampled_from(treelit.AGGREGATIONS), seed=st.integers(0, 99),
       extra=st.integers(0, 6))
def test_correction_matches_per_branch_formula(case, data, agg, seed, extra):
    model = cached_model("qwen2_tiny", torch.float64)
    br, masks, w = data
    adv = [float(a) for a in np.random.default_rng(seed).normal(0, 1, len(br))]
    with torch.no_grad():
        prox, behav = rollout(model, br, seed)
    obj = make_objective(**case)
    ref = reference(case, model, br, masks, w, adv, prox, behav, agg)
    what = f"{case['name']}/{case['behavior_correction']}/{agg}"
    batch = corrected_batch(br, masks, w, adv, prox, behav)
    assert_equivalent(model, lambda: obj.tree_loss(model, batch, aggregation=agg, normalizer=None, attention="segment")[0],
                      ref, torch.float64, what, require_grad=False)  # every ratio may be clipped or capped
    branches = corrected_branches(br, masks, w, adv, prox, behav)
    assert_equivalent(model, lambda: obj.linear_loss(model, branches, aggregation=agg, normalizer=None)[0],
                      ref, torch.float64, what + "/linear", require_grad=False)
    budget = max(map(len, br)) + extra  # partitioned: cut into sub-trees under this many tokens per chain

    def partitioned():
        v = tree_backward(model, batch, agg, budget_tokens=budget, attention="segment", objective=obj)
        return torch.tensor(v, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(model, partitioned, ref, torch.float64, what + f"/partitioned({budget})", require_grad=False)


def test_correction_changes_the_loss_and_has_gradients():
    """A fixed case where the weights are far from 1: the corrected loss differs from the
    uncorrected one, and both corrections train."""
    model = cached_model("qwen2_tiny", torch.float64)
    br = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10]]
    masks = [[0, 1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    adv = [1.0, -0.5, 2.0]
    with torch.no_grad():
        prox, behav = rollout(model, br, 7)
    batch = corrected_batch(br, masks, None, adv, prox, behav)
    plain = make_objective("ppo").tree_loss(model, batch, aggregation="token-mean", normalizer=None)[0]
    for kind in ("tis", "decoupled"):
        obj = make_objective("ppo", behavior_correction=kind, behavior_is_cap=1.2)
        loss, metrics = obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None)
        assert abs(float(loss.detach()) - float(plain.detach())) > 1e-3
        assert_equivalent(model, lambda: obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None)[0],
                          reference(dict(name="ppo", behavior_correction=kind, behavior_is_cap=1.2), model, br, masks,
                                    [1.0] * 3, adv, prox, behav, "token-mean"), torch.float64, kind)
        assert 0 < metrics["behavior/truncated_frac"] < 1 and metrics["behavior/kl"] > 0


def test_metrics_from_the_definitions():
    model = cached_model("qwen2_tiny", torch.float64)
    br = [[1, 2, 3], [1, 2, 4]]
    prox = [[None, -1.0, -2.0], [None, -1.0, -0.5]]
    behav = [[None, -1.5, -1.0], [None, -1.5, -0.5]]
    batch = corrected_batch(br, None, None, [1.0, -1.0], prox, behav)
    _, m = make_objective("grpo", behavior_correction="tis", behavior_is_cap=1.5).tree_loss(
        model, batch, aggregation="token-mean", normalizer=None)
    # target tokens (branch-weighted): [1,2] shared by two branches, then 3 and 4
    rho = np.array([math.exp(0.5), math.exp(0.5), math.exp(-1.0), 1.0])
    assert m["behavior/ratio_mean"] == pytest.approx(rho.mean(), rel=1e-12)
    assert m["behavior/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-12)
    assert m["behavior/truncated_frac"] == pytest.approx(0.5, rel=1e-12)
    assert m["behavior/kl"] == pytest.approx(float(np.mean(rho - 1 - np.log(rho))), rel=1e-12)


def test_trainer_keeps_behaviour_and_recomputes_proximal():
    """``old_logprobs=rollout``: the module keeps the records' log-probs as behaviour ones and
    recomputes the proximal ones (tree mode, unpartitioned and partitioned, and linear mode);
    the loss then equals the per-branch formula with the proximal model's log-probs."""
    from treelit.lightning.module import TreeLitModule

    model = cached_model("qwen2_tiny", torch.float64)
    prox_model = randomize_(copy.deepcopy(model), seed=5, std=0.3)  # the weights the proximal pass sees
    br = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [3, 4]]
    masks = [[0, 1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1]]
    adv = [1.0, -0.5, 2.0, -1.0]
    with torch.no_grad():
        _, behav = rollout(model, br, 3)
        prox = [[None] + [float(x) for x in branch_logprobs(prox_model, ids)[0]] for ids in br]
    case = dict(name="ppo", behavior_correction="tis", behavior_is_cap=1.3)
    obj = make_objective(**case)
    ref = reference(case, model, br, masks, [1.0] * 4, adv, prox, behav, "token-mean")
    for mode, partition in (("tree", "none"), ("tree", "redundancy_free"), ("linear", "none")):
        batch = treelit.TokenTree.from_branches(br, masks, advantages=adv, old_logprobs=behav).to_batch()
        batch.source_branches = Branches.build(br, masks, advantages=adv, old_logprobs=behav)
        module = TreeLitModule(prox_model, obj, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), mode=mode,
                               old_logprobs="rollout", partition=partition, budget_tokens=6)
        module.record_rollout_logprobs([batch])
        flat = np.concatenate([np.array([np.nan if v is None else v for v in b]) for b in behav])
        np.testing.assert_array_equal(batch.branch_behav_logp.numpy(), flat)
        if mode == "tree":
            loss = lambda: obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None)[0]  # noqa: E731
        else:
            loss = lambda: obj.linear_loss(model, batch.source_branches, aggregation="token-mean",  # noqa: E731
                                           normalizer=None)[0]
        assert_equivalent(model, loss, ref, torch.float64, f"{mode}/{partition}")


def test_bad_options_and_missing_behaviour():
    with pytest.raises(ValueError, match="behavior_correction must be one of none, tis, mis, decoupled"):
        make_objective("ppo", behavior_correction="is")
    with pytest.raises(ValueError, match="behavior_is_cap must be a positive number or null"):
        make_objective("grpo", behavior_correction="tis", behavior_is_cap=0)
    with pytest.raises(TypeError, match="unknown options"):
        make_objective("dpo", behavior_correction="tis")
    from treelit.lightning.module import TreeLitModule

    with pytest.raises(ValueError, match="set old_logprobs=rollout"):
        TreeLitModule(cached_model("qwen2_tiny", torch.float64), make_objective("ppo", behavior_correction="tis"),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    model = cached_model("qwen2_tiny", torch.float64)
    batch = treelit.TokenTree.from_branches([[1, 2, 3]], advantages=[1.0], old_logprobs=[[None, -1.0, -1.0]]).to_batch()
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        make_objective("ppo", behavior_correction="tis").tree_loss(model, batch, aggregation="token-mean", normalizer=None)


def test_config_time_validation():
    from treelit.cli.config import ConfigError, compose, validate_config

    cfg = compose(["objective=grpo", "objective.behavior_correction=decoupled"])
    with pytest.raises(ConfigError, match="set old_logprobs=rollout"):
        validate_config(cfg)
    validate_config(compose(["objective=grpo", "objective.behavior_correction=decoupled", "old_logprobs=rollout"]))
