"""Every registered objective on transformers' hybrid checkpoints: the tree pass (unpartitioned and
partitioned, the recurrent states and convolution contexts relayed across partitions) equals the
objective's published per-branch formula written here from the definition, with every branch run
through the *transformers* model on its own torch kernels - loss and every parameter gradient,
float64 <= 1e-10 with transformers' float32 upcasts kept in float64 on both sides.

SFT, PPO (clip-higher, dual clip, k3 KL, entropy bonus), GRPO (k2 KL), GSPO and DPO (sigmoid and
IPO, reference log-probs from the data or from a frozen copy of the initial model): on a Gated
DeltaNet (Qwen3.5), a Mamba2 (Nemotron-H), a KDA (Kimi-Linear) and a short-convolution (LFM2)
family; DPO on every hybrid family, Qwen3-Next with its router loss on. And ``verify_every``:
the trainer's periodic tree-vs-per-branch check runs on a hybrid and reports the difference - a
tree kernel that ignores the parent segment's state is caught.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import treelit
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from hf_oracle import hf_router_loss
from test_hf_hybrid import HYBRID, ONE_TOKEN, hybrid_models
from treelit.objectives import OBJECTIVES, make_objective

pytest.importorskip("transformers")

TOL = 1e-10
F64 = torch.float64
# DPO pairs (chosen, rejected) under shared prompts, one-token segments among them
DPO_BRANCHES = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 7, 9], [1, 10, 11], [1, 10, 2, 5]]
DPO_MASKS = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1], [0, 0, 1], [0, 0, 1, 1]]
DPO_WEIGHTS = [1.0, 1.0, 2.0, 2.0, 0.5, 0.5]
DPO_FIELDS = {"pair": [0, 0, 1, 1, 2, 2], "chosen": [True, False, False, True, True, False]}
OBJECTIVE_CASES = {
    "sft": dict(name="sft"),
    "ppo": dict(name="ppo", clip_low=0.1, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, kl_estimator="k3",
                entropy_coef=0.01),
    "grpo": dict(name="grpo", kl_coef=0.1, kl_estimator="k2"),
    "gspo": dict(name="gspo", clip_low=0.1, clip_high=0.15),
    "dpo": dict(name="dpo", beta=0.5),
    "dpo-ipo": dict(name="dpo", beta=0.3, loss="ipo"),
    "dpo-initial": dict(name="dpo", beta=0.5, reference="initial"),
}

AGGREGATION = {"sft": "seq-mean-token-sum", "ppo": "seq-mean-token-mean", "grpo": "token-mean",
               "gspo": "seq-mean-token-mean", "dpo": "token-mean", "dpo-ipo": "sum", "dpo-initial": "token-mean"}


def test_every_registered_objective_is_covered():
    builtin = {e.name for e in OBJECTIVES.entries() if e.source == "treelit"}  # (plugins bring their own tests)
    assert {c["name"] for c in OBJECTIVE_CASES.values()} == builtin


# -- per-branch references, from the definitions, on the transformers model ---------------------------
def branch_logprobs(hf, ids):
    """log p(token t | tokens < t), t >= 1, and the entropies, of one branch run on its own."""
    x = torch.tensor([list(ids)])
    logp_all = torch.log_softmax(hf(input_ids=x).logits[0], -1)[:-1]
    return logp_all.gather(1, x[0, 1:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)


def _counts(masks, aggregation):
    n = [sum(bool(v) for v in m[1:]) for m in masks]
    Z = {"token-mean": sum(n), "seq-mean-token-mean": sum(k > 0 for k in n),
         "seq-mean-token-sum": sum(k > 0 for k in n), "sum": 1}[aggregation]
    scale = [1.0 / k if aggregation == "seq-mean-token-mean" and k else 1.0 for k in n]
    return n, Z, scale


def _kl(lp, ref, kind):
    d = ref - lp
    return {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[kind]


def reference_loss(hf, case, data, aggregation, ref_model=None):
    """The per-branch objective ``case`` over ``data`` (branches, masks, weights, advantages, old,
    ref log-probs), every branch through ``hf``; ``ref_model``: DPO's frozen initial model."""
    br, masks, w, adv, old, ref = data
    n, Z, scale = _counts(masks, aggregation)
    name = case["name"]
    total = torch.zeros((), dtype=F64)
    if name == "dpo":
        def seq(model, b):
            m = torch.tensor([float(v) for v in masks[b][1:]], dtype=F64)
            return (branch_logprobs(model, br[b])[0] * m).sum()

        pairs = {}
        for b, (p, chosen) in enumerate(zip(DPO_FIELDS["pair"], DPO_FIELDS["chosen"])):
            pairs.setdefault(p, [None, None])[0 if chosen else 1] = b
        beta = case["beta"]
        for c, r in pairs.values():
            if ref_model is not None:
                with torch.no_grad():
                    rc, rr = seq(ref_model, c), seq(ref_model, r)
            else:
                rc, rr = (sum(ref[b][t] for t in range(1, len(br[b])) if masks[b][t]) for b in (c, r))
            h = (seq(hf, c) - rc) - (seq(hf, r) - rr)
            loss = -F.logsigmoid(beta * h) if case.get("loss", "sigmoid") == "sigmoid" else (h - 1 / (2 * beta)) ** 2
            total = total + w[c] * loss
        return total / (1 if aggregation == "sum" else len(pairs))
    lo, hi = case.get("clip_low", 0.2), case.get("clip_high", 0.28 if name == "grpo" else case.get("clip_low", 0.2))
    for b, ids in enumerate(br):
        if not n[b]:
            continue
        lp, ent = branch_logprobs(hf, ids)
        m = torch.tensor([float(v) for v in masks[b][1:]], dtype=F64)
        if name == "sft":
            total = total - w[b] * scale[b] * (lp * m).sum()
            continue
        o = torch.tensor([v for v in old[b][1:]], dtype=F64)
        if name == "gspo":
            s = torch.exp(((lp - o) * m).sum() / n[b])
            J = torch.minimum(s * adv[b], s.clamp(1 - lo, 1 + hi) * adv[b])
            total = total - w[b] * n[b] * scale[b] * J
            continue
        r = torch.exp(lp - o)
        J = torch.minimum(r * adv[b], r.clamp(1 - lo, 1 + hi) * adv[b])
        if case.get("dual_clip") and adv[b] < 0:
            J = torch.maximum(J, torch.full_like(J, case["dual_clip"] * adv[b]))
        term = -J
        if case.get("kl_coef"):
            term = term + case["kl_coef"] * _kl(lp, torch.tensor(ref[b][1:], dtype=F64), case["kl_estimator"])
        if case.get("entropy_coef"):
            term = term - case["entropy_coef"] * ent
        total = total + w[b] * scale[b] * (term * m).sum()
    return total / Z


