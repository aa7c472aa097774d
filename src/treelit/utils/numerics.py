"""Numerics shared by every layer (attention blocks, recurrent blocks): kept below both
(``treelit.ssm`` builds recurrent blocks without importing ``treelit.models``).

Float32 and float64 inputs are computed in their own precision, so float64 models are
exact; half-precision inputs are computed in float32, as torchtune and transformers do.

torchtune is not imported here (it loads torchao and datasets): a model holding torchtune's
``RMSNorm`` was built after ``torchtune.modules`` was imported, so :func:`rms_norm` looks the
class up in ``sys.modules`` and a run that never loads torchtune (a transformers model) never pays for it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = ["compute_dtype", "equal_blocks", "rms_norm"]


def equal_blocks(total: int, cap: int) -> int:
    """Items per block when ``total`` items are cut into as few blocks of at most ``cap`` as
    possible, all of about the same size (``total`` when it fits in one). A short last block
    costs about as much as a full one wherever every block reads the same weight (the MLP's,
    the vocabulary head's); equal blocks spread the items over the same number of reads."""
    if total <= cap:
        return total
    n = -(-total // cap)
    return -(-total // n)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a torchtune ``RMSNorm`` in the input's precision (float32 for half types)."""
    rms_norm_type = getattr(sys.modules.get("torchtune.modules"), "RMSNorm", None)  # None: no model holds one
    if rms_norm_type is None or not isinstance(norm, rms_norm_type):
        return norm(x)
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (y * norm.scale.to(xf.dtype)).to(x.dtype)
