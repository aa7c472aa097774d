"""transformers' hybrid checkpoints in tree mode: the adapter's tree kernels (hf_kernels) against
the same transformers model run branch by branch with its own torch kernel functions.

Families (tiny random configs): Qwen3.5 text and Qwen3.5-MoE (Gated DeltaNet with grouped value
heads and a gated norm; MoE with the router loss on), Qwen3-Next (the same with MoE),
OLMo-hybrid (Gated DeltaNet with negative eigenvalues), Kimi-Linear (Kimi Delta Attention:
per-channel decays; MLA attention, MoE), Nemotron-H (Mamba2 with n_groups > 1 and a conv bias,
attention, MoE), Bamba, Granite-4 hybrid (Mamba2 with n_groups > 1, MoE, logits scaling and
residual / embedding multipliers), Falcon-H1 (attention and Mamba2 in parallel, lm-head
multiplier), LFM2 (short convolution with a bias). Loss and every parameter gradient, float64
<= 1e-10 with transformers' float32 upcasts kept in float64 on both sides (``KeepFloat64``),
float32 <= 1e-4; ``sdpa_dense`` and ``segment``; every aggregation; unpartitioned and
partitioned (states and convolution contexts relayed across partitions); hypothesis forests
and a forest of one-token segments.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from hypothesis import example, given, settings

import treelit
from float64_mode import KeepFloat64
from helpers import assert_trains, grad_floor, max_rel_grad_diff, negligible_grad
from hf_oracle import hf_branch_loss, hf_router_loss, load_hf_oracle, random_hf_checkpoint
from strategies import examples, forests
from treelit.attention.segment import SegmentAttention
from treelit.models.hf import CheckpointError
from treelit.models.hf_kernels import bind_torch_kernels, kernel_name
from hf_oracle import hf_from_pretrained  # noqa: E402

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=12, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64)
GDN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_conv_kernel_dim=3)
HYBRID = {
    "qwen3_5": ("qwen3_5_text", dict(BASE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                     **GDN)),
    "qwen3_next": ("qwen3_next", dict(BASE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                      moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
                                      num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.3,
                                      **GDN)),
    "nemotron_h": ("nemotron_h", dict(BASE, layers_block_type=["mamba", "attention", "moe", "mamba"], ssm_state_size=4,
                                      mamba_num_heads=4, mamba_head_dim=8, n_groups=2, conv_kernel=3, chunk_size=4,
                                      use_conv_bias=True, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=8, moe_shared_expert_intermediate_size=8)),
    "bamba": ("bamba", dict(BASE, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                            mamba_n_groups=2, mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4)),
    "lfm2": ("lfm2", dict(BASE, num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3,
                          conv_bias=True, block_auto_adjust_ff_dim=False)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(BASE, num_hidden_layers=2,
                                             layer_types=["linear_attention", "full_attention"],
                                             moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4,
                                             num_experts_per_tok=2, output_router_logits=True,
                                             router_aux_loss_coef=0.3, **GDN)),
    "olmo_hybrid": ("olmo_hybrid", dict(BASE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                        linear_allow_neg_eigval=True, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=1, **GDN)),
    "granitemoehybrid": ("granitemoehybrid", dict(BASE, num_hidden_layers=2, layer_types=["mamba", "attention"],
                                                  mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=4,
                                                  mamba_d_conv=3, mamba_chunk_size=4, num_local_experts=4,
                                                  num_experts_per_tok=2, shared_intermediate_size=16,
                                                  logits_scaling=2.5, embedding_multiplier=1.5,
                                                  residual_multiplier=0.7, attention_multiplier=0.3)),
    "kimi_linear": ("kimi_linear", dict(BASE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                        linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
                                        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=1)),
    "falcon_h1": ("falcon_h1", dict(BASE, num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                                    mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4, mamba_d_ssm=64,
                                    lm_head_multiplier=0.6, embedding_multiplier=1.5)),
}
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
# one-token segments: a chain whose every token branches, and a root with one-token children
ONE_TOKEN = ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 7], [1, 2, 3, 4, 8, 9], [1, 2, 3, 4, 8, 10], [3, 5]],
             [[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1], [1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1]],
             [1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 1.0])
_MODELS = {}


def hybrid_models(family, dtype, tmp_path_factory):
    """(adapted model, transformers reference on its own torch kernels) from one random checkpoint."""
    key = (family, dtype)
    if key not in _MODELS:
        path = tmp_path_factory.mktemp(family)
        model_type, cfg = HYBRID[family]
        random_hf_checkpoint(path, model_type, **cfg)
        ours = treelit.load_hf_model(path, dtype=dtype)
        # (.to: parameters a family keeps in float32, e.g. Nemotron-H's router, follow dtype as in the adapter)
        ref = load_hf_oracle(path, dtype=dtype, exact=False).to(dtype)
        assert bind_torch_kernels(ref) > 0
        _MODELS[key] = (ours, ref)
    return _MODELS[key]


def exact(dtype):
    return KeepFloat64() if dtype == torch.float64 else contextlib.nullcontext()


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def compare(family, dtype, attention, aggregation, data, tmp_path_factory, budgets=(None,)):
    branches, masks, weights = data
    assert_trains(branches, masks, weights)
    ours, ref = hybrid_models(family, dtype, tmp_path_factory)
    coef = ours.config.moe.get("router_aux_loss_coef", 0.0)
    with exact(dtype):
        ref.zero_grad(set_to_none=True)
        expected = hf_branch_loss(ref, branches, masks, weights, aggregation)
        if coef:
            expected = expected + coef * hf_router_loss(ref, branches, "micro_batch")
        expected.backward()
        theirs = _grads(ref)
        batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
        backend = SegmentAttention(batch_below=3, window_block=2) if attention == "segment" else attention
        for budget in budgets:
            ours.zero_grad(set_to_none=True)
            if budget is None:
                loss = treelit.tree_loss(ours, batch, aggregation, backend)
                loss.backward()
                value = loss.item()
            else:
                value = treelit.tree_backward(ours, batch, aggregation, "redundancy_free", budget, attention=backend)
            mine = _grads(ours, strip="hf.")
            what = f"{family}/{aggregation}/{attention}/budget={budget}"
            assert mine.keys() == theirs.keys(), (what, sorted(set(mine) ^ set(theirs)))
            assert abs(value - expected.item()) <= TOL[dtype] * abs(expected.item()), (what, value, expected.item())
            err = max_rel_grad_diff(mine, theirs, grad_floor(dtype), negligible_grad(dtype))
            assert err <= TOL[dtype], f"{what}: max relative gradient difference {err:.2e}"


# (test_hf_adapter.py's FAMILIES runs simpler configurations of every family through every
# combination; here each dtype once, with the other backend)
@pytest.mark.parametrize("dtype,attention", [(torch.float64, "sdpa_dense"), (torch.float32, "segment")],
                         ids=["f64-sdpa_dense", "f32-segment"])
@pytest.mark.parametrize("family", sorted(HYBRID))
@settings(max_examples=examples(1))
@given(data=forests(max_branches=5, max_len=8, vocab=6))
@example(data=ONE_TOKEN)
def test_hybrid_tree_equals_transformers_branch_by_branch(family, dtype, attention, data, tmp_path_factory):
    compare(family, dtype, attention, "token-mean", data, tmp_path_factory)


@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("family", sorted(HYBRID))
def test_hybrid_every_aggregation_and_partitioned(family, aggregation, tmp_path_factory):
    """Partitions of 6 and 7 tokens (the longest branch has 6) cut inside segments and between
    one-token segments: the recurrent states and convolution contexts cross partitions (with
    their gradients)."""
    compare(family, torch.float64, "sdpa_dense", aggregation, ONE_TOKEN, tmp_path_factory, budgets=(None, 6, 7))


def test_plain_forward_and_direct_calls_never_reach_fla(tmp_path):
    """The adapted model's own forward (causal rows through the tree kernels) and a direct call
    of one of its hybrid layers without a tree context (transformers' torch functions) run on
    CPU and agree with the reference; the family's modelling module and class are untouched."""
    model_type, cfg = HYBRID["qwen3_5"]
    random_hf_checkpoint(tmp_path, model_type, **cfg)
    ours = treelit.load_hf_model(tmp_path, dtype=torch.float64)
    ref = load_hf_oracle(tmp_path, dtype=torch.float64, exact=False)
    bind_torch_kernels(ref)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad(), KeepFloat64():
        expected = ref(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-10, atol=1e-10)
        layer = ours.hf.model.layers[0].linear_attn
        h = torch.randn(2, 5, BASE["hidden_size"], dtype=torch.float64)
        torch.testing.assert_close(layer(h), ref.model.layers[0].linear_attn(h), rtol=1e-12, atol=1e-12)
    module = sys.modules[type(layer).__module__]
    assert "forward" in vars(layer) and type(layer).forward is not layer._treelit_forward
    # not rebound globally: the module's entry point is still transformers' (a function, or the
    # ``kernels`` package's layer made of it), never a treelit dispatcher
    entry = module.torch_chunk_gated_delta_rule
    assert kernel_name(entry) == "chunk_gated_delta_rule"
    assert not getattr(entry, "__name__", "").startswith("treelit_")


UNSUPPORTED = {"lfm2_moe": dict(BASE, num_hidden_layers=2),
               "mamba": dict(vocab_size=12, hidden_size=32, num_hidden_layers=2)}


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED))
def test_hybrids_without_tree_kernels_refused_at_load(tmp_path, model_type):
    transformers.AutoConfig.for_model(model_type, **UNSUPPORTED[model_type]).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="'model_type'"):
        treelit.load_hf_model(tmp_path)


