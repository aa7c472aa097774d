"""Rotary position embeddings with scaled frequencies (default, llama3, yarn, linear).

On a tree a token's position is its depth, so RoPE is exact as long as a token's
rotation depends on its position only. That holds for every type here; the types
whose frequencies depend on the current sequence length (``dynamic``, ``longrope``)
are refused in :func:`treelit.models.config.check_rope_scaling`.

Frequencies are computed in float32 with the same operations, in the same order, as
the published Hugging Face implementation, so both sides rotate with bitwise-equal
inverse frequencies; angles, cos and sin are then formed in float64 by
:func:`rotate`, which keeps float64 models exact. yarn's
attention factor multiplies cos and sin (it scales q·k by its square).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from treelit.utils.numerics import compute_dtype

__all__ = ["TreeRoPE", "rope_frequencies", "rotate"]


def _default(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(dim: int, base: float, s: Dict[str, Any]) -> torch.Tensor:
    inv_freq = _default(dim, base)
    factor = s.get("factor", 8)
    low, high = s.get("low_freq_factor", 1), s.get("high_freq_factor", 4)
    old = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def _yarn(dim: int, base: float, s: Dict[str, Any], max_positions: int) -> Tuple[torch.Tensor, float]:
    original = s.get("original_max_position_embeddings") or max_positions
    factor = s.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp.to(dtype=torch.float)  # share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_frequencies(dim: int, base: float, scaling: Optional[Dict[str, Any]] = None,
                     max_positions: int = 4096) -> Tuple[torch.Tensor, float]:
    """``(inverse frequencies [dim / 2] float32, attention factor)`` for a RoPE type."""
    kind = None if scaling is None else scaling.get("rope_type")
    if kind is None:
        return _default(dim, base), 1.0
    if kind == "llama3":
        return _llama3(dim, base, scaling), 1.0
    if kind == "linear":
        return _default(dim, base) / float(scaling["factor"]), 1.0
    if kind == "yarn":
        return _yarn(dim, base, scaling, max_positions)
    raise ValueError(f"unsupported rope type {kind!r}")


def rotate(rope: nn.Module, x: torch.Tensor, pos: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` by positions ``pos [B, L]`` with ``rope.theta [D/2]`` (and its
    ``attention_scaling``), pairing channels ``half``-split or ``interleaved`` (``style``).

    Angles are formed in float64 so that float64 models are exact; the rotation runs in the
    input's precision (float32 for half types).
    """
    theta = rope.theta.to(torch.float64)
    ang = pos.to(torch.float64).unsqueeze(-1) * theta  # [B, L, D/2]
    dt = compute_dtype(x)
    scale = getattr(rope, "attention_scaling", 1.0)  # yarn's attention factor
    cos = (ang.cos() * scale).to(dt).unsqueeze(2)  # [B, L, 1, D/2]
    sin = (ang.sin() * scale).to(dt).unsqueeze(2)
    xf = x.to(dt)
    if style == "half":
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        xs = xf.reshape(*xf.shape[:-1], -1, 2)
        x1, x2 = xs[..., 0], xs[..., 1]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


class TreeRoPE(nn.Module):
    """RoPE over ``head_dim`` channels, rotating ``half``-split or ``interleaved`` pairs.

    ``theta [head_dim / 2]`` holds the inverse frequencies (a non-persistent buffer, as
    in torchtune); ``attention_scaling`` multiplies cos and sin. ``forward`` follows
    torchtune's contract (``x [b, s, n_h, h_d]``, optional ``input_pos [b, s]``), so the
    module also serves torchtune's own decoder forward.
    """

    def __init__(self, dim: int, base: float, style: str, scaling: Optional[Dict[str, Any]] = None,
                 max_positions: int = 4096) -> None:
        super().__init__()
        if style not in ("half", "interleaved"):
            raise ValueError(f"RoPE style must be 'half' or 'interleaved', got {style!r}")
        self.dim, self.base, self.style = dim, float(base), style
        self.scaling = dict(scaling) if scaling else None
        self.max_positions = int(max_positions)
        theta, self.attention_scaling = rope_frequencies(dim, self.base, scaling, self.max_positions)
        self.register_buffer("theta", theta, persistent=False)

    def rope_init(self) -> None:  # torchtune calls this when it re-materialises buffers
        theta, _ = rope_frequencies(self.dim, self.base, self.scaling, self.max_positions)
        self.theta = theta.to(self.theta.device)

    def forward(self, x: torch.Tensor, *, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s = x.shape[:2]
        pos = input_pos if input_pos is not None else torch.arange(s, device=x.device).expand(b, s)
        return rotate(self, x, pos, self.style)

    def extra_repr(self) -> str:
        kind = self.scaling["rope_type"] if self.scaling else "default"
        return f"dim={self.dim}, base={self.base}, style={self.style}, type={kind}"
