"""Gradient accumulation through the public API equals one batch, for every objective.

Three trees (two DPO pairs each, advantages, old and reference log-probs) are trained as
micro-batches with the step normaliser ``treelit.global_normalizer(..., objective=...)``
(and ``objective.normalizer(...)``), and as one packed batch with the objective's own
normaliser; losses and every parameter gradient must agree (float64), and agree with
the objective's per-branch form.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treelit
from helpers import assert_equivalent, cached_model
from treelit.objectives import OBJECTIVES, make_objective

OPTIONS = {
    "sft": {},
    "ppo": dict(clip_low=0.2, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01),
    "grpo": dict(kl_coef=0.1, kl_estimator="k2"),
    "gspo": dict(clip_low=0.05, clip_high=0.08),
    "dpo": dict(beta=0.5),
}


def _trees(model):
    """Three trees of two (chosen, rejected) pairs each, with RL fields agreeing on shared tokens."""
    from treelit.loss.tree import tree_token_logprobs

    rng = np.random.default_rng(0)
    trees = []
    for t in range(3):
        prompt = [1 + t, 2, 3 + t % 2]
        br = [prompt + [4, 5], prompt + [6], prompt + [4, 7, 8], prompt + [9, 10, 1][: 1 + t]]
        masks = [[0] * len(prompt) + [1] * (len(b) - len(prompt)) for b in br]
        masks[2][1] = 1  # a target inside the shared prompt
        plain = treelit.TokenTree.from_branches(br, masks).to_batch()
        with torch.no_grad():
            sel, lp, _ = tree_token_logprobs(model, plain, "sdpa_dense", select=torch.arange(plain.num_tokens))
        tok = lp.double().numpy()
        off_old = rng.normal(0, 0.3, plain.num_tokens)
        off_ref = rng.normal(0, 0.5, plain.num_tokens)
        old, ref = [], []
        for b in range(len(br)):
            idx = plain.branch_tokens[plain.branch_ptr[b] : plain.branch_ptr[b + 1]].numpy()
            old.append([None] + [min(tok[i] + off_old[i], -1e-3) for i in idx[1:]])
            ref.append([None] + [min(tok[i] + off_ref[i], -1e-3) for i in idx[1:]])
        fields = {"pair": [0, 0, 1, 1], "chosen": [True, False, False, True]}
        trees.append(treelit.TokenTree.from_branches(
            br, masks, [1.0, 0.5, 2.0, 1.0], advantages=rng.normal(0, 1, 4).tolist(), old_logprobs=old,
            ref_logprobs=ref, branch_fields=fields))
    return trees


def test_every_builtin_objective_is_covered():
    assert set(OPTIONS) == {e.name for e in OBJECTIVES.entries() if e.source == "treelit"}


@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_accumulated_micro_batches_equal_one_batch(name, aggregation):
    model = cached_model("qwen2_tiny", torch.float64)
    trees = _trees(model)
    micro = [trees[0].to_batch(), treelit.TreeBatch.pack([trees[1].to_batch(), trees[2].to_batch()])]
    whole = treelit.TreeBatch.pack([t.to_batch() for t in trees])
    obj = make_objective(name, **OPTIONS[name])
    Z = treelit.global_normalizer(micro, aggregation, objective=obj)
    assert Z == obj.normalizer(micro, aggregation) == treelit.global_normalizer(micro, aggregation, objective=name)
    if name == "dpo" and aggregation != "sum":
        assert Z == 6  # pairs, not targets
        assert treelit.global_normalizer(micro, aggregation) != Z

    def accumulated():
        total = 0.0
        for mb in micro:
            loss = treelit.tree_loss(model, mb, aggregation, attention="sdpa_dense", normalizer=Z,
                                     objective=name, **OPTIONS[name])
            loss.backward()
            total = total + loss.detach()
        return total + 0.0 * sum(p.sum() for p in model.parameters())

    def one_batch():
        return obj.tree_loss(model, whole, aggregation=aggregation, normalizer=None, attention="segment")[0]

    assert_equivalent(model, accumulated, one_batch, torch.float64, f"{name}/{aggregation}")
    assert_equivalent(
        model, one_batch, lambda: obj.linear_loss(model, whole, aggregation=aggregation, normalizer=None)[0],
        torch.float64, f"{name}/{aggregation}/linear",
    )


def test_normalizer_rejects_a_non_objective():
    b = treelit.TokenTree.from_branches([[1, 2]]).to_batch()
    with pytest.raises(TypeError, match="objective name or instance"):
        treelit.global_normalizer([b], "token-mean", objective=3)
    with pytest.raises(KeyError, match="unknown objective 'nope'"):
        treelit.global_normalizer([b], "token-mean", objective="nope")


@pytest.mark.parametrize("opt", ["kl_coef", "entropy_coef"])
def test_dpo_refuses_options_it_would_ignore(opt):
    with pytest.raises(ValueError, match=f"objective=dpo does not take objective.{opt}.*beta"):
        make_objective("dpo", **{opt: 1.0})
    make_objective("dpo", **{opt: 0.0})  # the default is fine
    from treelit.cli.config import compose
    from treelit.cli.train import build

    cfg = compose(["objective=dpo", f"+objective.{opt}=1"])
    with pytest.raises(ValueError, match=f"does not take objective.{opt}"):
        build(cfg.objective)
