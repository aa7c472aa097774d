"""Hugging Face checkpoints in and out (``config.json`` + safetensors).

Weights are renamed between Hugging Face and torchtune layouts. Llama and
Mistral checkpoints store q/k projections for half-split RoPE while torchtune's
RoPE for those families rotates interleaved pairs, so their q/k rows are
permuted on the way in and back on the way out (Qwen2 uses half-split RoPE in
torchtune too, so nothing is permuted). RoPE settings are read from either
``rope_theta``/``rope_scaling`` (hub checkpoints) or ``rope_parameters``
(transformers 5); Llama-3 scaling is applied only when the checkpoint asks for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from treelit.models.config import DecoderConfig
from treelit.models.decoder import TreeDecoder
from treelit.models.hf_keys import check_config_keys

log = logging.getLogger(__name__)

NATIVE_MODEL_TYPE = "treelit"  # config.json of a model that has no Hugging Face format

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "config_from_hf", "config_to_hf", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a supported model."""


_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
_KNOWN_KEYS = {
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "torch_dtype",
    "dtype", "hidden_act", "transformers_version", "use_cache", "attention_dropout", "mlp_bias",
    "treelit",
}

# Hugging Face name -> torchtune name (per-layer names use {}).
_HF_TO_TUNE = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.q_proj.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attn.q_proj.bias",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.k_proj.weight",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attn.k_proj.bias",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attn.v_proj.weight",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attn.v_proj.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attn.output_proj.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.mlp.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.sa_norm.scale",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm.scale",
}
_TUNE_TO_HF = {v: k for k, v in _HF_TO_TUNE.items()}
_LAYER_RE = re.compile(r"\.(\d+)\.")


def _map_key(key: str, table: Dict[str, str]) -> Optional[str]:
    m = _LAYER_RE.search(key)
    if m is None:
        return table.get(key)
    abstract = key[: m.start()] + ".{}." + key[m.end() :]
    target = table.get(abstract)
    return None if target is None else target.format(m.group(1))


def _rope_settings(cfg: Dict[str, Any]):
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise CheckpointError(f"rope scaling {kind!r} is not supported (supported: llama3)")
    return float(theta), scaling


