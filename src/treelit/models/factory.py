"""Model construction from configuration (the ``model`` config group)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from treelit.models.hf import load_hf_checkpoint
from treelit.models.registry import build_model

__all__ = ["make_model", "parse_dtype"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: Any) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def make_model(
    preset: str = "qwen2_5_tiny",
    hf_checkpoint: Optional[str] = None,
    dtype: str = "float32",
    config: Optional[Dict[str, Any]] = None,
    max_seq_len: Optional[int] = None,
):
    """Load ``hf_checkpoint`` if given, else build the registered ``preset`` (random init,
    ``config`` overriding its fields). ``max_seq_len`` overrides the context length."""
    dt = parse_dtype(dtype)
    if hf_checkpoint:
        return load_hf_checkpoint(hf_checkpoint, dtype=dt, max_seq_len=max_seq_len)
    overrides = dict(config or {})
    if max_seq_len:
        overrides["max_seq_len"] = max_seq_len
    return build_model(preset, **overrides).to(dt)