@pytest.mark.parametrize("chunk_size", [2, 3, 64])
def test_kda_blocks_equal_the_per_token_recurrence_on_a_tree(chunk_size):
    """Kimi Delta Attention (per-channel decays): the block scan equals the plain per-token
    recurrence over a tree (one-token segments, a boundary capture), outputs, captured
    states and every input gradient, float64."""
    from treelit.ssm.layout import tree_layout
    from treelit.ssm.scan import chunked_scan, kda_chunk, kda_step, segment_scan

    batch = treelit.TokenTree.from_branches(*ONE_TOKEN).to_batch()
    T, H, K, V = batch.num_tokens, 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(T, H, K, generator=gen, dtype=torch.float64),
              torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen, dtype=torch.float64), dim=-1),
              torch.randn(T, H, V, generator=gen, dtype=torch.float64),
              torch.rand(T, H, generator=gen, dtype=torch.float64),
              -2 * torch.rand(T, H, K, generator=gen, dtype=torch.float64)]
    layout = tree_layout(batch, 1, capture=torch.tensor([3, 7]).numpy())
    results = []
    for blocks in (False, True):
        xs = [x.clone().requires_grad_() for x in inputs]
        if blocks:
            out, cap = chunked_scan(kda_chunk(*xs, K**-0.5), layout, (H, K, V), (H, V), xs[0], None, chunk_size)
        else:
            out, cap = segment_scan(kda_step(*xs, K**-0.5), layout, (H, K, V), (H, V), xs[0])
        (out.sin().sum() + cap.cos().sum()).backward()
        results.append([out, cap] + [x.grad for x in xs])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_activation_checkpointing_and_export(family, tmp_path):
    """transformers' own activation checkpointing recomputes the hybrid layers in the backward
    pass (the tree context comes back with the recomputed call): gradients unchanged.
    save_pretrained writes transformers' checkpoint, which transformers reloads with identical
    weights."""
    model_type, cfg = HYBRID[family]
    random_hf_checkpoint(tmp_path / "src", model_type, **cfg)
    model = treelit.load_hf_model(tmp_path / "src", dtype=torch.float64)
    tree = treelit.TokenTree.from_branches(*ONE_TOKEN)
    grads = []  # (without KeepFloat64: the recomputation runs in the backward pass, outside any mode)
    for on in (False, True):
        model.activation_checkpointing = on
        model.zero_grad(set_to_none=True)
        treelit.tree_loss(model, tree).backward()
        grads.append(_grads(model))
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.hf.modules())
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, rtol=1e-12, atol=1e-14)
    treelit.save_hf_checkpoint(model, tmp_path / "out")
    back = hf_from_pretrained(tmp_path / "out", dtype=torch.float64)
    ours = model.hf.state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, ours[k]), k


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow),
                                    pytest.param("nemotron_h", marks=pytest.mark.slow),
                                    pytest.param("lfm2", marks=pytest.mark.slow)])