def config_from_hf(cfg: Dict[str, Any], max_seq_len: Optional[int] = None, where: str = "config.json") -> DecoderConfig:
    """Translate a Hugging Face ``config.json`` dict into a :class:`DecoderConfig`.

    Every key that would change the math but is not supported raises :class:`CheckpointError`
    naming it (see :mod:`treelit.models.hf_keys`)."""
    mt = cfg.get("model_type")
    check_config_keys(cfg, where, max_seq_len)
    if mt in ("gated_deltanet", "mamba2"):
        from treelit.models.hf_recurrent import config_from_hf_recurrent

        return config_from_hf_recurrent(cfg, max_seq_len)
    if mt not in _MODEL_TYPES:
        raise CheckpointError(f"unsupported model_type {mt!r}; supported: {', '.join(sorted(_MODEL_TYPES))}")
    family = _MODEL_TYPES[mt]
    theta, scaling = _rope_settings(cfg)
    if family != "llama" and scaling is not None:
        raise CheckpointError(f"rope scaling on a {mt} checkpoint is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    heads = cfg["num_attention_heads"]
    return DecoderConfig(
        family=family,
        vocab_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        embed_dim=cfg["hidden_size"],
        intermediate_dim=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_seq_len=int(max_seq_len or cfg.get("max_position_embeddings", 4096)),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_base=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")),
        hf_extra={k: v for k, v in cfg.items() if k not in _KNOWN_KEYS},
    )


def config_to_hf(c: DecoderConfig, dtype: torch.dtype) -> Dict[str, Any]:
    if c.layer_types is not None and any(t != "attention" for t in c.layer_types):
        from treelit.models.hf_recurrent import config_to_hf_recurrent

        return config_to_hf_recurrent(c, dtype)
    cfg: Dict[str, Any] = dict(c.hf_extra)
    cfg.update(
        model_type=c.model_type,
        architectures=[_ARCH[c.family]],
        vocab_size=c.vocab_size,
        hidden_size=c.embed_dim,
        intermediate_size=c.intermediate_dim,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_base,
        rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None,
        tie_word_embeddings=c.tie_word_embeddings,
        hidden_act="silu",
        torch_dtype=str(dtype).replace("torch.", ""),
    )
    if c.family != "qwen2":
        cfg["attention_bias"] = bool(c.qkv_bias)
        cfg["mlp_bias"] = False
    if c.family == "mistral":
        cfg.setdefault("sliding_window", None)  # transformers' MistralConfig defaults to a 4096-token window
    return cfg


def _permute_in(t: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    """Half-split rows (HF) -> interleaved rows (torchtune) within each head."""
    rest = t.shape[1:]
    return t.reshape(heads, 2, hd // 2, *rest).transpose(1, 2).reshape(heads * hd, *rest)


def _permute_out(t: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, hd // 2, 2, *rest).transpose(1, 2).reshape(heads * hd, *rest)


def _read_state_dict(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        sd: Dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for f in bins:
            sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
        return sd
    raise CheckpointError(f"{path}: no *.safetensors or pytorch_model*.bin weights found")


def hf_to_tune_state_dict(sd: Dict[str, torch.Tensor], c: DecoderConfig, where: str = "") -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in sd.items():
        if "rotary_emb.inv_freq" in key:
            continue
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        new = _map_key(key, _HF_TO_TUNE)
        if new is None:
            unknown.append(key)
            continue
        if c.rope_style == "interleaved":
            if ".q_proj." in key:
                value = _permute_in(value, c.num_heads, c.head_dim)
            elif ".k_proj." in key:
                value = _permute_in(value, c.num_kv_heads, c.head_dim)
        out[new] = value
    if unknown:
        raise CheckpointError(f"{where}unexpected weights for a {c.model_type} model: {', '.join(unknown[:8])}")
    return out


def tune_to_hf_state_dict(sd: Dict[str, torch.Tensor], c: DecoderConfig) -> Dict[str, torch.Tensor]:
    out = {}
    for key, value in sd.items():
        if key == "output.weight" and c.tie_word_embeddings:
            continue
        new = _map_key(key, _TUNE_TO_HF)
        if new is None:
            raise CheckpointError(f"no Hugging Face name for parameter {key!r}")
        if c.rope_style == "interleaved":
            if ".q_proj." in key:
                value = _permute_out(value, c.num_heads, c.head_dim)
            elif ".k_proj." in key:
                value = _permute_out(value, c.num_kv_heads, c.head_dim)
        out[new] = value.contiguous()
    return out


def load_hf_checkpoint(
    path: Union[str, os.PathLike],
    *,
    dtype: Optional[torch.dtype] = torch.float32,
    device: Union[str, torch.device] = "cpu",
    max_seq_len: Optional[int] = None,
) -> TreeDecoder:
    """Load a Hugging Face checkpoint directory (``config.json`` + weights) as a :class:`TreeDecoder`.

    Args:
        path: the checkpoint directory.
        dtype: parameter dtype (default float32); ``None`` keeps the checkpoint's.
        device: where to put the model.
        max_seq_len: override ``max_position_embeddings`` (sizes the RoPE tables).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({exc})") from exc
    if cfg.get("model_type") == NATIVE_MODEL_TYPE:
        try:
            config = DecoderConfig(**cfg["treelit_config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{cfg_file}: invalid treelit_config ({exc})") from exc
        if max_seq_len:
            config.max_seq_len = int(max_seq_len)
        tune_sd = _read_state_dict(path)
    else:
        config = config_from_hf(cfg, max_seq_len, where=str(cfg_file))
        tune_sd = _hf_weights_to_tune(_read_state_dict(path), config, path)
    model = TreeDecoder(config)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - set(tune_sd))
    if missing:
        raise CheckpointError(f"{path}: missing weights for {', '.join(missing[:8])}")
    # assign: the checkpoint's tensors themselves (a float64 checkpoint must not round through the
    # float32 parameters a fresh module starts with)
    model.load_state_dict(tune_sd, strict=True, assign=True)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)


def _hf_weights_to_tune(sd, config: DecoderConfig, path: Path) -> Dict[str, torch.Tensor]:
    if config.layer_types is not None and any(t != "attention" for t in config.layer_types):
        from treelit.models.hf_recurrent import hf_to_tune_recurrent

        return hf_to_tune_recurrent(sd, config, f"{path}: ")
    return hf_to_tune_state_dict(sd, config, f"{path}: ")


def full_state_dict(model) -> Dict[str, torch.Tensor]:
    """The model's state dict on CPU with sharded (DTensor) entries gathered. Under FSDP2 every
    rank must call this (the gather is a collective)."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def save_hf_checkpoint(
    model: TreeDecoder,
    path: Union[str, os.PathLike],
    *,
    dtype: Optional[torch.dtype] = None,
    state_dict: Optional[Dict[str, torch.Tensor]] = None,
    native_fallback: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory loadable by ``transformers``
    (``state_dict``: an already gathered one, see :func:`full_state_dict`).

    A model with no Hugging Face format (a hybrid mixing Mamba2 with other layers) raises
    :class:`CheckpointError`, or with ``native_fallback=True`` is written in the same
    layout (``config.json`` + ``model.safetensors``) with ``model_type: "treelit"``: the
    treelit model config and treelit's own parameter names, which
    :func:`load_hf_checkpoint` (and ``model.hf_checkpoint=DIR``) read back, but
    ``transformers`` does not.
    """
    from safetensors.torch import save_file

    if not hasattr(model, "config"):
        raise TypeError("save_hf_checkpoint needs a treelit TreeDecoder (it carries the model config)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = state_dict if state_dict is not None else full_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    out_dtype = next(iter(sd.values())).dtype
    c = model.config
    try:
        hf_config = config_to_hf(c, out_dtype)
    except CheckpointError as exc:
        if not native_fallback:
            raise
        log.warning("%s; writing %s in treelit's own checkpoint format instead", exc, path)
        hf_config = {"model_type": NATIVE_MODEL_TYPE, "treelit_config": c.to_dict(),
                     "torch_dtype": str(out_dtype).replace("torch.", "")}
        hf_sd = sd
    else:
        if c.layer_types is not None and any(t != "attention" for t in c.layer_types):
            from treelit.models.hf_recurrent import tune_to_hf_recurrent

            hf_sd = tune_to_hf_recurrent(sd, c)
        else:
            hf_sd = tune_to_hf_state_dict(sd, c)
    save_file(hf_sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return path
