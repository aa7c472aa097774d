"""Tree-aware Gated DeltaNet and Mamba2 layers, and the blocks that hold them.

Parameter names and shapes match ``fla.layers.GatedDeltaNet`` and ``fla.layers.Mamba2``
(fla 0.6), so fla checkpoints load. The forward runs over a sequence context
(:mod:`treelit.models.context`): a DFS-serialized tree row (state routed from parent
segments, convolution over ancestors) or independent causal rows; in both cases each
token's output equals that of running its own branch from the root.

The math follows fla's layers: for Gated DeltaNet, short causal convolutions (SiLU)
on q/k/v, q/k L2-normalised as ``x / sqrt(sum x^2 + 1e-6)``, ``beta = sigmoid(b)``
(x2 with ``allow_neg_eigval``), ``g = -exp(A_log) softplus(a + dt_bias)``, value head
j reading q/k head ``j // (HV/H)``, scale ``K^-0.5``, a per-head RMSNorm gated by
``swish(g_proj x)``; for Mamba2, ``in_proj -> [z | xBC | dt]``, a short convolution
over xBC, ``dt = softplus(dt + dt_bias)`` clamped to ``dt_limit``, ``A = -exp(A_log)``,
head h using B/C group ``h // (H/G)`` (the convention of the mamba-ssm kernels), a
group RMSNorm gated by ``silu(z)``. Unlike fla's kernels, nothing is rounded through
float32: float64 models are exact.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from treelit.ssm.fla_backend import gdn_scan_fla, ssd_scan_fla
from treelit.ssm.scan import chunked_scan, gdn_chunk, gdn_step, segment_scan, ssd_chunk, ssd_step
from treelit.utils.numerics import rms_norm

__all__ = ["causal_conv", "conv_context_at", "ShortConv", "GatedDeltaNet", "Mamba2", "RecurrentBlock", "build_recurrent_layer"]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, layout, context: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution over a :class:`~treelit.ssm.layout.RecurrentLayout` (no
    activation): ``x [T, C]``, ``weight [C, K]`` (``weight[:, K-1]`` multiplies the token itself,
    ``weight[:, K-1-j]`` its j-th ancestor), ``context [K-1, C]`` the inputs before the row's root
    (oldest first; zeros when None). Returns ``[T, C]`` in ``x``'s dtype."""
    K = weight.shape[1]
    w = weight.to(x.dtype)
    y = x * w[:, K - 1]
    if K > 1:
        ctx = context if context is not None else x.new_zeros(K - 1, x.shape[1])
        src = torch.cat([x, ctx.to(x.dtype), x.new_zeros(1, x.shape[1])])
        for j in range(K - 1):
            y = y + src[layout.conv_src[:, j]] * w[:, j]
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y


