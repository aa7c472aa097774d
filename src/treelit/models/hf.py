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
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch
from safetensors.torch import load_file, save_file

from treelit import models  # the package face: the decoder (torchtune) is imported when a checkpoint is loaded
from treelit.models.config import DecoderConfig, check_rope_scaling, decode_special_floats, parse_config_json
from treelit.models.errors import CheckpointError
from treelit.models.hf_files import SAFE_INDEX, check_weight_shapes, weight_files
from treelit.models.hf_keys import check_config_keys, effective_windows, untie_distinct_head
from treelit.models.hf_recurrent import (
    config_from_hf_recurrent,
    config_to_hf_recurrent,
    hf_to_tune_recurrent,
    tune_to_hf_recurrent,
)

if TYPE_CHECKING:
    from treelit.models.decoder import TreeDecoder

log = logging.getLogger(__name__)

NATIVE_MODEL_TYPE = "treelit"  # config.json of a model that has no Hugging Face format

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "config_from_hf", "config_to_hf", "CheckpointError"]


_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_KNOWN_KEYS = {
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "torch_dtype",
    "dtype", "hidden_act", "transformers_version", "use_cache", "attention_dropout", "mlp_bias",
    "treelit", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers",
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
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.scale",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.scale",
    "model.layers.{}.mlp.gate.weight": "layers.{}.mlp.gate.weight",
}
# Experts: per-expert Hugging Face names (hub checkpoints; what transformers writes) -> stacked
# treelit parameters [E, ...]; transformers 5's in-memory fused names load too.
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_TUNE = {"gate": "w1", "up": "w3", "down": "w2"}
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
    """(theta, scaling dict or None) from ``rope_theta``/``rope_scaling`` (hub checkpoints) or
    ``rope_parameters`` (transformers 5). Scaling lengths that default to the config are filled
    in, so the result does not depend on a later ``max_seq_len`` override."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    try:
        scaling = check_rope_scaling(scaling)
    except ValueError as exc:
        raise CheckpointError(f"config key 'rope_scaling': {exc}") from None
    if scaling is not None and scaling["rope_type"] in ("yarn", "llama3"):
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if scaling["rope_type"] == "yarn" and not scaling.get("factor"):
            scaling["factor"] = cfg["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return float(theta), scaling


def _windows(cfg: Dict[str, Any]):
    """(sliding_window, sliding_window_layers) of a config (see hf_keys.effective_windows)."""
    per_layer = effective_windows(cfg)
    sized = {w for w in per_layer if w is not None}
    if not sized:
        return None, None
    if len(sized) > 1:
        raise CheckpointError(f"config keys 'sliding_window'/'layer_types': layers use different windows {sorted(sized)}")
    layers = [i for i, w in enumerate(per_layer) if w is not None]
    return sized.pop(), (None if len(layers) == len(per_layer) else layers)


def _moe_options(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Qwen3-MoE options; the router loss is on when transformers' is (``output_router_logits``)."""
    coef = float(cfg.get("router_aux_loss_coef", 0.0) or 0.0)
    return {
        "num_experts": int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
        "top_k": int(cfg["num_experts_per_tok"]),
        "intermediate_dim": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "sparse_step": int(cfg.get("decoder_sparse_step", 1) or 1),
        "mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []],
        "router_aux_loss_coef": coef if cfg.get("output_router_logits") else 0.0,
    }


