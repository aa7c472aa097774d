"""RL objectives on trees == the published per-branch formulas, loss and every gradient.

The references below are written one branch at a time from the papers (PPO with
clip-higher and dual clip, GRPO, GSPO, DPO sigmoid/IPO, k1/k2/k3 KL, entropy bonus),
with each branch run through the model as its own causal sequence - no tree code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import treelit
from helpers import assert_equivalent, cached_model
from strategies import forests
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden, output_weight
from treelit.objectives import make_objective


def branch_logprobs(model, ids):
    """log p(token t | tokens < t) for t >= 1, and the entropies, for one branch on its own."""
    x = torch.tensor([ids])
    h = decoder_hidden(model, x, torch.arange(len(ids))[None], CausalContext())[0]
    logits = h @ output_weight(model).t()
    logp_all = torch.log_softmax(logits, -1)[:-1]
    lp = logp_all.gather(1, x[0, 1:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def counts(masks):
    n = [sum(bool(v) for v in m[1:]) for m in masks]
    return n, sum(n), sum(1 for k in n if k)


def scale(agg, n_b):
    return 1.0 / n_b if agg == "seq-mean-token-mean" else 1.0


def norm(agg, n):
    _, tokens, seqs = n
    return {"token-mean": tokens, "seq-mean-token-mean": seqs, "seq-mean-token-sum": seqs, "sum": 1}[agg]


def kl(lp, ref, kind):
    d = ref - lp
    return {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[kind]


def ref_ppo(model, br, masks, w, adv, old, ref, agg, eps_lo, eps_hi, dual, kl_coef, kl_kind, ent_coef):
    n = counts(masks)
    total = torch.zeros((), dtype=torch.float64)
    for b, ids in enumerate(br):
        if len(ids) < 2:
            continue
        lp, ent = branch_logprobs(model, ids)
        for t in range(1, len(ids)):
            if not masks[b][t]:
                continue
            c = w[b] * scale(agg, n[0][b])
            r = torch.exp(lp[t - 1] - old[b][t])
            A = adv[b]
            J = torch.minimum(r * A, torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * A)
            if dual is not None and A < 0:
                J = torch.maximum(J, torch.tensor(dual * A, dtype=J.dtype))
            term = -J
            if kl_coef:
                term = term + kl_coef * kl(lp[t - 1], torch.tensor(ref[b][t], dtype=lp.dtype), kl_kind)
            if ent_coef:
                term = term - ent_coef * ent[t - 1]
            total = total + c * term
    Z = norm(agg, n)
    return total / Z if Z else torch.zeros(()) * 0


def ref_gspo(model, br, masks, w, adv, old, agg, eps_lo, eps_hi):
    n = counts(masks)
    total = torch.zeros((), dtype=torch.float64)
    for b, ids in enumerate(br):
        nb = n[0][b]
        if nb == 0:
            continue
        lp, _ = branch_logprobs(model, ids)
        m = torch.tensor([float(x) for x in masks[b][1:]], dtype=lp.dtype)
        o = torch.tensor(old[b][1:], dtype=lp.dtype)
        s = torch.exp(((lp - torch.nan_to_num(o)) * m).sum() / nb)
        A = adv[b]
        J = torch.minimum(s * A, torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * A)
        total = total - w[b] * nb * scale(agg, nb) * J
    Z = norm(agg, n)
    return total / Z if Z else torch.zeros(()) * 0


def ref_dpo(model, br, masks, w, ref, pairs, beta, kind, agg):
    def seq(b):
        lp, _ = branch_logprobs(model, br[b]) if len(br[b]) > 1 else (torch.zeros(0, dtype=torch.float64), None)
        m = torch.tensor([float(x) for x in masks[b][1:]], dtype=torch.float64)
        rf = torch.tensor([0.0 if v is None else v for v in ref[b][1:]], dtype=torch.float64)
        return (lp * m).sum(), (rf * m).sum()

    total = torch.zeros((), dtype=torch.float64)
    for c, r in pairs:
        (pc, rc), (pr, rr) = seq(c), seq(r)
        h = (pc - rc) - (pr - rr)
        loss = -F.logsigmoid(beta * h) if kind == "sigmoid" else (h - 1 / (2 * beta)) ** 2
        total = total + w[c] * loss
    Z = 1 if agg == "sum" else len(pairs)
    return total / Z


def rollout_values(model, br, seed):
    """Old/ref log-probs per branch token = current log-prob + a per-prefix offset (so that
    branches sharing a token agree), large enough to push ratios outside the clip range."""
    rng = np.random.default_rng(seed)
    offsets = {}
    old, ref = [], []
    for ids in br:
        lp, _ = branch_logprobs(model, ids) if len(ids) > 1 else (torch.zeros(0), None)
        o, r = [None], [None]
        for t in range(1, len(ids)):
            key = tuple(ids[: t + 1])
            if key not in offsets:
                offsets[key] = (float(rng.normal(0, 0.3)), float(rng.normal(0, 0.5)))
            base = float(lp[t - 1])
            o.append(min(base + offsets[key][0], -1e-3))
            r.append(min(base + offsets[key][1], -1e-3))
        old.append(o)
        ref.append(r)
    return old, ref


PPO_CASES = [
    dict(name="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None),
    dict(name="ppo", clip_low=0.1, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01),
    dict(name="ppo", clip_low=0.2, clip_high=0.2, kl_coef=0.1, kl_estimator="k1"),
    dict(name="grpo", clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_estimator="k2"),
]


@pytest.mark.parametrize("case", range(len(PPO_CASES)))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=forests(max_branches=5, max_len=8), agg=st.sampled_from(treelit.AGGREGATIONS), seed=st.integers(0, 99))
@example(data=([[1, 3]], [[False, True]], [0.5]), agg="token-mean", seed=41)  # q/k gradients exactly zero
def test_ppo_family_matches_per_branch_formula(case, data, agg, seed):
    opts = dict(PPO_CASES[case])
    name = opts.pop("name")
    model = cached_model("qwen2_tiny", torch.float64)
    br, masks, w = data
    rng = np.random.default_rng(seed)
    adv = [float(a) for a in rng.normal(0, 1, len(br))]
    with torch.no_grad():
        old, ref = rollout_values(model, br, seed)
    tree = treelit.TokenTree.from_branches(br, masks, w, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    obj = make_objective(name, **opts)
    eps_lo, eps_hi = obj.clip_low, obj.clip_high
    assert_equivalent(
        model,
        lambda: obj.tree_loss(model, tree.to_batch(), aggregation=agg, normalizer=None, attention="segment")[0],
        lambda: ref_ppo(model, br, masks, w, adv, old, ref, agg, eps_lo, eps_hi, opts.get("dual_clip"),
                        opts.get("kl_coef", 0.0), opts.get("kl_estimator", "k3"), opts.get("entropy_coef", 0.0)),
        torch.float64,
        f"{name}/{agg}",
        require_grad=False,  # every ratio may sit in a clipped region (zero gradient)
    )
    # the objective's own per-branch form agrees too
    assert_equivalent(
        model,
        lambda: obj.linear_loss(model, tree.to_batch(), aggregation=agg, normalizer=None)[0],
        lambda: ref_ppo(model, br, masks, w, adv, old, ref, agg, eps_lo, eps_hi, opts.get("dual_clip"),
                        opts.get("kl_coef", 0.0), opts.get("kl_estimator", "k3"), opts.get("entropy_coef", 0.0)),
        torch.float64,
        f"{name}/{agg}/linear",
        require_grad=False,
    )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=forests(max_branches=5, max_len=8), agg=st.sampled_from(treelit.AGGREGATIONS), seed=st.integers(0, 99))
def test_gspo_matches_per_branch_formula(data, agg, seed):
    model = cached_model("llama3_2_tiny", torch.float64)
    br, masks, w = data
    adv = [float(a) for a in np.random.default_rng(seed).normal(0, 1, len(br))]
    with torch.no_grad():
        old, _ = rollout_values(model, br, seed)
    tree = treelit.TokenTree.from_branches(br, masks, w, advantages=adv, old_logprobs=old)
    obj = make_objective("gspo", clip_low=0.05, clip_high=0.08)  # wide enough that some ratios stay inside
    assert_equivalent(
        model,
        lambda: obj.tree_loss(model, tree.to_batch(), aggregation=agg, normalizer=None)[0],
        lambda: ref_gspo(model, br, masks, w, adv, old, agg, 0.05, 0.08),
        torch.float64,
        f"gspo/{agg}",
        require_grad=False,
    )


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=forests(max_branches=6, max_len=8), seed=st.integers(0, 99))
def test_dpo_matches_per_pair_formula(kind, data, seed):
    model = cached_model("mistral_tiny", torch.float64)
    br, masks, w = data
    prompt = [1, 2, 3]
    br = [prompt + b for b in br] + [prompt + [4]]  # pairs share a prompt; make the count even
    masks = [[0, 0, 0] + [1] * (len(b) - 3) for b in br]
    w = list(w) + [1.0]
    if len(br) % 2:
        br, masks, w = br[:-1], masks[:-1], w[:-1]
    pairs = [(2 * i, 2 * i + 1) for i in range(len(br) // 2)]
    with torch.no_grad():
        _, ref = rollout_values(model, br, seed)
    fields = {"pair": [b // 2 for b in range(len(br))], "chosen": [b % 2 == 0 for b in range(len(br))]}
    tree = treelit.TokenTree.from_branches(br, masks, w, ref_logprobs=ref, branch_fields=fields)
    obj = make_objective("dpo", beta=0.5, loss=kind)
    for agg in ("token-mean", "sum"):
        assert_equivalent(
            model,
            lambda: obj.tree_loss(model, tree.to_batch(), aggregation=agg, normalizer=None)[0],
            lambda: ref_dpo(model, br, masks, w, ref, pairs, 0.5, kind, agg),
            torch.float64,
            f"dpo/{kind}",
            require_grad=False,  # identical chosen and rejected branches cancel exactly
        )


def test_dpo_fixed_pairs_have_gradients():
    model = cached_model("mistral_tiny", torch.float64)
    br = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8, 9], [1, 2, 8, 10]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]]
    with torch.no_grad():
        _, ref = rollout_values(model, br, 3)
    fields = {"pair": [0, 0, 1, 1], "chosen": [True, False, False, True]}
    tree = treelit.TokenTree.from_branches(br, masks, None, ref_logprobs=ref, branch_fields=fields)
    for kind in ("sigmoid", "ipo"):
        obj = make_objective("dpo", beta=0.3, loss=kind)
        assert_equivalent(
            model,
            lambda: obj.tree_loss(model, tree.to_batch(), aggregation="token-mean", normalizer=None)[0],
            lambda: ref_dpo(model, br, masks, [1.0] * 4, ref, [(0, 1), (3, 2)], 0.3, kind, "token-mean"),
            torch.float64,
            kind,
        )


def test_float32_ppo_matches_too():
    model = cached_model("qwen2_5_tiny", torch.float32)
    br = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10]]
    masks = [[0, 0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    adv = [1.0, -0.5, 2.0]
    m64 = cached_model("qwen2_5_tiny", torch.float64)
    with torch.no_grad():
        old, ref = rollout_values(m64, br, 0)
    tree = treelit.TokenTree.from_branches(br, masks, None, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    obj = make_objective("ppo", dual_clip=3.0, kl_coef=0.1)
    assert_equivalent(
        model,
        lambda: obj.tree_loss(model, tree.to_batch(), aggregation="token-mean", normalizer=None)[0],
        lambda: obj.linear_loss(model, tree.to_batch(), aggregation="token-mean", normalizer=None)[0],
        torch.float32,
        "ppo f32",
    )


# disagreeing old log-probs -------------------------------------------------------------------


def test_disagreeing_old_logprobs_raise_by_default():
    with pytest.raises(treelit.TreeInputError, match=r"branches 0 and 1 share the token at position 2 but disagree on its old log-prob"):
        treelit.TokenTree.from_branches([[1, 2, 3, 4], [1, 2, 3, 5]], old_logprobs=[[None, -1.0, -2.0, -1.0], [None, -1.0, -2.5, -1.0]])


def test_disagreeing_old_logprobs_split_the_tree_and_stay_exact():
    model = cached_model("qwen2_tiny", torch.float64)
    br = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6]]
    masks = [[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1, 1]]
    adv = [1.0, -1.0, 0.5]
    old = [[None, -1.0, -2.0, -1.0], [None, -1.0, -2.5, -1.2], [None, -1.0, -2.0, -1.0, -0.5]]
    tree = treelit.TokenTree.from_branches(br, masks, None, advantages=adv, old_logprobs=old, logprob_conflict="split")
    # branch 1 no longer shares token 3 (position 2) with the others: it has its own copy
    b = tree.to_batch()
    assert tree.num_tokens == 2 + 3 + 2  # [1, 2] shared; [3, 4, 6] and [3, 5] apart
    obj = make_objective("ppo", clip_low=0.2)
    assert_equivalent(
        model,
        lambda: obj.tree_loss(model, b, aggregation="token-mean", normalizer=None)[0],
        lambda: ref_ppo(model, br, masks, [1.0] * 3, adv, old, None, "token-mean", 0.2, 0.2, None, 0.0, "k3", 0.0),
        torch.float64,
        "split",
    )


def test_clip_metrics_and_bad_options():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        make_objective("ppo", dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        make_objective("ppo", kl_estimator="k9")
    model = cached_model("qwen2_tiny", torch.float64)
    br = [[1, 2, 3, 4], [1, 2, 5]]
    old = [[None, -9.0, -0.01, -9.0], [None, -9.0, -0.01]]  # ratios far outside the clip range
    tree = treelit.TokenTree.from_branches(br, None, None, advantages=[1.0, -1.0], old_logprobs=old)
    _, m = make_objective("ppo").tree_loss(model, tree.to_batch(), aggregation="token-mean", normalizer=None)
    assert m["clip_frac"] == pytest.approx(1.0) and m["approx_kl"] > 0
    assert math.isclose(m["adv_mean"], 0.0, abs_tol=1e-12)


def test_library_api_tree_and_linear_loss_with_objective():
    model = cached_model("qwen2_tiny", torch.float64)
    br = [[1, 2, 3, 4], [1, 2, 5, 6, 7]]
    masks = [[0, 0, 1, 1], [0, 0, 1, 1, 1]]
    adv = [1.5, -0.5]
    old = [[None, -1.0, -2.0, -2.2], [None, -1.0, -1.5, -3.0, -0.7]]
    tree = treelit.TokenTree.from_branches(br, masks, advantages=adv, old_logprobs=old)
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, tree.to_batch(), objective="grpo", clip_high=0.3),
        lambda: treelit.linear_loss(model, br, masks, objective="grpo", clip_high=0.3, advantages=adv, old_logprobs=old),
        torch.float64,
        "api",
    )