def conv_context_at(x: torch.Tensor, layout, context: Optional[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The ``K-1`` convolution inputs ending at each of ``tokens`` (oldest first): the context a
    child starting right after that token needs. ``x [T, C]`` -> ``[n, K-1, C]``."""
    ctx = context if context is not None else x.new_zeros(layout.K - 1, x.shape[1])
    src = torch.cat([x, ctx.to(x.dtype), x.new_zeros(1, x.shape[1])])
    cols = torch.cat([layout.conv_src[tokens][:, 1:], tokens[:, None]], dim=1)  # lags K-2..1, then the token
    return src[cols]


class ShortConv(nn.Module):
    """Depthwise causal convolution, ``weight [C, 1, K]`` (an ``nn.Conv1d`` layout), then SiLU.
    Over a tree, lag j reads the token's j-th ancestor (see :mod:`treelit.ssm.layout`)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool = False) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, layout, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [T, C]``; ``context [K-1, C]``: the inputs before the row's root (oldest first)."""
        return F.silu(causal_conv(x, self.weight[:, 0, :], layout, context, self.bias))

    def context_at(self, x: torch.Tensor, layout, context: Optional[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """See :func:`conv_context_at`."""
        return conv_context_at(x, layout, context, tokens)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def _inv_softplus_dt(n: int, dt_min=0.001, dt_max=0.1, floor=1e-4) -> torch.Tensor:
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer with ``fla.layers.GatedDeltaNet``'s parameters (see module docs)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int = 64,
        num_heads: int = 4,
        num_v_heads: Optional[int] = None,
        expand_v: float = 2.0,
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        norm_eps: float = 1e-5,
        output_gate_activation: str = "swish",
    ) -> None:
        super().__init__()
        self.H, self.HV = num_heads, num_v_heads or num_heads
        if self.HV % self.H:
            raise ValueError(f"num_v_heads ({self.HV}) must be a multiple of num_heads ({self.H})")
        self.dk, self.dv = head_dim, int(head_dim * expand_v)
        if self.dv != head_dim * expand_v:
            raise ValueError(f"head_dim * expand_v must be an integer, got {head_dim * expand_v}")
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"output_gate_activation must be swish, silu or sigmoid, got {output_gate_activation!r}")
        self.key_dim, self.value_dim = self.H * self.dk, self.HV * self.dv
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.allow_neg_eigval, self.norm_eps = allow_neg_eigval, norm_eps
        self.gate_act = output_gate_activation
        self.conv_size = conv_size if use_short_conv else 1
        self.backend = "torch"
        self.chunk_size = 64  # torch backend: tokens per block of the chunked scan (1: step by step)
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.HV, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.HV, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.HV).uniform_(0, 16)))
        self.dt_bias = nn.Parameter(_inv_softplus_dt(self.HV))
        if use_short_conv:
            self.q_conv1d = ShortConv(self.key_dim, conv_size, conv_bias)
            self.k_conv1d = ShortConv(self.key_dim, conv_size, conv_bias)
            self.v_conv1d = ShortConv(self.value_dim, conv_size, conv_bias)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = _Norm(self.dv)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def reset_tree_parameters(self, std: float) -> None:
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.empty(self.HV).uniform_(1, 16)))
            self.dt_bias.copy_(_inv_softplus_dt(self.HV))
            nn.init.ones_(self.o_norm.weight)

    def forward(self, x: torch.Tensor, layer: int, ctx) -> torch.Tensor:
        B, L, _ = x.shape
        xf = x.reshape(B * L, -1)
        layout = ctx.recurrent_layout(self.conv_size, B, L, x.device)
        pre = {"q": self.q_proj(xf), "k": self.k_proj(xf), "v": self.v_proj(xf)}
        if self.use_short_conv:
            convs = {"q": self.q_conv1d, "k": self.k_conv1d, "v": self.v_conv1d}
            given, context = ctx.recurrent_conv_inputs(layer, self.conv_size, {f"conv_{n}": pre[n] for n in "qkv"})
            pre = {n: given[f"conv_{n}"] for n in "qkv"}
            post = {n: convs[n](pre[n], layout, context[f"conv_{n}"]) for n in "qkv"}
        else:
            post = {n: F.silu(pre[n]) for n in "qkv"}
        T = xf.shape[0]
        q = post["q"].view(T, self.H, self.dk)
        k = post["k"].view(T, self.H, self.dk)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        rep = self.HV // self.H
        if rep > 1:
            q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
        v = post["v"].view(T, self.HV, self.dv)
        beta = torch.sigmoid(self.b_proj(xf)) * (2.0 if self.allow_neg_eigval else 1.0)
        g = -torch.exp(self.A_log.to(xf.dtype)) * F.softplus(self.a_proj(xf) + self.dt_bias.to(xf.dtype))
        o, cap = ctx.recurrent_scan(layer, lambda init: self._scan(q, k, v, beta, g, layout, init),
                                    (self.HV, self.dk, self.dv), q)
        if ctx.captures_recurrent:
            toks = torch.from_numpy(layout.capture).to(xf.device)
            out: Dict[str, Any] = {"state": cap}
            if self.use_short_conv:
                for n in "qkv":
                    out[f"conv_{n}"] = convs[n].context_at(pre[n], layout, context[f"conv_{n}"], toks)
            ctx.record_recurrent(layer, out)
        y = _rms(o, self.o_norm.weight, self.norm_eps)
        if self.use_gate:
            z = self.g_proj(xf).view(T, self.HV, self.dv)
            y = y * (F.silu(z) if self.gate_act in ("swish", "silu") else torch.sigmoid(z))
        return self.o_proj(y.reshape(T, self.value_dim)).view(B, L, -1)

    def _scan(self, q, k, v, beta, g, layout, init):
        if self.backend == "fla":
            return gdn_scan_fla(q, k, v, beta, g, layout, init, self.dk**-0.5)
        shapes = (self.HV, self.dk, self.dv), (self.HV, self.dv)
        if self.chunk_size > 1:
            chunk = gdn_chunk(q, k, v, beta, g, self.dk**-0.5)
            return chunked_scan(chunk, layout, *shapes, q, init, self.chunk_size)
        return segment_scan(gdn_step(q, k, v, beta, g, self.dk**-0.5), layout, *shapes, q, init)


class Mamba2(nn.Module):
    """Mamba2 mixer with ``fla.layers.Mamba2``'s parameters (see module docs)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int = 64,
        state_size: int = 128,
        expand: int = 2,
        n_groups: int = 1,
        conv_kernel: int = 4,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        norm_eps: float = 1e-5,
        dt_limit=(0.0, float("inf")),
        A_init_range=(1, 16),
        num_heads: Optional[int] = None,
    ) -> None:
        super().__init__()
        I = int(expand * hidden_size)
        if I % head_dim:
            raise ValueError(f"expand * hidden_size ({I}) must be a multiple of head_dim ({head_dim})")
        self.H = num_heads or I // head_dim
        if self.H * head_dim != I:
            raise ValueError(f"num_heads * head_dim must equal expand * hidden_size ({I})")
        if self.H % n_groups:
            raise ValueError(f"num_heads ({self.H}) must be a multiple of n_groups ({n_groups})")
        self.I, self.P, self.N, self.G, self.K = I, head_dim, state_size, n_groups, conv_kernel
        self.conv_dim = I + 2 * n_groups * state_size
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.norm_eps, self.dt_limit = norm_eps, tuple(float(v) for v in dt_limit)
        self.A_init_range = A_init_range
        self.conv_size = conv_kernel
        self.backend = "torch"
        self.chunk_size = 64  # torch backend: tokens per block of the chunked scan (1: step by step)
        self.dt_bias = nn.Parameter(_inv_softplus_dt(self.H))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.H).uniform_(*A_init_range)))
        self.D = nn.Parameter(torch.ones(I if D_has_hdim else self.H))
        self.conv1d = ShortConv(self.conv_dim, conv_kernel, use_conv_bias)
        self.in_proj = nn.Linear(hidden_size, I + self.conv_dim + self.H, bias=use_bias)
        if rmsnorm:
            self.norm = _Norm(I)
        self.out_proj = nn.Linear(I, hidden_size, bias=use_bias)

    def reset_tree_parameters(self, std: float) -> None:
        with torch.no_grad():
            self.dt_bias.copy_(_inv_softplus_dt(self.H))
            self.A_log.copy_(torch.log(torch.empty(self.H).uniform_(*self.A_init_range)))
            nn.init.ones_(self.D)
            if self.rmsnorm:
                nn.init.ones_(self.norm.weight)

    def forward(self, x: torch.Tensor, layer: int, ctx) -> torch.Tensor:
        B, L, _ = x.shape
        xf = x.reshape(B * L, -1)
        T = xf.shape[0]
        layout = ctx.recurrent_layout(self.K, B, L, x.device)
        z, xBC_pre, dt = torch.split(self.in_proj(xf), [self.I, self.conv_dim, self.H], dim=-1)
        given, context = ctx.recurrent_conv_inputs(layer, self.K, {"conv_xBC": xBC_pre})
        xBC_pre = given["conv_xBC"]
        xBC = self.conv1d(xBC_pre, layout, context["conv_xBC"])
        xs, Bm, Cm = torch.split(xBC, [self.I, self.G * self.N, self.G * self.N], dim=-1)
        xs = xs.view(T, self.H, self.P)
        rep = self.H // self.G  # head h uses group h // (H/G)
        Bh = Bm.view(T, self.G, self.N).repeat_interleave(rep, 1)
        Ch = Cm.view(T, self.G, self.N).repeat_interleave(rep, 1)
        dt = F.softplus(dt + self.dt_bias.to(xf.dtype)).clamp(*self.dt_limit)
        A = -torch.exp(self.A_log.to(xf.dtype))
        D = self.D.to(xf.dtype).view(self.H, self.P) if self.D_has_hdim else self.D.to(xf.dtype)
        y, cap = ctx.recurrent_scan(layer, lambda init: self._scan(xs, dt, A, Bh, Ch, D, layout, init),
                                    (self.H, self.P, self.N), xs)
        if ctx.captures_recurrent:
            toks = torch.from_numpy(layout.capture).to(xf.device)
            ctx.record_recurrent(layer, {"state": cap, "conv_xBC": self.conv1d.context_at(xBC_pre, layout, context["conv_xBC"], toks)})
        y = y.reshape(T, self.I)
        if self.rmsnorm:
            if not self.norm_before_gate:
                y = y * F.silu(z)
            yg = y.view(T, self.G, self.I // self.G)
            y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.norm_eps)).reshape(T, self.I)
            y = y * self.norm.weight.to(y.dtype)
            if self.norm_before_gate:
                y = y * F.silu(z)
        else:
            y = y * F.silu(z)
        return self.out_proj(y).view(B, L, -1)

    def _scan(self, xs, dt, A, Bh, Ch, D, layout, init):
        if self.backend == "fla":
            return ssd_scan_fla(xs, dt, A, Bh, Ch, D, layout, init)
        shapes = (self.H, self.P, self.N), (self.H, self.P)
        if self.chunk_size > 1:
            return chunked_scan(ssd_chunk(xs, dt, A, Bh, Ch, D), layout, *shapes, xs, init, self.chunk_size)
        return segment_scan(ssd_step(xs, dt, A, Bh, Ch, D), layout, *shapes, xs, init)


