"""Every config key of every supported family is implemented, refused, or declared irrelevant.

The configuration classes of the installed ``transformers`` / ``fla`` are walked key by key:
a key in none of the three sets fails here until someone classifies it in
``treelit.models.hf_keys``. Refused keys must raise at load time, naming the key, for a
value that changes the math; implemented keys must change the loaded model config.
"""

from __future__ import annotations

import copy

import pytest

from treelit.models.hf import CheckpointError, config_from_hf
from treelit.models.hf_keys import FAMILY_KEYS, classify

transformers = pytest.importorskip("transformers")


def _config_classes():
    out = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }
    for name in ("qwen3", "qwen3_moe"):
        if name in FAMILY_KEYS:
            out[name] = transformers.AutoConfig.for_model(name).__class__
    try:
        from fla.models import GatedDeltaNetConfig, Mamba2Config

        out["gated_deltanet"] = GatedDeltaNetConfig
        out["mamba2"] = Mamba2Config
    except ImportError:  # pragma: no cover - fla is a test dependency
        pass
    return out


CLASSES = _config_classes()


def _tiny(model_type: str) -> dict:
    """A small, valid config.json dict of each family, as transformers / fla write it."""
    common = dict(vocab_size=16, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64)
    if model_type == "gated_deltanet":
        cfg = CLASSES[model_type](**common, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2.0,
                                  attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2})
    elif model_type == "mamba2":
        cfg = CLASSES[model_type](**common, head_dim=16, num_heads=4, state_size=8, n_groups=2, expand=2)
    else:
        extra = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        if model_type == "qwen3_moe":
            extra.update(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
        cfg = CLASSES[model_type](**common, **extra)
    return cfg.to_dict()


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_every_key_is_classified(model_type):
    keys = set(CLASSES[model_type]().to_dict())
    unknown = sorted(k for k in keys if classify(model_type, k) is None)
    assert not unknown, f"{model_type}: classify these keys in treelit.models.hf_keys: {unknown}"


# A value that changes the math, for every refused key (a new refused key needs an entry).
BAD_VALUES = {
    "hidden_act": "gelu",
    "attention_bias": True,
    "mlp_bias": True,
    "attention_dropout": 0.1,
    "use_l2warp": True,
    "attnres_block_size": 2,
    "layer_types": ["linear_attention", "full_attention"],
}


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_refused_keys_raise_naming_the_key(model_type):
    base = _tiny(model_type)
    config_from_hf(copy.deepcopy(base))  # the neutral config loads
    for key in FAMILY_KEYS[model_type]["refused"]:
        assert key in BAD_VALUES, f"add a math-changing value for refused key {key!r}"
        cfg = copy.deepcopy(base)
        cfg[key] = BAD_VALUES[key]
        with pytest.raises(CheckpointError, match=repr(key)):
            config_from_hf(cfg)


# For every implemented key, a change that must show in the loaded config.
PERTURB = {
    "vocab_size": 24, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-3, "rope_theta": 5000.0, "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 32},
    "rope_parameters": {"rope_type": "default", "rope_theta": 777.0},
    "num_heads": 4, "num_v_heads": 8, "expand_v": 1.0, "use_gate": False, "use_short_conv": False,
    "allow_neg_eigval": True, "conv_size": 3, "output_gate_activation": "sigmoid", "hidden_ratio": 2, "norm_eps": 1e-3,
    "attn": {"layers": [0], "num_heads": 4, "num_kv_heads": 4},
    "state_size": 4, "expand": 4, "n_groups": 1, "conv_kernel": 3, "use_conv_bias": False, "use_bias": True,
    "D_has_hdim": True, "rmsnorm": False, "norm_before_gate": True, "dt_limit": [0.0, 10.0],
    "sliding_window": 8, "num_experts": 6, "num_local_experts": 6, "num_experts_per_tok": 3,
    "moe_intermediate_size": 24, "norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [0],
    "output_router_logits": True,
}
_WIN = {"use_sliding_window": True, "sliding_window": 8}
DEPENDENT = {  # keys whose perturbation needs a consistent companion change
    ("mamba2", "num_heads"): {"num_heads": 8, "head_dim": 8},
    ("mamba2", "head_dim"): {"num_heads": 2, "head_dim": 32},
    ("mamba2", "expand"): {"expand": 4, "num_heads": 8},
    ("mamba2", "hidden_size"): {"hidden_size": 64, "num_heads": 8},
    ("gated_deltanet", "hidden_ratio"): {"hidden_ratio": 16, "intermediate_size": None},
    ("qwen3_moe", "router_aux_loss_coef"): {"output_router_logits": True, "router_aux_loss_coef": 0.01},
    ("qwen3_moe", "sliding_window"): _WIN,
    ("qwen3_moe", "use_sliding_window"): _WIN,
}
for _mt in ("qwen2", "qwen3"):  # (their configs carry an explicit layer_types, dropped by these)
    DEPENDENT[(_mt, "sliding_window")] = {**_WIN, "max_window_layers": 0, "layer_types": None}
    DEPENDENT[(_mt, "use_sliding_window")] = {**_WIN, "max_window_layers": 0, "layer_types": None}
    DEPENDENT[(_mt, "max_window_layers")] = {**_WIN, "max_window_layers": 1, "layer_types": None}
    DEPENDENT[(_mt, "layer_types")] = {**_WIN, "layer_types": ["full_attention", "sliding_attention"]}


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_implemented_keys_are_applied(model_type):
    base = _tiny(model_type)
    ref = config_from_hf(copy.deepcopy(base)).to_dict()
    for key in sorted(FAMILY_KEYS[model_type]["implemented"]):
        change = DEPENDENT.get((model_type, key))
        if change is None:
            assert key in PERTURB, f"add a perturbation for implemented key {key!r}"
            change = {key: PERTURB[key]}
        cfg = copy.deepcopy(base)
        if key == "rope_theta":
            cfg.pop("rope_parameters", None)
        if key == "rope_scaling":
            cfg.pop("rope_parameters", None)
        cfg.update(change)
        cfg = {k: v for k, v in cfg.items() if v is not None or k not in change or k == "intermediate_size"}
        got = config_from_hf(cfg).to_dict()
        assert got != ref, f"{model_type}: changing {key!r} did not change the loaded config"


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3", "qwen3_moe"])
def test_windows_read_as_transformers_applies_them(model_type):
    cfg = _tiny(model_type)
    cfg.pop("layer_types", None)
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    c = config_from_hf(cfg)
    expect = [8, 8] if model_type in ("mistral", "qwen3_moe") else [None, 8]  # Qwen3-MoE: every layer
    assert [c.window(i) for i in range(2)] == expect
    cfg["use_sliding_window"] = False
    c = config_from_hf(cfg)
    assert [c.window(i) for i in range(2)] == ([8, 8] if model_type == "mistral" else [None, None])