def rollout_data(hf, case, seed=0):
    """Branches with advantages and old / reference log-probs near ``hf``'s own (a per-prefix
    offset: branches through a token agree), far enough that some ratios are clipped."""
    if case["name"] == "dpo":
        br, masks, w = DPO_BRANCHES, DPO_MASKS, DPO_WEIGHTS
    else:
        br, masks, w = ONE_TOKEN
    rng = np.random.default_rng(seed)
    offsets, old, ref = {}, [], []
    with torch.no_grad():
        for ids in br:
            lp, _ = branch_logprobs(hf, ids)
            o, r = [None], [None]
            for t in range(1, len(ids)):
                key = tuple(ids[: t + 1])
                if key not in offsets:
                    offsets[key] = (float(rng.normal(0, 0.3)), float(rng.normal(0, 0.5)))
                o.append(min(float(lp[t - 1]) + offsets[key][0], -1e-3))
                r.append(min(float(lp[t - 1]) + offsets[key][1], -1e-3))
            old.append(o)
            ref.append(r)
    adv = [float(a) for a in rng.normal(0, 1, len(br))]
    return br, masks, w, adv, old, ref


def _tree(data, case):
    br, masks, w, adv, old, ref = data
    if case["name"] == "dpo":
        return treelit.TokenTree.from_branches(br, masks, w, ref_logprobs=ref, branch_fields=DPO_FIELDS)
    return treelit.TokenTree.from_branches(br, masks, w, advantages=adv, old_logprobs=old, ref_logprobs=ref)


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def compare(family, case_name, aggregation, tmp_path_factory, budgets=(None, 6)):
    case = OBJECTIVE_CASES[case_name]
    ours, hf = hybrid_models(family, F64, tmp_path_factory)
    coef = ours.config.moe.get("router_aux_loss_coef", 0.0)
    with KeepFloat64():
        data = rollout_data(hf, case)
        opts = {k: v for k, v in case.items() if k != "name"}
        initial = case.get("reference") == "initial"
        hf.zero_grad(set_to_none=True)
        expected = reference_loss(hf, case, data, aggregation, ref_model=hf if initial else None)
        if coef:
            expected = expected + coef * hf_router_loss(hf, data[0], "micro_batch")
        expected.backward()
        theirs = _grads(hf)
        assert expected.item() != 0 and theirs and max(g.norm().item() for g in theirs.values()) > 0, "vacuous"
        batch = _tree(data, case).to_batch()
        for budget in budgets:
            obj = make_objective(case["name"], **opts)  # (reference=initial: a frozen copy of the model as it is)
            ours.zero_grad(set_to_none=True)
            if budget is None:
                loss = treelit.tree_loss(ours, batch, aggregation, "segment", objective=obj)
                loss.backward()
                value = loss.item()
            else:
                value = treelit.tree_backward(ours, batch, aggregation, "redundancy_free", budget, attention="segment",
                                              objective=obj)
            mine = _grads(ours, strip="hf.")
            what = f"{family}/{case_name}/{aggregation}/budget={budget}"
            assert mine.keys() == theirs.keys(), (what, sorted(set(mine) ^ set(theirs)))
            assert abs(value - expected.item()) <= TOL * abs(expected.item()), (what, value, expected.item())
            err = max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64))
            assert err <= TOL, f"{what}: max relative gradient difference {err:.2e}"