def test_hf_auto_trains_a_hybrid_checkpoint_and_exports_it(tmp_path, family):
    """``treelit-train model=hf_auto model.hf_checkpoint=DIR`` on a transformers-written hybrid
    checkpoint: one SGD step (gradient clipped to norm 1, lr 0.5, float32) equals the step taken
    by hand in transformers on its torch kernels, branch by branch; the export reloads in
    transformers with identical weights."""
    import json

    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run

    model_type, cfg = HYBRID[family]
    ckpt = tmp_path / "ckpt"
    random_hf_checkpoint(ckpt, model_type, std=0.1, **cfg)
    branches, masks, weights = ONE_TOKEN
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "t0", "branches": [{"input_ids": b, "loss_mask": m, "weight": w}
                                                         for b, m, w in zip(branches, masks, weights)]}) + "\n")
    out = tmp_path / "run"
    coef = HYBRID[family][1].get("router_aux_loss_coef", 0.0)
    summary = run(compose([f"output_dir={out}", *[o for o in SMALL if not o.startswith("model.")], "model=hf_auto",
                           f"model.hf_checkpoint={ckpt}", "data=jsonl", f"data.train_path={data}", "optimizer=sgd",
                           "optimizer.lr=0.5", "trainer.max_steps=1"]))
    assert summary["global_step"] == 1

    hf = load_hf_oracle(ckpt, dtype=torch.float32, exact=False).to(torch.float32)
    bind_torch_kernels(hf)
    loss = hf_branch_loss(hf, branches, masks, weights, "token-mean")
    if coef:
        loss = loss + coef * hf_router_loss(hf, branches, "micro_batch")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    with torch.no_grad():
        for p in hf.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    exported = hf_from_pretrained(out / "hf_checkpoint", dtype=torch.float32)
    adapted = treelit.load_hf_model(out / "hf_checkpoint")
    theirs, ours = hf.state_dict(), exported.state_dict()
    assert theirs.keys() == ours.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=2e-4, atol=2e-6, msg=k)
        assert torch.equal(ours[k], adapted.hf.state_dict()[k]), k


