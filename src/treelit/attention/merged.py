"""The attention kernels of one part of a split attention, with their log-sum-exps.

For a query block whose keys split into a *prefix* (visible to every query: the
block's ancestors) and a *diagonal* block (the queries' own tokens, causal), the
attention over the union is

    o = (e^{l_A} o_A + e^{l_B} o_B) / (e^{l_A} + e^{l_B}),   l = log(e^{l_A} + e^{l_B})

where ``(o_A, l_A)`` and ``(o_B, l_B)`` are the two partial attentions and their
row log-sum-exps. Both parts then run on the fastest kernels (no mask for the
prefix, ``is_causal`` for the diagonal) instead of one masked call. The backward
pass of each part, given the *merged* output and log-sum-exp, yields exactly that
part's share of the gradients (the standard ring/split-attention identity). The
``segment`` backend (:mod:`treelit.attention.segment`) runs its parts through
:func:`_fwd` / :func:`_bwd` and does the merge itself.

On CPU the two parts use torch's flash-attention kernels, which return the
log-sum-exp; elsewhere a plain math implementation with the same contract is used
(CUDA trees normally take the ``flex`` backend instead). ``MATH_ON_CPU = True`` (or the
environment variable ``TREELIT_SEGMENT_MATH=1`` at import) makes CPU tensors take the math
path too: that is how the CUDA code path is tested and its dispatches counted on CPU
(``benchmarks/bench_launches.py``).

*Half precision.* Flash and flex kernels read bfloat16 / float16 inputs but keep the
scores, the softmax and the accumulations in float32. The math path does the same by
upcasting: for half inputs it computes scores, ``exp(s - lse)`` and ``p @ v`` (and in the
backward pass every product) in float32 and returns float32 outputs, log-sum-exps and
gradients, so that the caller merges the parts and sums the gradients of every part in
float32 and rounds once. (Computed in the input dtype, the scores and probabilities were
rounded to bfloat16: gpu_check measured segment 1.7e-2..3.6e-2 against flex's
2.2e-3..2.6e-3.) float32 and float64 inputs are computed in their own dtype, as before.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch

MATH_ON_CPU = os.environ.get("TREELIT_SEGMENT_MATH", "") == "1"  # CPU tensors take the CUDA (math) path

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // k.shape[1]
    return k if rep == 1 else k.repeat_interleave(rep, dim=1)


_HALF = (torch.float16, torch.bfloat16)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """The tensor in the math path's working precision: float32 for half inputs."""
    return t.float() if t.dtype in _HALF else t


def _math_fwd(q, k, v, causal: bool, bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of one part, ``q [n, H, L, D]``, ``k, v [n, Hkv, S, D]``, ``bias`` additive
    (broadcast to ``[n, H, L, S]``). For half inputs both come back in float32."""
    q, k, v = _acc(q), _acc(k), _acc(v)
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if causal:
        L = q.shape[-2]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def _math_bwd(g, q, k, v, o, lse, causal: bool, bias: Optional[torch.Tensor]):
    """``(dq, dk, dv)`` of one part given the merged output ``o`` and log-sum-exp ``lse``; for
    half inputs computed and returned in float32."""
    g, q, k, v, o, lse = (_acc(t) for t in (g, q, k, v, o, lse))
    H, Hkv = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, H), _expand_kv(v, H)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ ke.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if causal:
        L = q.shape[-2]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-1, -2) @ g
    dp = g @ ve.transpose(-1, -2)
    ds = p * (dp - (g * o).sum(-1, keepdim=True))
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-1, -2) @ q) * scale
    if H != Hkv:
        rep = H // Hkv
        dk = dk.unflatten(1, (Hkv, rep)).sum(2)
        dv = dv.unflatten(1, (Hkv, rep)).sum(2)
    return dq, dk, dv


FOLD_BELOW = 256  # queries per head: at most this many, a grouped-query prefix part is folded


def _foldable(q, k, causal: bool, bias: Optional[torch.Tensor]) -> bool:
    """A prefix part (no causal mask, a bias that does not vary with the head or the query)
    with grouped query heads can run as ``Hkv`` heads of ``H / Hkv`` times the queries. It
    pays for short query blocks (the kernels' per-head work on the keys dominates there);
    long ones would only add the copies of the fold."""
    return (not causal and q.shape[1] != k.shape[1] and q.shape[2] <= FOLD_BELOW
            and (bias is None or (bias.dim() == 4 and bias.shape[1] == 1 and bias.shape[2] == 1)))


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, L, ...]`` -> ``[B, Hkv, (H / Hkv) * L, ...]``: query head ``h`` reads key/value
    head ``h // (H / Hkv)`` (grouped-query attention), so the heads of one group become one
    longer block of queries against that key/value head. For keys every query sees, this is
    the same attention; the CPU kernels then read each key/value block once per group instead
    of once per query head and need no reduction over the group in the backward pass."""
    B, H, L = t.shape[:3]
    return t.reshape(B, kv_heads, (H // kv_heads) * L, *t.shape[3:])


def _unfold(t: torch.Tensor, heads: int) -> torch.Tensor:
    B, Hkv, RL = t.shape[:3]
    return t.reshape(B, heads, RL * Hkv // heads, *t.shape[3:])


def _fwd(q, k, v, causal, bias):
    """``(o, lse)`` of one part: ``lse`` in float32 for half inputs, ``o`` in the input dtype
    (CPU kernels) or in float32 (the math path)."""
    if q.device.type == "cpu" and not MATH_ON_CPU:
        if _foldable(q, k, causal, bias):
            H, Hkv = q.shape[1], k.shape[1]
            o, lse = _cpu_fwd(_fold(q, Hkv), k, v, 0.0, False, attn_mask=bias)[:2]
            return _unfold(o, H), _unfold(lse, H)
        return _cpu_fwd(q, k, v, 0.0, causal, attn_mask=bias)[:2]
    return _math_fwd(q, k, v, causal, bias)


def _bwd(g, q, k, v, o, lse, causal, bias):
    """``(dq, dk, dv)`` of one part: in the input dtype (CPU kernels) or, for half inputs, in
    float32 (the math path)."""
    if q.device.type == "cpu" and not MATH_ON_CPU:
        if _foldable(q, k, causal, bias):
            H, Hkv = q.shape[1], k.shape[1]
            dq, dk, dv = _cpu_bwd(_fold(g, Hkv), _fold(q, Hkv), k, v, _fold(o, Hkv), _fold(lse, Hkv),
                                  0.0, False, attn_mask=bias)
            return _unfold(dq, H), dk, dv
        return _cpu_bwd(g, q, k, v, o, lse, 0.0, causal, attn_mask=bias)
    return _math_bwd(g, q, k, v, o, lse, causal, bias)