class RecurrentBlock(nn.Module):
    """Pre-norm residual block around a recurrent mixer, optionally followed by a gated MLP:
    ``h += mixer(norm(h)); h += mlp(mlp_norm(h))`` (GDN models) or just the first (Mamba2)."""

    def __init__(self, norm: nn.Module, mixer: nn.Module, mlp_norm: Optional[nn.Module] = None, mlp: Optional[nn.Module] = None):
        super().__init__()
        self.sa_norm = norm
        self.mixer = mixer
        self.mlp_norm = mlp_norm
        self.mlp = mlp

    def tree_forward(self, h: torch.Tensor, layer: int, ctx) -> torch.Tensor:

        h = h + self.mixer(rms_norm(self.sa_norm, h), layer, ctx)
        if self.mlp is not None:
            h = h + self.mlp(rms_norm(self.mlp_norm, h))
        return h


def build_recurrent_layer(config, kind: str, index: int) -> RecurrentBlock:
    """A GDN or Mamba2 block for layer ``index`` of a :class:`~treelit.models.config.DecoderConfig`."""
    from torchtune.modules import FeedForward, RMSNorm  # heavy (loads torchao, datasets): only where a model is built

    opts = dict((config.recurrent or {}).get(kind, {}))
    mlp_opt = opts.pop("mlp", kind == "gdn")
    D = config.embed_dim
    if kind == "gdn":
        mixer = GatedDeltaNet(D, norm_eps=opts.pop("norm_eps", config.norm_eps), **opts)
    elif kind == "mamba2":
        mixer = Mamba2(D, norm_eps=opts.pop("norm_eps", config.norm_eps), **opts)
    else:
        raise ValueError(f"unknown recurrent layer type {kind!r}")
    mlp = mlp_norm = None
    if mlp_opt:
        mlp_norm = RMSNorm(D, eps=config.norm_eps)
        mlp = FeedForward(
            gate_proj=nn.Linear(D, config.intermediate_dim, bias=False),
            down_proj=nn.Linear(config.intermediate_dim, D, bias=False),
            up_proj=nn.Linear(D, config.intermediate_dim, bias=False),
        )
    return RecurrentBlock(RMSNorm(D, eps=config.norm_eps), mixer, mlp_norm, mlp)
