"""Model configuration shared by the builders and the Hugging Face checkpoint I/O."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["DecoderConfig", "FAMILIES", "decode_special_floats", "parse_config_json"]

# transformers 5.x writes the floats JSON has no literal for as {"__float__": "Infinity"}
# (fla 0.6.0's Mamba2 default dt_limit = (0.0, inf) is one); 4.x wrote Python's bare `Infinity`,
# which json.loads reads anyway. Its decoder (PreTrainedConfig._decode_special_floats) is private,
# so the same rules are kept here, and tests/models/test_config_decoding.py holds them equal.
FLOAT_TAG_KEY = "__float__"
FLOAT_TAG_VALUES = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(obj: Any) -> Any:
    """``obj`` with every ``{"__float__": "Infinity" | "-Infinity" | "NaN"}`` replaced by the float,
    recursively through dicts and lists, as transformers decodes a config.json: a dict whose only
    key is ``"__float__"`` with another string, or a non-string, is left as it is."""
    if isinstance(obj, dict):
        if set(obj) == {FLOAT_TAG_KEY} and isinstance(obj[FLOAT_TAG_KEY], str):
            return FLOAT_TAG_VALUES.get(obj[FLOAT_TAG_KEY], obj)
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def parse_config_json(text: str) -> Any:
    """The content of a ``config.json`` as transformers reads it (``json.loads``, then
    :func:`decode_special_floats`); raises ``json.JSONDecodeError``."""
    return decode_special_floats(json.loads(text))

# family -> (Hugging Face model_type, RoPE rotation style, q/k/v bias, per-head q/k RMSNorm)
FAMILIES = {
    "llama": ("llama", "interleaved", False, False),  # Llama 3.x (3.2 uses llama3-scaled RoPE)
    "qwen2": ("qwen2", "half", True, False),  # Qwen2 and Qwen2.5
    "mistral": ("mistral", "interleaved", False, False),
    "qwen3": ("qwen3", "half", False, True),
    "qwen3_moe": ("qwen3_moe", "half", False, True),
}

ROPE_TYPES = ("llama3", "yarn", "linear")
# RoPE types whose frequencies depend on the sequence length: a tree and its branches would
# rotate the same token differently.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")

MOE_DEFAULTS: Dict[str, Any] = {
    "num_experts": 8,
    "top_k": 2,
    "intermediate_dim": 64,  # per expert
    "norm_topk_prob": False,
    "sparse_step": 1,  # every sparse_step-th layer is a MoE layer ...
    "mlp_only_layers": [],  # ... except these, which keep a dense MLP
    "router_aux_loss_coef": 0.0,  # > 0: add coef x load-balancing loss to the training loss
    "router_aux_loss": "micro_batch",  # micro_batch | sequence
    "routing": "live",  # live (the router's top-k) | replay (the sampler's recorded experts)
}
AUX_DEFINITIONS = ("micro_batch", "sequence")
ROUTING_MODES = ("live", "replay")


def check_rope_scaling(scaling: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Validate a RoPE scaling dict; ``None`` for the default (unscaled) RoPE."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("default", None):
        return None
    if kind in LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"rope scaling {kind!r} depends on the sequence length: a tree and its branches would get different "
            f"frequencies, so tree mode cannot reproduce per-branch training (supported: {', '.join(ROPE_TYPES)})"
        )
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if kind == "linear" and not scaling.get("factor"):
        raise ValueError(f"rope scaling {kind!r} needs a 'factor'")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("rope scaling with partial_rotary_factor != 1 is not supported")
    out = {k: v for k, v in scaling.items() if k != "type"}
    out["rope_type"] = kind
    return out


@dataclass
class DecoderConfig:
    """Shape and numerics of a decoder-only language model.

    ``family`` picks the building blocks and the Hugging Face layout (``llama``, ``qwen2``,
    ``mistral``, ``qwen3``, ``qwen3_moe``; hybrid/recurrent layers via ``layer_types``).
    ``rope_scaling`` is ``None`` or a scaling dict with ``rope_type`` ``llama3`` (``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``),
    ``yarn`` (``factor``, ``original_max_position_embeddings``, optional ``attention_factor``,
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``) or ``linear``
    (``factor``).
    ``qk_norm``: per-head RMSNorm on queries and keys before RoPE (default: by family).
    ``sliding_window``: tokens a query sees (itself included) in the layers listed in
    ``sliding_window_layers`` (None: every attention layer); counted in depth on a tree.
    ``layer_types``: ``None`` (all attention) or one of ``"attention"``, ``"gdn"``,
    ``"mamba2"`` per layer; ``recurrent`` holds the recurrent layers' options.
    ``moe``: mixture-of-experts options (``qwen3_moe``; see ``MOE_DEFAULTS``).
    """

    family: str = "llama"
    vocab_size: int = 32000
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    embed_dim: int = 64
    intermediate_dim: int = 128
    head_dim: Optional[int] = None
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False
    qkv_bias: Optional[bool] = None
    qk_norm: Optional[bool] = None
    sliding_window: Optional[int] = None
    sliding_window_layers: Optional[List[int]] = None
    layer_types: Optional[List[str]] = None
    recurrent: Dict[str, Any] = field(default_factory=dict)
    moe: Dict[str, Any] = field(default_factory=dict)
    hf_extra: Dict[str, Any] = field(default_factory=dict)  # unknown config.json keys kept on save

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.head_dim is None:
            if self.embed_dim % self.num_heads:
                raise ValueError(
                    f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}; set head_dim"
                )
            self.head_dim = self.embed_dim // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.qkv_bias is None:
            self.qkv_bias = FAMILIES[self.family][2]
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}"
                )
            bad = sorted(set(self.layer_types) - {"attention", "gdn", "mamba2"})
            if bad:
                raise ValueError(f"unknown layer types {bad}; use attention, gdn or mamba2")
        if self.qk_norm is None:
            self.qk_norm = FAMILIES[self.family][3]
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None:
            self.sliding_window = int(self.sliding_window)
            if self.sliding_window < 1:
                raise ValueError(f"sliding_window must be >= 1 token, got {self.sliding_window}")
            if self.sliding_window_layers is not None:
                bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
                if bad:
                    raise ValueError(f"sliding_window_layers {bad} outside 0..{self.num_layers - 1}")
                self.sliding_window_layers = sorted(int(i) for i in self.sliding_window_layers)
        if self.family == "qwen3_moe" or self.moe:
            self.moe = {**MOE_DEFAULTS, **self.moe}
            unknown = sorted(set(self.moe) - set(MOE_DEFAULTS))
            if unknown:
                raise ValueError(f"unknown moe options {unknown}; known: {', '.join(MOE_DEFAULTS)}")
            m = self.moe
            if not 1 <= int(m["top_k"]) <= int(m["num_experts"]):
                raise ValueError(f"moe top_k must be in 1..num_experts ({m['num_experts']}), got {m['top_k']}")
            if m["router_aux_loss"] not in AUX_DEFINITIONS:
                raise ValueError(f"moe router_aux_loss must be one of {AUX_DEFINITIONS}, got {m['router_aux_loss']!r}")
            if float(m["router_aux_loss_coef"]) < 0:
                raise ValueError("moe router_aux_loss_coef must be >= 0")
            if m["routing"] not in ROUTING_MODES:
                raise ValueError(f"moe routing must be one of {ROUTING_MODES}, got {m['routing']!r}")

    @property
    def rope_style(self) -> str:
        return FAMILIES[self.family][1]

    @property
    def model_type(self) -> str:
        return FAMILIES[self.family][0]

    def layer_type(self, i: int) -> str:
        return "attention" if self.layer_types is None else self.layer_types[i]

    def window(self, i: int) -> Optional[int]:
        """The sliding window of layer ``i`` (None: it sees every ancestor)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and i not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` has a sparse mixture-of-experts MLP (transformers' Qwen3-MoE rule, on
        attention layers: a recurrent layer of treelit's own carries a dense MLP, or none)."""
        if not self.moe or int(self.moe["num_experts"]) <= 0 or self.layer_type(i) != "attention":
            return False
        return i not in self.moe["mlp_only_layers"] and (i + 1) % int(self.moe["sparse_step"]) == 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