@pytest.mark.parametrize("case", sorted(OBJECTIVE_CASES))
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "kimi_linear", "lfm2"])
def test_objective_on_a_hybrid_equals_transformers_branch_by_branch(family, case, tmp_path_factory):
    compare(family, case, AGGREGATION[case], tmp_path_factory)


@pytest.mark.parametrize("family", sorted(set(HYBRID) - {"qwen3_5", "nemotron_h", "kimi_linear", "lfm2"}))
def test_dpo_on_every_hybrid_family(family, tmp_path_factory):
    """(Qwen3-Next and Qwen3.5-MoE with their router loss on: + coef x the load-balancing loss.)"""
    compare(family, "dpo", "token-mean", tmp_path_factory)


# -- verify_every ----------------------------------------------------------------------------------
def _verify(model, objective, tree):
    from treelit.lightning.module import TreeLitModule

    module = TreeLitModule(model, make_objective(objective), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                           attention="segment", verify_every=1)
    batch = tree.to_batch()
    batch.source_branches = None  # per branch from the tree's own branches
    return module.verify(batch, module.step_normalizer([batch]), module.router_normalizer([batch]))


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "qwen3_next"])
def test_verify_every_on_a_hybrid_reports_tree_equal_to_per_branch(family, tmp_path_factory):
    """The trainer's self-verification (``verify_every``): tree mode vs the per-branch pass on a
    hybrid (Qwen3-Next: with its router loss), loss and gradient to float64 rounding."""
    ours, _ = hybrid_models(family, F64, tmp_path_factory)
    with KeepFloat64():
        out = _verify(ours, "sft", treelit.TokenTree.from_branches(*ONE_TOKEN))
    assert out["verify/loss_rel_diff"] <= TOL and out["verify/grad_rel_diff"] <= TOL, out
    assert out["verify/grad_norm_rel_diff"] <= TOL, out


def test_treelit_train_verify_every_on_a_hybrid_checkpoint(tmp_path):
    """``treelit-train model=hf_auto verify_every=1`` on a Qwen3.5 checkpoint: the check runs in
    the training loop and logs tree == per branch (float32: to its rounding)."""
    import json

    from app_helpers import SMALL
    from hf_oracle import random_hf_checkpoint
    from treelit.cli.config import compose
    from treelit.cli.train import run

    model_type, cfg = HYBRID["qwen3_5"]
    random_hf_checkpoint(tmp_path / "ckpt", model_type, std=0.1, **cfg)
    branches, masks, weights = ONE_TOKEN
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "t0", "branches": [{"input_ids": b, "loss_mask": m, "weight": w}
                                                         for b, m, w in zip(branches, masks, weights)]}) + "\n")
    summary = run(compose([f"output_dir={tmp_path / 'run'}", *[o for o in SMALL if not o.startswith("model.")],
                           "model=hf_auto", f"model.hf_checkpoint={tmp_path / 'ckpt'}", "data=jsonl",
                           f"data.train_path={data}", "trainer.max_steps=2", "verify_every=1"]))
    m = summary["metrics"]
    assert 0 <= m["verify/loss_rel_diff"] < 1e-5 and 0 <= m["verify/grad_rel_diff"] < 1e-4, m


def test_verify_every_on_a_hybrid_catches_a_broken_tree_kernel(tmp_path_factory, monkeypatch):
    """The check can fail: a recurrence that starts every segment from zero (not from its parent
    segment's final state) is per-branch-exact on causal rows but wrong on a tree."""
    import treelit.models.hf_kernels as hk

    real = hk.chunked_scan

    def from_zero(chunk, layout, *args, **kwargs):
        roots = np.full_like(layout.seg_parent, -1)
        flat = [np.arange(len(layout.seg_parent))]
        return real(chunk, dataclasses.replace(layout, seg_parent=roots, levels=flat), *args, **kwargs)

    monkeypatch.setattr(hk, "chunked_scan", from_zero)
    ours, _ = hybrid_models("qwen3_5", F64, tmp_path_factory)
    with KeepFloat64():
        out = _verify(ours, "sft", treelit.TokenTree.from_branches(*ONE_TOKEN))
    assert out["verify/loss_rel_diff"] > 1e-6 and out["verify/grad_rel_diff"] > 1e-6, out