def test_multimodal_qwen3_5_checkpoint_trains_its_text_model(tmp_path):
    """A Qwen3.5 checkpoint with a vision tower (``Qwen3_5ForConditionalGeneration``) loads its
    text model, as transformers' ``AutoModelForCausalLM`` does; tree mode equals that model
    branch by branch (float64)."""
    text = dict(HYBRID["qwen3_5"][1])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=2, temporal_patch_size=1, spatial_merge_size=1)
    cfg = transformers.AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    vlm = transformers.Qwen3_5ForConditionalGeneration(cfg).to(torch.float64)
    with torch.no_grad():
        for p in vlm.parameters():
            p.normal_(0.0, 0.3)
    vlm.save_pretrained(tmp_path)
    ours = treelit.load_hf_model(tmp_path, dtype=torch.float64)
    ref = load_hf_oracle(tmp_path, dtype=torch.float64, exact=False).to(torch.float64)
    bind_torch_kernels(ref)
    assert type(ours.hf).__name__ == "Qwen3_5ForCausalLM"
    torch.testing.assert_close(ours.hf.model.layers[0].linear_attn.in_proj_qkv.weight,
                               vlm.model.language_model.layers[0].linear_attn.in_proj_qkv.weight, rtol=0, atol=0)
    branches, masks, weights = ONE_TOKEN
    with KeepFloat64():
        expected = hf_branch_loss(ref, branches, masks, weights, "token-mean")
        expected.backward()
        loss = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, weights))
        loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item())
    err = max_rel_grad_diff(_grads(ours, "hf."), _grads(ref), grad_floor(torch.float64),
                            negligible_grad(torch.float64))
    assert err <= 1e-10, err