def config_from_hf(cfg: Dict[str, Any], max_seq_len: Optional[int] = None, where: str = "config.json") -> DecoderConfig:
    """Translate a Hugging Face ``config.json`` dict into a :class:`DecoderConfig`.

    Every key that would change the math but is not supported raises :class:`CheckpointError`
    naming it (see :mod:`treelit.models.hf_keys`). Non-finite floats may be tagged as
    transformers 5.x writes them (``{"__float__": "Infinity"}``)."""
    cfg = decode_special_floats(cfg)
    mt = cfg.get("model_type")
    check_config_keys(cfg, where, max_seq_len)
    if mt in ("gated_deltanet", "mamba2"):
        return config_from_hf_recurrent(cfg, max_seq_len)
    if mt not in _MODEL_TYPES:
        raise CheckpointError(f"unsupported model_type {mt!r}; supported: {', '.join(sorted(_MODEL_TYPES))}")
    family = _MODEL_TYPES[mt]
    theta, scaling = _rope_settings(cfg)
    window, window_layers = _windows(cfg)
    heads = cfg["num_attention_heads"]
    try:
        return DecoderConfig(
            family=family,
            vocab_size=cfg["vocab_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            embed_dim=cfg["hidden_size"],
            intermediate_dim=cfg.get("intermediate_size") or 1,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_seq_len=int(max_seq_len or cfg.get("max_position_embeddings", 4096)),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_base=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            sliding_window=window,
            sliding_window_layers=window_layers,
            moe=_moe_options(cfg) if family == "qwen3_moe" else {},
            hf_extra={k: v for k, v in cfg.items() if k not in _KNOWN_KEYS},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {type(exc).__name__}: {exc}") from None


def config_to_hf(c: DecoderConfig, dtype: torch.dtype) -> Dict[str, Any]:
    if c.layer_types is not None and any(t != "attention" for t in c.layer_types):
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
    if c.family in ("llama", "mistral"):
        cfg["mlp_bias"] = False
    if c.family == "mistral":
        cfg["sliding_window"] = c.sliding_window  # transformers' MistralConfig defaults to a 4096-token window
    elif c.family in ("qwen2", "qwen3", "qwen3_moe"):
        windowed = [c.window(i) is not None for i in range(c.num_layers)]
        cfg["use_sliding_window"] = any(windowed)
        cfg["sliding_window"] = c.sliding_window
        cfg["max_window_layers"] = windowed.index(True) if any(windowed) else c.num_layers
        cfg["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
    elif c.sliding_window is not None:
        raise CheckpointError(f"a {c.model_type} checkpoint has no sliding-window setting")
    if c.family == "qwen3_moe":
        m = c.moe
        cfg.update(num_experts=m["num_experts"], num_experts_per_tok=m["top_k"], moe_intermediate_size=m["intermediate_dim"],
                   norm_topk_prob=m["norm_topk_prob"], decoder_sparse_step=m["sparse_step"],
                   mlp_only_layers=list(m["mlp_only_layers"]))
        if m["router_aux_loss_coef"] > 0:
            cfg.update(output_router_logits=True, router_aux_loss_coef=m["router_aux_loss_coef"])
        else:
            cfg["output_router_logits"] = False
    return cfg


def _permute_in(t: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    """Half-split rows (HF) -> interleaved rows (torchtune) within each head."""
    rest = t.shape[1:]
    return t.reshape(heads, 2, hd // 2, *rest).transpose(1, 2).reshape(heads * hd, *rest)


def _permute_out(t: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, hd // 2, 2, *rest).transpose(1, 2).reshape(heads * hd, *rest)


def _load_file(f: Path) -> Dict[str, torch.Tensor]:
    """One weights file, its errors naming it (a truncated or corrupt file is a user error)."""
    try:
        if f.suffix == ".safetensors":
            return load_file(str(f))
        return torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors raises its own error types; torch.load various
        raise CheckpointError(f"{f}: cannot read weights ({type(exc).__name__}: {exc})") from None


def _read_state_dict(path: Path) -> Dict[str, torch.Tensor]:
    """All weights of a checkpoint directory (its :func:`~treelit.models.hf_files.weight_files`,
    shard names confined to the directory)."""
    files, index, weight_map = weight_files(path)
    sd: Dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(_load_file(f))
    if index is not None:
        absent = sorted(set(weight_map) - set(sd))
        if absent:
            raise CheckpointError(f"{index}: weights {', '.join(absent[:8])} are not in their shards")
    return sd


def _write_shards(sd: Dict[str, torch.Tensor], path: Path, max_shard_bytes: Optional[int]) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` each plus ``model.safetensors.index.json`` (the Hugging Face layout).
    Weights files of an earlier save in the directory are removed first."""
    for old in list(path.glob("model*.safetensors")) + [path / SAFE_INDEX]:
        if old.is_file():
            old.unlink()
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in sd.items():
        n = value.numel() * value.element_size()
        if max_shard_bytes and shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    mode = 0o666 & ~_umask()
    for name, shard in zip(names, shards):
        save_file(shard, str(path / name), metadata={"format": "pt"})
        os.chmod(path / name, mode)  # safetensors writes 0600; a checkpoint is meant to be shared
    if len(shards) > 1:
        total = sum(v.numel() * v.element_size() for v in sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, sh in zip(names, shards) for k in sh}}
        (path / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _stack_experts(sd: Dict[str, torch.Tensor], c: DecoderConfig, where: str) -> Dict[str, torch.Tensor]:
    """Per-expert (or fused) Hugging Face expert weights -> treelit's stacked ``w1/w3/w2`` [E, ...]."""
    out: Dict[str, torch.Tensor] = {}
    per: Dict[tuple, Dict[int, torch.Tensor]] = {}
    for key in [k for k in sd if ".mlp.experts." in k]:
        m = _EXPERT_RE.match(key)
        if m:
            per.setdefault((int(m.group(1)), _EXPERT_TUNE[m.group(3)]), {})[int(m.group(2))] = sd.pop(key)
            continue
        m = _FUSED_RE.match(key)
        if m is None:
            continue  # reported as unexpected by the caller
        layer, value = int(m.group(1)), sd.pop(key)
        if m.group(2) == "down_proj":
            out[f"layers.{layer}.mlp.w2"] = value
        else:
            inter = value.shape[1] // 2
            out[f"layers.{layer}.mlp.w1"], out[f"layers.{layer}.mlp.w3"] = value[:, :inter], value[:, inter:]
    E = int(c.moe.get("num_experts", 0)) if c.moe else 0
    for (layer, name), experts in per.items():
        missing = sorted(set(range(E)) - set(experts))
        if missing or len(experts) != E:
            raise CheckpointError(f"{where}layer {layer}: expert weights for experts {missing[:8]} are missing "
                                  f"({len(experts)} of {E} found)")
        out[f"layers.{layer}.mlp.{name}"] = torch.stack([experts[e] for e in range(E)])
    return out


def hf_to_tune_state_dict(sd: Dict[str, torch.Tensor], c: DecoderConfig, where: str = "") -> Dict[str, torch.Tensor]:
    sd = dict(sd)
    out: Dict[str, torch.Tensor] = _stack_experts(sd, c, where) if c.moe else {}
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
    inv_expert = {v: k for k, v in _EXPERT_TUNE.items()}
    for key, value in sd.items():
        if key == "output.weight" and c.tie_word_embeddings:
            continue
        m = re.match(r"^layers\.(\d+)\.mlp\.(w1|w2|w3)$", key)
        if m:  # stacked experts -> one tensor per expert (the hub layout)
            for e in range(value.shape[0]):
                out[f"model.layers.{m.group(1)}.mlp.experts.{e}.{inv_expert[m.group(2)]}_proj.weight"] = value[e].contiguous()
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


def read_config_json(path: Path):
    """``(config dict, config file)`` of a checkpoint directory; :class:`CheckpointError` naming
    the directory or file when it is missing or not JSON."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing config.json")
    try:
        return parse_config_json(cfg_file.read_text()), cfg_file
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({exc})") from exc


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
    cfg, cfg_file = read_config_json(path)
    if cfg.get("model_type") == NATIVE_MODEL_TYPE:
        try:
            config = DecoderConfig(**cfg["treelit_config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{cfg_file}: invalid treelit_config ({exc})") from exc
        if max_seq_len:
            config.max_seq_len = int(max_seq_len)
    else:
        config = config_from_hf(cfg, max_seq_len, where=str(cfg_file))
    # the sizes config.json states against the weights' headers, before anything is read or allocated
    check_weight_shapes(cfg, weight_files(path)[0], cfg_file)
    tune_sd = _read_state_dict(path)
    if cfg.get("model_type") != NATIVE_MODEL_TYPE:
        untie_distinct_head(config, tune_sd, str(cfg_file))  # as transformers' load of the folder
        tune_sd = _hf_weights_to_tune(tune_sd, config, path)
    # names and shapes on the meta device (nothing allocated): weights left out of the checkpoint, or
    # sizes in config.json the weights do not have, are refused before the model is built at those sizes
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in models.TreeDecoder(config).state_dict().items()}
    missing = sorted(set(expected) - set(tune_sd))
    if missing:
        raise CheckpointError(f"{path}: missing weights for {', '.join(missing[:8])}")
    for key, shape in expected.items():
        if list(tune_sd[key].shape) != shape:
            raise CheckpointError(f"{cfg_file}: the config makes {key} of shape {shape}, but the weights hold "
                                  f"{list(tune_sd[key].shape)}")
    model = models.TreeDecoder(config)
    # assign: the checkpoint's tensors themselves (a float64 checkpoint must not round through the
    # float32 parameters a fresh module starts with)
    model.load_state_dict(tune_sd, strict=True, assign=True)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device)


def _hf_weights_to_tune(sd, config: DecoderConfig, path: Path) -> Dict[str, torch.Tensor]:
    if config.layer_types is not None and any(t != "attention" for t in config.layer_types):
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
    max_shard_bytes: Optional[int] = 5 * 2**30,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory loadable by ``transformers``
    (``state_dict``: an already gathered one, see :func:`full_state_dict`). Weights larger
    than ``max_shard_bytes`` are written as shards with a ``model.safetensors.index.json``.

    A model with no Hugging Face format (a hybrid mixing Mamba2 with other layers) raises
    :class:`CheckpointError`, or with ``native_fallback=True`` is written in the same
    layout (``config.json`` + ``model.safetensors``) with ``model_type: "treelit"``: the
    treelit model config and treelit's own parameter names, which
    :func:`load_hf_checkpoint` (and ``model.hf_checkpoint=DIR``) read back, but
    ``transformers`` does not.
    """
    if not hasattr(model, "config"):
        raise TypeError("save_hf_checkpoint needs a treelit TreeDecoder (it carries the model config)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):  # an adapted transformers model: its own format and names
        sd = state_dict if state_dict is not None else full_state_dict(model)
        if dtype is not None:
            sd = {k: v.to(dtype) for k, v in sd.items()}
        return model.save_pretrained(path, state_dict=sd, max_shard_size=max_shard_bytes or "5GB")
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
            hf_sd = tune_to_hf_recurrent(sd, c)
        else:
            hf_sd = tune_to_hf_state_dict(sd, c)
    _write_shards(hf_sd, path, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return path
