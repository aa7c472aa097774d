"""fla's Hugging Face checkpoints (``GatedDeltaNetForCausalLM``, ``Mamba2ForCausalLM``) in and out.

Gated DeltaNet models (``model_type: gated_deltanet``) are pre-norm blocks of a mixer
(GDN, or softmax attention for the layers listed in ``attn.layers``) and a gated MLP;
Mamba2 models (``model_type: mamba2``) are blocks of a Mamba2 mixer only. Their
mixers load into treelit's tree-aware layers unchanged; embeddings, norms, MLPs and
attention projections are renamed to the torchtune layout treelit's decoders use
(attention uses half-split RoPE in both, so nothing is permuted).
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional

import torch

from treelit.models.config import DecoderConfig
from treelit.models.errors import CheckpointError

__all__ = ["config_from_hf_recurrent", "config_to_hf_recurrent", "hf_to_tune_recurrent", "tune_to_hf_recurrent"]

_GDN_KEYS = ("head_dim", "num_heads", "num_v_heads", "expand_v", "use_gate", "use_short_conv", "allow_neg_eigval",
             "conv_size", "output_gate_activation")
_M2_KEYS = ("head_dim", "num_heads", "state_size", "expand", "n_groups", "conv_kernel", "use_conv_bias", "use_bias", "D_has_hdim",
            "rmsnorm", "norm_before_gate")


def _error(msg: str) -> CheckpointError:
    return CheckpointError(msg)


def config_from_hf_recurrent(cfg: Dict[str, Any], max_seq_len: Optional[int] = None) -> DecoderConfig:
    mt = cfg.get("model_type")
    L = cfg["num_hidden_layers"]
    D = cfg["hidden_size"]
    common = dict(
        family="qwen2",
        qkv_bias=False,
        vocab_size=cfg["vocab_size"],
        num_layers=L,
        embed_dim=D,
        max_seq_len=int(max_seq_len or cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if mt == "mamba2":
        rec = {k: cfg[k] for k in _M2_KEYS if k in cfg}
        heads = cfg.get("num_heads")
        inner = int(cfg.get("expand", 2) * D)
        if heads is not None and heads * cfg.get("head_dim", 64) != inner:
            raise _error(f"Mamba2 config key 'num_heads' = {heads}: num_heads x head_dim "
                         f"({heads} x {cfg.get('head_dim', 64)}) must equal expand x hidden_size ({inner})")
        rec["mlp"] = False
        if cfg.get("dt_limit") is not None:
            try:
                rec["dt_limit"] = tuple(float(v) for v in cfg["dt_limit"])
            except (TypeError, ValueError):
                raise _error(f"Mamba2 config key 'dt_limit' = {cfg['dt_limit']!r}: expected two numbers") from None
        if cfg.get("hidden_act", "silu") != "silu":
            raise _error(f"Mamba2 hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        return DecoderConfig(
            **common, num_heads=1, num_kv_heads=1, head_dim=2, intermediate_dim=1, norm_eps=cfg.get("norm_eps", 1e-5),
            layer_types=["mamba2"] * L, recurrent={"mamba2": rec}, hf_extra={"model_type": "mamba2"},
        )
    if mt != "gated_deltanet":
        raise _error(f"unsupported model_type {mt!r}")
    if cfg.get("hidden_act", "swish") not in ("swish", "silu"):
        raise _error(f"GatedDeltaNet hidden_act {cfg.get('hidden_act')!r} is not supported (swish only)")
    attn = cfg.get("attn") or {}
    if isinstance(attn, list):
        raise _error("per-layer lists of attention settings are not supported; use one 'attn' dict")
    if attn.get("window_size"):
        raise _error("sliding-window attention layers (attn.window_size) are not supported in tree mode")
    attn_layers = set(attn.get("layers", []))
    heads = attn.get("num_heads", 1) or 1
    inter = cfg.get("intermediate_size")
    if inter is None:
        inter = 256 * math.ceil(int(D * cfg.get("hidden_ratio", 4) * 2 / 3) / 256)
    rec = {k: cfg[k] for k in _GDN_KEYS if k in cfg}
    return DecoderConfig(
        **{**common, "qkv_bias": bool(attn.get("qkv_bias", False))},
        num_heads=heads,
        num_kv_heads=attn.get("num_kv_heads") or heads,
        head_dim=D // heads,
        intermediate_dim=inter,
        norm_eps=cfg.get("norm_eps", 1e-6),
        rope_base=float(attn.get("rope_theta", 10000.0)),
        layer_types=["attention" if i in attn_layers else "gdn" for i in range(L)],
        recurrent={"gdn": rec},
        hf_extra={"model_type": "gated_deltanet"},
    )


def config_to_hf_recurrent(c: DecoderConfig, dtype: torch.dtype) -> Dict[str, Any]:
    kinds = set(c.layer_types)
    base = dict(vocab_size=c.vocab_size, hidden_size=c.embed_dim, num_hidden_layers=c.num_layers,
                tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_seq_len,
                torch_dtype=str(dtype).replace("torch.", ""), treelit={"layer_types": list(c.layer_types)})
    if kinds == {"mamba2"}:
        rec = dict(c.recurrent.get("mamba2", {}))
        rec.pop("mlp", None)
        if rec.get("dt_limit") is not None:
            rec["dt_limit"] = list(rec["dt_limit"])
        return {**base, "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "norm_eps": c.norm_eps,
                "hidden_act": "silu", **rec}
    if "mamba2" in kinds:
        raise _error("a model mixing Mamba2 with other layers has no fla checkpoint format; save it with torch.save")
    attn_layers = [i for i, t in enumerate(c.layer_types) if t == "attention"]
    out = {**base, "model_type": "gated_deltanet", "architectures": ["GatedDeltaNetForCausalLM"],
           "norm_eps": c.norm_eps, "hidden_act": "swish", "intermediate_size": c.intermediate_dim,
           **c.recurrent.get("gdn", {})}
    out.pop("mlp", None)
    if attn_layers:
        out["attn"] = {"layers": attn_layers, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
                       "qkv_bias": bool(c.qkv_bias), "rope_theta": c.rope_base, "window_size": None}
    return out


def _tables(c: DecoderConfig):
    """(hf name -> treelit name) per layer kind, with {} for the layer index."""
    if set(c.layer_types) == {"mamba2"}:
        top = {"backbone.embeddings.weight": "tok_embeddings.weight", "backbone.norm_f.weight": "norm.scale",
               "lm_head.weight": "output.weight"}
        return top, {"backbone.layers.{}.norm.weight": "layers.{}.sa_norm.scale"}, "backbone.layers.{}.mixer.", "layers.{}.mixer."
    top = {"model.embeddings.weight": "tok_embeddings.weight", "model.norm.weight": "norm.scale",
           "lm_head.weight": "output.weight"}
    per = {
        "model.layers.{}.attn_norm.weight": "layers.{}.sa_norm.scale",
        "model.layers.{}.mlp_norm.weight": "layers.{}.mlp_norm.scale",
        "model.layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.w1.weight",
        "model.layers.{}.mlp.up_proj.weight": "layers.{}.mlp.w3.weight",
        "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.w2.weight",
    }
    return top, per, "model.layers.{}.attn.", None


_ATTN = {"q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.output_proj"}


def hf_to_tune_recurrent(sd: Dict[str, torch.Tensor], c: DecoderConfig, where: str = "") -> Dict[str, torch.Tensor]:
    top, per, mixer_hf, _ = _tables(c)
    out: Dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in sd.items():
        key = key.replace("backbone.embedding.", "backbone.embeddings.")
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if key in top:
            out[top[key]] = value
            continue
        m = re.search(r"\.layers\.(\d+)\.", key)
        if m is None:
            unknown.append(key)
            continue
        i = int(m.group(1))
        abstract = key.replace(f".layers.{i}.", ".layers.{}.")
        if abstract in per:
            out[per[abstract].format(i)] = value
            continue
        prefix = mixer_hf.format(i)
        if key.startswith(prefix):
            rest = key[len(prefix):]
            if c.layer_type(i) == "attention":
                proj, _, leaf = rest.partition(".")
                if proj not in _ATTN:
                    unknown.append(key)
                    continue
                out[f"layers.{i}.{_ATTN[proj]}.{leaf}"] = value
            else:
                out[f"layers.{i}.mixer.{rest}"] = value
            continue
        unknown.append(key)
    if unknown:
        raise _error(f"{where}unexpected weights: {', '.join(unknown[:8])}")
    return out


def tune_to_hf_recurrent(sd: Dict[str, torch.Tensor], c: DecoderConfig) -> Dict[str, torch.Tensor]:
    top, per, mixer_hf, _ = _tables(c)
    inv_top = {v: k for k, v in top.items()}
    inv_per = {v: k for k, v in per.items()}
    inv_attn = {v: k for k, v in _ATTN.items()}
    out: Dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key == "output.weight" and c.tie_word_embeddings:
            continue
        if key in inv_top:
            out[inv_top[key]] = value.contiguous()
            continue
        m = re.match(r"layers\.(\d+)\.(.*)$", key)
        if m is None:
            raise _error(f"no fla name for parameter {key!r}")
        i, rest = int(m.group(1)), m.group(2)
        abstract = f"layers.{{}}.{rest}"
        if abstract in inv_per:
            out[inv_per[abstract].format(i)] = value.contiguous()
        elif rest.startswith("mixer."):
            out[mixer_hf.format(i) + rest[len("mixer."):]] = value.contiguous()
        else:
            proj, _, leaf = rest.rpartition(".")
            if proj not in inv_attn:
                raise _error(f"no fla name for parameter {key!r}")
            out[mixer_hf.format(i) + f"{inv_attn[proj]}.{leaf}"] = value.contiguous()
    return out
