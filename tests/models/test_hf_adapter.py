"""The transformers adapter: any attention-only causal LM in tree mode, checked against the
same transformers model run branch by branch (no treelit code on the reference side).

Six families from tiny random configs (llama, qwen2 with a window on its upper layer,
qwen3, qwen3_moe with the router loss on, gemma3 text with sliding and global layers,
phi3, olmo2): loss and every parameter gradient, float64 <= 1e-9 (transformers' float32
upcasts rebound on both instances) and float32 <= 1e-4, every aggregation, the segment
and sdpa_dense backends, unpartitioned and partitioned, on hypothesis forests with the
nasty cases (packed rows of several trees, so positions reset inside a row).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from hypothesis import example, given, settings

import treelit
from float64_mode import KeepFloat64
from helpers import assert_trains, grad_floor, max_rel_grad_diff, negligible_grad, tol
from hf_oracle import hf_branch_loss, hf_router_loss, load_hf_oracle, make_exact, random_hf_checkpoint
from strategies import examples, forests
from treelit.attention.segment import SegmentAttention
from treelit.models.hf import CheckpointError
from treelit.models.hf_kernels import HYBRID_FAMILIES, bind_torch_kernels
from hf_oracle import hf_from_pretrained  # noqa: E402

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=1)
GDN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_conv_kernel_dim=3)
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", dict(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                    output_router_logits=True, router_aux_loss_coef=0.3)),
    "gemma3": ("gemma3_text", dict(sliding_window=3, query_pre_attn_scalar=12,
                                   layer_types=["sliding_attention", "full_attention"], **IDS)),
    "phi3": ("phi3", IDS),
    "olmo2": ("olmo2", IDS),
    # hybrids (tree kernels of treelit.models.hf_kernels; more configurations in test_hf_hybrid.py)
    "qwen3_5": ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"], **GDN)),
    "qwen3_next": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"], moe_intermediate_size=8,
                                      shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                      output_router_logits=True, router_aux_loss_coef=0.3, **GDN)),
    "nemotron_h": ("nemotron_h", dict(layers_block_type=["mamba", "attention"], ssm_state_size=4, mamba_num_heads=4,
                                      mamba_head_dim=8, n_groups=2, conv_kernel=3, chunk_size=4)),
    "bamba": ("bamba", dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                            mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4)),
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention"], conv_L_cache=3, conv_bias=True,
                          block_auto_adjust_ff_dim=False)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(layer_types=["linear_attention", "full_attention"],
                                             moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                             num_experts=4, num_experts_per_tok=2, **GDN)),
    "olmo_hybrid": ("olmo_hybrid", dict(layer_types=["linear_attention", "full_attention"], **IDS, **GDN)),
    "kimi_linear": ("kimi_linear", dict(layer_types=["linear_attention", "full_attention"], linear_num_heads=2,
                                        linear_head_dim=8, linear_conv_kernel_dim=3, kv_lora_rank=8,
                                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=8, **IDS)),
    "granitemoehybrid": ("granitemoehybrid", dict(layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                  mamba_d_head=16, mamba_n_groups=2, mamba_d_state=4,
                                                  mamba_d_conv=3, mamba_chunk_size=4, logits_scaling=2.5,
                                                  num_local_experts=4, shared_intermediate_size=16)),
    "falcon_h1": ("falcon_h1", dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_n_groups=2,
                                    mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4, mamba_rms_norm=True,
                                    lm_head_multiplier=0.6)),
}
FIXED = ([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 10, 2]],
         [[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1], [0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]],
         [1.0, 0.0, 2.0, 0.5, 1.5])
_MODELS = {}


def models(family, dtype, tmp_path_factory):
    """(adapted model, transformers reference) from one random checkpoint per family."""
    key = (family, dtype)
    if key not in _MODELS:
        path = tmp_path_factory.mktemp(family)
        model_type, extra = FAMILIES[family]
        random_hf_checkpoint(path, model_type, **TINY, **extra)
        ours = treelit.load_hf_model(path, dtype=dtype)
        ref = load_hf_oracle(path, dtype=dtype, exact=False)
        if model_type in HYBRID_FAMILIES:  # transformers' torch kernels; float64 kept by KeepFloat64 (see exact)
            bind_torch_kernels(ref.to(dtype))
        elif dtype == torch.float64:
            make_exact(ours.hf)
            make_exact(ref)
        _MODELS[key] = (ours, ref)
    return _MODELS[key]


def exact(family, dtype):
    """Hybrids in float64: transformers' float32 upcasts (their recurrent kernels included) kept in
    float64 on both sides."""
    hybrid = FAMILIES[family][0] in HYBRID_FAMILIES
    return KeepFloat64() if hybrid and dtype == torch.float64 else contextlib.nullcontext()


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("attention", ["sdpa_dense", "segment"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=examples(2))
@given(data=forests(max_branches=5, max_len=9, vocab=6))
@example(data=FIXED)
def test_adapter_tree_equals_transformers_branch_by_branch(family, aggregation, dtype, attention, data,
                                                           tmp_path_factory):
    branches, masks, weights = data
    assert_trains(branches, masks, weights)
    ours, ref = models(family, dtype, tmp_path_factory)
    with exact(family, dtype):
        coef = ours.config.moe.get("router_aux_loss_coef", 0.0)
        ref.zero_grad(set_to_none=True)
        expected = hf_branch_loss(ref, branches, masks, weights, aggregation)
        if coef:
            expected = expected + coef * hf_router_loss(ref, branches, "micro_batch")
        expected.backward()
        theirs = _grads(ref)
        limit = tol(dtype)
        batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
        backend = SegmentAttention(batch_below=3, window_block=2) if attention == "segment" else attention
        longest = max(len(b) for b in branches)
        for budget in (None, longest):
            ours.zero_grad(set_to_none=True)
            if budget is None:
                loss = treelit.tree_loss(ours, batch, aggregation, backend)
                loss.backward()
                value = loss.item()
            else:  # (the router loss takes every token's routing in a no-gradient pass first)
                value = treelit.tree_backward(ours, batch, aggregation, "redundancy_free", budget, attention=backend)
            mine = _grads(ours, strip="hf.")
            what = f"{family}/{aggregation}/{attention}/budget={budget}"
            assert mine.keys() == theirs.keys(), what
            assert abs(value - expected.item()) <= limit * abs(expected.item()), (what, value, expected.item())
            err = max_rel_grad_diff(mine, theirs, grad_floor(dtype), negligible_grad(dtype))
            assert err <= limit, f"{what}: max relative gradient difference {err:.2e}"


def test_adapter_parameters_keep_transformers_names_and_export_identical(tmp_path):
    random_hf_checkpoint(tmp_path / "src", "gemma3_text", **TINY, sliding_window=3, query_pre_attn_scalar=12,
                         **IDS)
    model = treelit.load_hf_model(tmp_path / "src")
    names = {n for n, _ in model.named_parameters()}
    assert "hf.model.layers.0.self_attn.q_proj.weight" in names
    treelit.save_hf_checkpoint(model, tmp_path / "out")
    back = hf_from_pretrained(tmp_path / "out")
    ours = model.hf.state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, ours[k]), k


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_tied_head_is_written_once_from_a_cast_or_cloned_state_dict(tmp_path, dtype):
    """A cast (publish dtype) or cloned (gathered) state dict no longer shares the tied head's storage
    with the embedding; the checkpoint still holds the embedding only, and loads tied."""
    from safetensors import safe_open

    random_hf_checkpoint(tmp_path / "src", "qwen2", **TINY, **IDS, tie_word_embeddings=True)
    model = treelit.load_hf_model(tmp_path / "src")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "hf.lm_head.weight" in sd
    treelit.save_hf_checkpoint(model, tmp_path / "out", state_dict=sd, dtype=dtype)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    back = hf_from_pretrained(tmp_path / "out")
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    expected = model.hf.model.embed_tokens.weight.to(dtype or torch.float32)
    assert torch.equal(back.model.embed_tokens.weight.to(expected.dtype), expected)


def _config_dir(tmp_path, model_type, **extra):
    cfg = transformers.AutoConfig.for_model(model_type, **extra)
    cfg.save_pretrained(tmp_path)
    return tmp_path


REFUSED = {
    "recurrent": (lambda p: _config_dir(p, "mamba2", vocab_size=16, hidden_size=32, num_hidden_layers=2,
                                        num_heads=4, head_dim=16), "model_type"),
    "dynamic_rope": (lambda p: _config_dir(p, "llama", **TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                                "rope_theta": 10000.0}),
                     "rope_parameters"),
    "softcap": (lambda p: _config_dir(p, "gemma2", **TINY, attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "dropout": (lambda p: _config_dir(p, "qwen3", **TINY, attention_dropout=0.1), "attention_dropout"),
    "encoder_decoder": (lambda p: _config_dir(p, "t5", vocab_size=16, d_model=32, num_layers=1, num_heads=2),
                        "is_encoder_decoder"),
    "multimodal": (lambda p: _config_dir(p, "gemma3"), "vision_config"),
    "sinks": (lambda p: _config_dir(p, "gpt_oss", vocab_size=16, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8), "model_type"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_configs_refused_before_any_compute(tmp_path, case):
    make, key = REFUSED[case]
    path = make(tmp_path)
    assert not list(path.glob("*.safetensors"))  # refused from the config alone, before any weight is read
    with pytest.raises(CheckpointError, match=repr(key)):
        treelit.load_hf_model(path)


def test_activation_checkpointing_keeps_the_gradients(tmp_path):
    random_hf_checkpoint(tmp_path, "qwen3", **TINY)
    model = treelit.load_hf_model(tmp_path, dtype=torch.float64)
    tree = treelit.TokenTree.from_branches(FIXED[0], FIXED[1], FIXED[2])
    grads = []
    for on in (False, True):
        model.activation_checkpointing = on
        model.zero_grad(set_to_none=True)
        treelit.tree_loss(model, tree).backward()
        grads.append(_grads(model))
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.hf.modules())  # transformers' own, on
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, rtol=1e-12, atol=1e-14)


def test_plain_forward_and_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        treelit.load_hf_model(tmp_path / "nope")
    random_hf_checkpoint(tmp_path / "m", "qwen3", **TINY)
    model = treelit.load_hf_model(tmp_path / "m", dtype=torch.float64)
    ref = load_hf_oracle(tmp_path / "m", dtype=torch.float64, exact=False)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(input_ids=ids).logits, rtol=1e-10, atol=1e-10)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