# -- the router loss of sigmoid-routed MoEs --------------------------------------------------------
@pytest.mark.parametrize("family", ["nemotron_h", "kimi_linear"])
def test_router_loss_on_a_bias_routed_moe_is_refused_naming_the_option(family, tmp_path):
    """Nemotron-H and Kimi-Linear pick experts by bias-corrected sigmoid scores: treelit's router
    loss (the Switch loss over softmax probabilities) is not a loss of that routing, so turning
    it on is refused - as ``model.router_aux_loss_coef`` when the model is made, as the config key
    when the checkpoint asks for it, and before a pass when set later - never applied silently."""
    from hf_oracle import random_hf_checkpoint
    from treelit.models.errors import CheckpointError
    from treelit.models.factory import set_router_aux_loss
    from treelit.models.hf_adapter import make_hf_model

    model_type, cfg = HYBRID[family]
    random_hf_checkpoint(tmp_path / "off", model_type, **cfg)
    with pytest.raises(ValueError, match=r"^model\.router_aux_loss_coef=0\.05: \w+Router picks experts by "
                                         r"bias-corrected scores"):
        make_hf_model(str(tmp_path / "off"), "float64", router_aux_loss_coef=0.05)
    model = make_hf_model(str(tmp_path / "off"), "float64", router_aux_loss_coef=0.0)  # off: trains
    tree = treelit.TokenTree.from_branches(*ONE_TOKEN)
    assert treelit.tree_loss(model, tree).item() > 0
    set_router_aux_loss(model, 0.05)
    with pytest.raises(ValueError, match=r"^router_aux_loss_coef = 0\.05: .*e_score_correction_bias"):
        treelit.tree_loss(model, tree)
    random_hf_checkpoint(tmp_path / "on", model_type, output_router_logits=True, router_aux_loss_coef=0.01, **cfg)
    with pytest.raises(CheckpointError, match=r"config\.json: config key 'router_aux_loss_coef' = 0\.01"):
        treelit.load_hf_model(tmp_path / "on")
    model = make_hf_model(str(tmp_path / "on"), "float64", router_aux_loss_coef=0.0)  # the option turns it off
    assert model.config.moe["router_aux_loss_coef"] == 0.0


def test_router_loss_on_a_softmax_routed_hybrid_equals_transformers(tmp_path):
    """Granite-4 hybrid routes by the top-k of its router logits: its router loss (turned on with
    ``model.router_aux_loss_coef``) is transformers' load-balancing loss over every branch run as
    one padded batch, loss and every gradient, float64."""
    from hf_oracle import balance_loss, hf_branch_loss, load_hf_oracle, random_hf_checkpoint
    from treelit.models.hf_adapter import make_hf_model
    from treelit.models.hf_kernels import bind_torch_kernels

    model_type, cfg = HYBRID["granitemoehybrid"]
    random_hf_checkpoint(tmp_path, model_type, **cfg)
    ours = make_hf_model(str(tmp_path), "float64", router_aux_loss_coef=0.5)
    hf = load_hf_oracle(tmp_path, dtype=F64, exact=False).to(F64)
    bind_torch_kernels(hf)
    branches, masks, weights = ONE_TOKEN
    ids = torch.zeros(len(branches), max(map(len, branches)), dtype=torch.long)
    real = torch.zeros_like(ids)
    for r, b in enumerate(branches):
        ids[r, : len(b)], real[r, : len(b)] = torch.tensor(b), 1
    with KeepFloat64():
        router_logits = hf(input_ids=ids, attention_mask=real, output_router_logits=True).router_logits
        aux = balance_loss(router_logits, cfg["num_local_experts"], cfg["num_experts_per_tok"], real.reshape(-1))
        expected = hf_branch_loss(hf, branches, masks, weights, "token-mean") + 0.5 * aux
        expected.backward()
        loss = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, weights))
        loss.backward()
    assert aux.item() > 0 and abs(loss.item() - expected.item()) <= TOL * abs(expected.item())
    err = max_rel_grad_diff(_grads(ours, "hf."), _grads(hf), grad_floor(F64), negligible_grad(F64))
    assert err <= TOL, err
