"""Numerics shared by every layer (attention blocks, recurrent blocks): kept below both
(``treelit.ssm`` builds recurrent blocks without importing ``treelit.models``).

Float32 and float64 inputs are computed in their own precision, so float64 models are
exact; half-precision inputs are computed in float32, as torchtune and transformers do.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtune.modules import RMSNorm

__all__ = ["compute_dtype", "rms_norm"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a torchtune ``RMSNorm`` in the input's precision (float32 for half types)."""
    if not isinstance(norm, RMSNorm):
        return norm(x)
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (y * norm.scale.to(xf.dtype)).to(x.dtype)
