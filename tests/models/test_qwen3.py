"""Qwen3 (q/k norms), Qwen3-MoE (router loss), yarn/linear RoPE and sliding windows.

1. Tree mode == per-branch training (treelit's own linear path), loss and every parameter
   gradient, router included, on hypothesis forests: every aggregation, both CPU backends,
   float64 and float32, windows shorter than the trees, both router-loss definitions.
2. Independent check against transformers (Qwen3ForCausalLM, Qwen3MoeForCausalLM with
   output_router_logits, a yarn config, a linear-scaled one) run branch by branch from the
   same checkpoint: float64 with transformers' float32 upcasts rebound, <= 1e-10; float32
   <= 2e-3.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import treelit
from helpers import assert_equivalent, randomize_
from hf_oracle import balance_loss, random_hf_checkpoint, tree_vs_hf
from strategies import examples, forests
from treelit.attention.segment import SegmentAttention
from treelit.models.factory import set_router_aux_loss
from hf_oracle import hf_from_pretrained  # noqa: E402

VARIANTS = {
    "qwen3": ("qwen3_tiny", {}, None),
    "qwen3_window2": ("qwen3_tiny", {"sliding_window": 2, "sliding_window_layers": [1]}, None),
    "moe_micro_batch": ("qwen3_moe_tiny", {}, "micro_batch"),
    "moe_sequence_window3": ("qwen3_moe_tiny", {"sliding_window": 3}, "sequence"),
    "yarn": ("qwen3_tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 8}}, None),
}
_MODELS = {}


def model_for(variant: str, dtype):
    key = (variant, dtype)
    if key not in _MODELS:
        name, overrides, router = VARIANTS[variant]
        torch.manual_seed(0)
        moe = {"num_experts": 4, "top_k": 2, "intermediate_dim": 8} if "moe" in name else {}
        kw = dict(vocab_size=11, max_seq_len=64, num_layers=2, embed_dim=16, intermediate_dim=24, head_dim=8, **overrides)
        if moe:
            kw["moe"] = moe
        model = randomize_(treelit.build_model(name, **kw), 0).to(dtype)
        if router:
            set_router_aux_loss(model, 0.5, router)
        _MODELS[key] = model
    return _MODELS[key]


@pytest.mark.parametrize("attention", ["sdpa_dense", "segment"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@settings(max_examples=examples(4))
@given(data=forests(max_len=9))
def test_tree_equals_per_branch(variant, aggregation, dtype, attention, data):
    branches, masks, weights = data
    model = model_for(variant, dtype)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)
    backend = SegmentAttention(batch_below=3, window_block=2) if attention == "segment" else attention
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, tree, aggregation, attention=backend),
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation),
        dtype, f"{variant}/{aggregation}/{dtype}/{attention}", forest=data,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("objective", ["sft", "grpo", "gspo"])
@pytest.mark.parametrize("variant", ["moe_micro_batch", "moe_sequence_window3", "qwen3_window2"])
@settings(max_examples=examples(3))
@given(data=forests(max_len=9))
def test_partitioned_equals_per_branch(variant, objective, aggregation, dtype, data):
    """Cut into partitions at the tightest budget: windows read the external keys' depths; the
    router loss takes every token's routing in a no-gradient pass first, then each partition
    adds its own tokens' share."""
    branches, masks, weights = data
    model = model_for(variant, dtype)
    rl = {} if objective == "sft" else {"advantages": [0.5 - (i % 3) for i in range(len(branches))]}
    tree = treelit.TokenTree.from_branches(branches, masks, weights, **rl)
    longest = max(len(b) for b in branches)
    assert_equivalent(
        model,
        lambda: torch.tensor(treelit.tree_backward(model, tree, aggregation, "redundancy_free", longest,
                                                   objective=objective), dtype=torch.float64),
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation, objective=objective,
                                    **({} if objective == "sft" else {"advantages": rl["advantages"]})),
        dtype, f"{variant}/{objective}/{aggregation}/partitioned", forest=data,
    )


def test_router_loss_is_reported_and_changes_the_gradient():
    model = model_for("moe_micro_batch", torch.float64)
    tree = treelit.TokenTree.from_branches([[1, 2, 3, 4], [1, 2, 5], [1, 6]])
    metrics = {}
    with_aux = treelit.tree_loss(model, tree, metrics=metrics)
    assert metrics["router_aux_loss"] > 0 and metrics["moe/load_max_over_mean"] >= 1.0
    assert any(k.startswith("moe/layer") for k in metrics)
    set_router_aux_loss(model, 0.0)
    try:
        without = treelit.tree_loss(model, tree)
    finally:
        set_router_aux_loss(model, 0.5)
    assert with_aux.item() == pytest.approx(without.item() + 0.5 * metrics["router_aux_loss"], rel=1e-12)


