"""Model configuration shared by the builders and the Hugging Face checkpoint I/O."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["DecoderConfig", "FAMILIES"]

# family -> (Hugging Face model_type, RoPE rotation style, q/k/v bias)
FAMILIES = {
    "llama": ("llama", "interleaved", False),  # Llama 3.x (3.2 uses llama3-scaled RoPE)
    "qwen2": ("qwen2", "half", True),  # Qwen2 and Qwen2.5
    "mistral": ("mistral", "interleaved", False),
}


@dataclass
class DecoderConfig:
    """Shape and numerics of a decoder-only language model.

    ``family`` picks the torchtune building blocks and the Hugging Face layout
    (``llama``, ``qwen2``, ``mistral``; hybrid/recurrent layers via ``layer_types``).
    ``rope_scaling`` is ``None`` or a Llama-3 scaling dict
    (``rope_type="llama3"``, ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``).
    ``layer_types``: ``None`` (all attention) or one of ``"attention"``, ``"gdn"``,
    ``"mamba2"`` per layer; ``recurrent`` holds the recurrent layers' options.
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
    layer_types: Optional[List[str]] = None
    recurrent: Dict[str, Any] = field(default_factory=dict)
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
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
            if kind in ("default", None):
                self.rope_scaling = None

    @property
    def rope_style(self) -> str:
        return FAMILIES[self.family][1]

    @property
    def model_type(self) -> str:
        return FAMILIES[self.family][0]

    def layer_type(self, i: int) -> str:
        return "attention" if self.layer_types is None else self.layer_types[i]

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
