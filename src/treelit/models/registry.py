"""Named model presets (registry kind ``model``).

Tiny random-init variants of each supported family are for tests, examples and
the CPU benchmark; real-size presets mirror the published architectures (their
weights come from a Hugging Face checkpoint via ``model.hf_checkpoint``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from treelit import models  # the package face: the decoder (torchtune) is imported when a preset is built
from treelit.models.config import DecoderConfig
from treelit.registry import get_registry

if TYPE_CHECKING:
    from treelit.models.decoder import TreeDecoder

__all__ = ["MODELS", "build_model"]

MODELS = get_registry("model", ["treelit.models.registry"])

_TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=2048)


def _preset(name: str, **defaults: Any) -> None:
    def make(**overrides: Any) -> TreeDecoder:
        return models.TreeDecoder(DecoderConfig(**{**defaults, **overrides}))

    make.__name__ = name
    make.__doc__ = f"Build the {name!r} preset; keyword arguments override its DecoderConfig fields."
    make.defaults = dict(defaults)  # type: ignore[attr-defined]
    MODELS.register(name, make)


_preset("llama3_2_tiny", family="llama", vocab_size=512, rope_base=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, **_TINY)
_preset("qwen2_tiny", family="qwen2", vocab_size=512, rope_base=1000000.0, norm_eps=1e-6, **_TINY)
_preset("qwen2_5_tiny", family="qwen2", vocab_size=512, rope_base=1000000.0, norm_eps=1e-6,
        tie_word_embeddings=True, **_TINY)
_preset("mistral_tiny", family="mistral", vocab_size=512, rope_base=1000000.0, **_TINY)
# Qwen3: q/k norms, head_dim independent of embed_dim / num_heads, no qkv bias.
_preset("qwen3_tiny", family="qwen3", vocab_size=512, rope_base=1000000.0, norm_eps=1e-6, tie_word_embeddings=True,
        **{**_TINY, "head_dim": 16})
_preset("qwen3_moe_tiny", family="qwen3_moe", vocab_size=512, rope_base=1000000.0, norm_eps=1e-6,
        moe={"num_experts": 8, "top_k": 2, "intermediate_dim": 32, "norm_topk_prob": True}, **{**_TINY, "head_dim": 16})
# Recurrent and hybrid models (Gated DeltaNet / Mamba2 layers, fla parameter layout).
_GDN = {"head_dim": 8, "num_heads": 2, "num_v_heads": 4, "expand_v": 2.0, "conv_size": 4}
_M2 = {"head_dim": 16, "state_size": 8, "n_groups": 2, "expand": 2, "conv_kernel": 4, "mlp": False}
_preset("gdn_tiny", family="qwen2", vocab_size=512, qkv_bias=False, layer_types=["gdn"] * 2,
        recurrent={"gdn": _GDN}, **_TINY)
_preset("mamba2_tiny", family="qwen2", vocab_size=512, qkv_bias=False, layer_types=["mamba2"] * 2,
        recurrent={"mamba2": _M2}, **_TINY)
_preset("hybrid_tiny", family="qwen2", vocab_size=512, qkv_bias=False, rope_base=10000.0,
        layer_types=["gdn", "attention", "mamba2", "gdn"], recurrent={"gdn": _GDN, "mamba2": {**_M2, "mlp": True}},
        **{**_TINY, "num_layers": 4})
# Real architectures (random init unless loaded from a checkpoint).
_preset("llama3_2_1b", family="llama", vocab_size=128256, num_layers=16, num_heads=32, num_kv_heads=8,
        embed_dim=2048, intermediate_dim=8192, max_seq_len=131072, rope_base=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
_preset("qwen3_0_6b", family="qwen3", vocab_size=151936, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        embed_dim=1024, intermediate_dim=3072, max_seq_len=40960, rope_base=1000000.0, norm_eps=1e-6,
        tie_word_embeddings=True)
_preset("qwen3_moe_30b_a3b", family="qwen3_moe", vocab_size=151936, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, embed_dim=2048, intermediate_dim=6144, max_seq_len=40960, rope_base=1000000.0, norm_eps=1e-6,
        moe={"num_experts": 128, "top_k": 8, "intermediate_dim": 768, "norm_topk_prob": True})
_preset("qwen2_5_0_5b", family="qwen2", vocab_size=151936, num_layers=24, num_heads=14, num_kv_heads=2,
        embed_dim=896, intermediate_dim=4864, max_seq_len=32768, rope_base=1000000.0, norm_eps=1e-6,
        tie_word_embeddings=True)


def build_model(name: str, **overrides: Any) -> TreeDecoder:
    """Build the registered model preset ``name`` (random init)."""
    return MODELS.get(name)(**overrides)