def test_router_loss_accumulates_exactly_over_micro_batches():
    """Two micro-batches with the step normaliser == the two trees' losses averaged (micro_batch)
    or summed over all branches (sequence), whatever the split."""
    trees = [treelit.TokenTree.from_branches([[1, 2, 3, 4], [1, 2, 5]]), treelit.TokenTree.from_branches([[2, 6, 7]])]
    for variant, norm in (("moe_micro_batch", 2.0), ("moe_sequence_window3", 3.0)):
        model = model_for(variant, torch.float64)
        Z = treelit.global_normalizer([t.to_batch() for t in trees], "token-mean")
        parts = [treelit.tree_loss(model, t, normalizer=Z, router_normalizer=norm) for t in trees]
        branches = [[1, 2, 3, 4], [1, 2, 5]], [[2, 6, 7]]
        ref = [treelit.linear_loss(model, b, normalizer=Z, router_normalizer=norm) for b in branches]
        assert sum(parts).item() == pytest.approx(sum(ref).item(), rel=1e-12)


# -- independent check against transformers ------------------------------------------------------
TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
FORESTS = [
    ([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 11, 12], [1, 2, 3, 13], [1, 2, 3], [1, 2, 3, 13]],
     [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 8, [0, 0, 1, 1], [0, 1, 0], [0, 0, 0, 1]], [1.0, 0.5, 2.0, 1.0, 1.5]),
    ([[5, 1], [5, 2, 3, 4, 6, 7], [9, 8, 7, 6, 5, 4, 3], [9, 8]], [[0, 1], [1, 0, 1, 1, 0, 1], [0] * 6 + [1], [1, 1]],
     [1.0, 1.0, 0.5, 2.5]),
]
CONFIGS = {
    "qwen3": ("qwen3", {}),
    "qwen3_yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}),
    "llama_linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "mlp_only_layers": [1], "norm_topk_prob": True, "output_router_logits": True,
                                "router_aux_loss_coef": 0.5}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_tree_mode_equals_transformers_branch_by_branch(tmp_path, config, dtype):
    model_type, extra = CONFIGS[config]
    random_hf_checkpoint(tmp_path, model_type, **TINY, **extra)
    limit = 1e-10 if dtype == torch.float64 else 2e-3
    routers = [("micro_batch", 0.5), ("sequence", 0.5)] if model_type == "qwen3_moe" else [None]
    for router in routers:
        for (branches, masks, weights), aggregation in zip(FORESTS, ("token-mean", "seq-mean-token-mean")):
            for attention in ("sdpa_dense", "segment"):
                loss_diff, grad_diff, _ = tree_vs_hf(tmp_path, branches, masks, weights, aggregation, attention,
                                                     dtype=dtype, router=router)
                assert loss_diff <= limit and grad_diff <= limit, (router, attention, loss_diff, grad_diff)


def test_balance_loss_definition_matches_transformers(tmp_path):
    """The definition the oracle uses agrees with transformers' own function (which sums in float32)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    random_hf_checkpoint(tmp_path, "qwen3_moe", **TINY, **CONFIGS["qwen3_moe"][1])
    hf = hf_from_pretrained(tmp_path, dtype=torch.float64,
                                                           experts_implementation="eager")
    ids = torch.tensor([[1, 2, 3, 4, 0, 0], [1, 2, 5, 6, 7, 8]])
    att = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    out = hf(input_ids=ids, attention_mask=att, output_router_logits=True)
    ours = balance_loss(out.router_logits, 4, 2, att.reshape(-1))
    theirs = load_balancing_loss_func(out.router_logits, 4, 2, att)
    assert ours.item() == pytest.approx(float(theirs.detach()), rel=1e-6)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_rope_refused_at_load(tmp_path, kind):
    import json

    random_hf_checkpoint(tmp_path, "qwen3", **TINY)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": kind, "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(treelit.models.hf.CheckpointError, match=f"rope_scaling.*{kind}.*sequence length"):
        treelit.load_hf_checkpoint(tmp_path)