@pytest.mark.parametrize("objective", [dict(name="ppo", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01),
                                       dict(name="grpo", clip_high=0.28, kl_coef=0.1, kl_estimator="k2"),
                                       dict(name="gspo")], ids=lambda o: o["name"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_rl_objectives_tree_equal_their_per_branch_form(family, objective, tmp_path_factory):
    """The RL objectives on a hybrid: the tree pass equals the objective's own per-branch form
    (causal rows through the same tree kernels), loss and every gradient, float64."""
    from helpers import assert_equivalent
    from treelit.objectives import make_objective

    ours, _ = hybrid_models(family, torch.float64, tmp_path_factory)
    branches, masks, weights = ONE_TOKEN
    gen = torch.Generator().manual_seed(1)
    per_prefix = {}
    for ids in branches:  # old / ref log-probs shared by branches through a token
        for t in range(1, len(ids)):
            per_prefix.setdefault(tuple(ids[: t + 1]), (-0.2 - torch.rand(1, generator=gen).item(),
                                                        -0.2 - torch.rand(1, generator=gen).item()))
    old = [[None] + [per_prefix[tuple(ids[: t + 1])][0] for t in range(1, len(ids))] for ids in branches]
    ref = [[None] + [per_prefix[tuple(ids[: t + 1])][1] for t in range(1, len(ids))] for ids in branches]
    adv = [float(a) for a in torch.randn(len(branches), generator=gen, dtype=torch.float64)]
    tree = treelit.TokenTree.from_branches(branches, masks, weights, advantages=adv, old_logprobs=old,
                                           ref_logprobs=ref)
    opts = dict(objective)
    obj = make_objective(opts.pop("name"), **opts)
    with KeepFloat64():
        assert_equivalent(ours, lambda: obj.tree_loss(ours, tree.to_batch(), aggregation="token-mean",
                                                      normalizer=None, attention="segment")[0],
                          lambda: obj.linear_loss(ours, tree.to_batch(), aggregation="token-mean",
                                                  normalizer=None)[0],
                          torch.float64, f"{family}/{objective['name']}", require_grad=False)


def test_ssm_chunk_size_applies_to_hybrid_layers(tmp_path_factory):
    """``ssm.chunk_size`` reaches the hybrid layers (1: the per-token recurrence, same gradients
    to rounding). (``ssm=fla`` for them: tests/models/test_hf_hybrid_fla.py.)"""
    from treelit.ssm import set_ssm_backend

    ours, _ = hybrid_models("kimi_linear", torch.float64, tmp_path_factory)
    tree = treelit.TokenTree.from_branches(*ONE_TOKEN)
    grads = []
    try:
        for chunk in (64, 1):
            set_ssm_backend(ours, "torch", chunk)
            ours.zero_grad(set_to_none=True)
            treelit.tree_loss(ours, tree).backward()
            grads.append(_grads(ours))
    finally:
        set_ssm_backend(ours, "torch", 64)
    assert all(m._treelit_chunk_size == 64 for m in ours.modules() if hasattr(m, "_treelit_forward"))
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, rtol=1e-9, atol=1e-12)


def test_a_hybrid_family_checkpoint_with_attention_layers_only_runs_as_attention(tmp_path):
    """An LFM2 checkpoint whose layers are all attention has no recurrent layer to bind: it is a
    model like any attention-only family (it was refused as 'no layer calls a kernel entry
    point'), and tree mode equals transformers branch by branch, loss and every gradient."""
    model_type, cfg = HYBRID["lfm2"]
    random_hf_checkpoint(tmp_path, model_type, **dict(cfg, layer_types=["full_attention", "full_attention"]))
    ours = treelit.load_hf_model(tmp_path, dtype=torch.float64)
    assert not any(hasattr(m, "_treelit_forward") for m in ours.modules())
    ref = load_hf_oracle(tmp_path, dtype=torch.float64, exact=False)
    branches, masks, weights = ONE_TOKEN
    assert_trains(branches, masks, weights)
    with KeepFloat64():
        expected = hf_branch_loss(ref, branches, masks, weights, "token-mean")
        expected.backward()
        loss = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, weights).to_batch())
        loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item())
    err = max_rel_grad_diff(_grads(ours, "hf."), _grads(ref), grad_floor(torch.float64), negligible_grad(torch.float64))
    assert err <= 1e-10, err


@pytest.mark.slow
def test_loading_a_hybrid_checkpoint_prints_no_triton_warning(tmp_path):
    """With the test extra installed (fla, Triton) on a machine without a Triton backend, importing
    a hybrid family's transformers code imports fla, which warns that Triton rolls back to CPU:
    treelit's tree kernels run those layers, so the load says nothing (a fresh interpreter: this
    one has imported fla already)."""
    import os
    import subprocess

    pytest.importorskip("fla")
    model_type, cfg = HYBRID["qwen3_5"]
    random_hf_checkpoint(tmp_path / "hybrid", model_type, **dict(cfg, vocab_size=64))
    code = ("import warnings; warnings.simplefilter('default')\n"
            "from treelit.models.hf_adapter import make_hf_model\n"
            f"make_hf_model({str(tmp_path / 'hybrid')!r}, dtype='float32')\nprint('loaded')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0 and "loaded" in res.stdout, res.stderr[-2000:]
    assert "Triton" not in res.stderr, res.stderr
