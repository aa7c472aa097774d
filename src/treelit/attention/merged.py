"""Attention over two key sets merged through their log-sum-exps.

For a query block whose keys split into a *prefix* (visible to every query: the
block's ancestors) and a *diagonal* block (the queries' own tokens, causal), the
attention over the union is

    o = (e^{l_A} o_A + e^{l_B} o_B) / (e^{l_A} + e^{l_B}),   l = log(e^{l_A} + e^{l_B})

where ``(o_A, l_A)`` and ``(o_B, l_B)`` are the two partial attentions and their
row log-sum-exps. Both parts then run on the fastest kernels (no mask for the
prefix, ``is_causal`` for the diagonal) instead of one masked call. The backward
pass of each part, given the *merged* output and log-sum-exp, yields exactly that
part's share of the gradients (the standard ring/split-attention identity).

On CPU the two parts use torch's flash-attention kernels, which return the
log-sum-exp; elsewhere a plain math implementation with the same contract is used
(CUDA trees normally take the ``flex`` backend instead).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // k.shape[1]
    return k if rep == 1 else k.repeat_interleave(rep, dim=1)


def _math_fwd(q, k, v, causal: bool, bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
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
    if q.device.type == "cpu":
        if _foldable(q, k, causal, bias):
            H, Hkv = q.shape[1], k.shape[1]
            o, lse = _cpu_fwd(_fold(q, Hkv), k, v, 0.0, False, attn_mask=bias)[:2]
            return _unfold(o, H), _unfold(lse, H)
        return _cpu_fwd(q, k, v, 0.0, causal, attn_mask=bias)[:2]
    return _math_fwd(q, k, v, causal, bias)


def _bwd(g, q, k, v, o, lse, causal, bias):
    if q.device.type == "cpu":
        if _foldable(q, k, causal, bias):
            H, Hkv = q.shape[1], k.shape[1]
            dq, dk, dv = _cpu_bwd(_fold(g, Hkv), _fold(q, Hkv), k, v, _fold(o, Hkv), _fold(lse, Hkv),
                                  0.0, False, attn_mask=bias)
            return _unfold(dq, H), dk, dv
        return _cpu_bwd(g, q, k, v, o, lse, 0.0, causal, attn_mask=bias)
    return _math_bwd(g, q, k, v, o, lse, causal, bias)


def _merge(o_a, l_a, o_b, l_b, lse) -> torch.Tensor:
    """Merge two partial attentions given the joint log-sum-exp. The log-sum-exps may be
    float32 for half-precision inputs (the CPU kernels keep them so); the merged output
    keeps the inputs' dtype, which the kernels' backward passes expect."""
    o = torch.exp(l_a - lse)[..., None] * o_a + torch.exp(l_b - lse)[..., None] * o_b
    return o.to(o_a.dtype)


class PrefixCausalAttention(torch.autograd.Function):
    """``softmax`` attention of ``q [B, H, L, D]`` over ``[prefix keys | own keys]``.

    ``k_pre, v_pre [B, Hkv, P, D]`` are visible to every query (``bias_pre``, broadcastable
    to ``[B, H, L, P]``, may hide padding keys); ``k_own, v_own [B, Hkv, L, D]`` are the
    queries' own tokens, visible causally. ``k_pre`` may be None (no prefix).
    """

    @staticmethod
    def forward(ctx, q, k_pre, v_pre, bias_pre, k_own, v_own):
        o_b, l_b = _fwd(q, k_own, v_own, True, None)
        if k_pre is None:
            o, lse = o_b, l_b
        else:
            o_a, l_a = _fwd(q, k_pre, v_pre, False, bias_pre)
            lse = torch.logaddexp(l_a, l_b)
            o = _merge(o_a, l_a, o_b, l_b, lse)
        ctx.save_for_backward(q, k_pre, v_pre, bias_pre, k_own, v_own, o, lse)
        return o

    @staticmethod
    def backward(ctx, g):
        q, k_pre, v_pre, bias_pre, k_own, v_own, o, lse = ctx.saved_tensors
        g = g.contiguous()
        dq, dk_own, dv_own = _bwd(g, q, k_own, v_own, o, lse, True, None)
        dk_pre = dv_pre = None
        if k_pre is not None:
            dq_a, dk_pre, dv_pre = _bwd(g, q, k_pre, v_pre, o, lse, False, bias_pre)
            dq = dq + dq_a
        return dq, dk_pre, dv_pre, None, dk_own, dv_own


def prefix_causal_attention(q, k_pre, v_pre, bias_pre, k_own, v_own) -> torch.Tensor:
    return PrefixCausalAttention.apply(q, k_pre, v_pre, bias_pre, k_own, v_own)


class BatchedPrefixAttention(torch.autograd.Function):
    """Chains of several prefix *units* in one pair of calls. A unit is a set of chains that
    share one prefix (sibling chains, or a single chain); each unit's queries, concatenated,
    attend to its prefix keys in *one* call for all units (padded, no per-chain copies of a
    prefix), every chain attends to itself causally in one padded batch, and the two parts
    merge through their log-sum-exps.

    ``q_pre [G, H, A, D]``: unit u's queries, concatenated and padded to A;
    ``k_pre, v_pre [G, Hkv, P, D]``: its prefix keys padded to P, hidden by ``bias_pre``
    (``[G, 1, 1, P]``, 0 / dtype min; None when nothing is padded); ``q_own [C, H, L, D]`` /
    ``k_own, v_own [C, Hkv, L, D]``: the chains padded to L (padding after each chain's tokens,
    so causality hides it from real queries); ``pre_slots`` / ``own_slots`` ``[M]``: the
    flattened ``G * A`` / ``C * L`` slot of each real query, or both None when no slot is padded
    and the two layouts hold the queries in the same order (``M = G * A = C * L``). Padded query
    slots must hold zero queries (their rows are then finite in the forward and contribute
    nothing in the backward). Returns ``[H, M, D]``, the real queries in slot order.
    """

    @staticmethod
    def forward(ctx, q_pre, k_pre, v_pre, bias_pre, q_own, k_own, v_own, pre_slots, own_slots):
        o_a, l_a = _fwd(q_pre, k_pre, v_pre, False, bias_pre)
        o_b, l_b = _fwd(q_own, k_own, v_own, True, None)
        H = q_pre.shape[1]

        def flat(t, slots):
            t = t.transpose(0, 1).reshape(H, -1, *t.shape[3:])
            return t if slots is None else t.index_select(1, slots)

        o_a, l_a, o_b, l_b = flat(o_a, pre_slots), flat(l_a, pre_slots), flat(o_b, own_slots), flat(l_b, own_slots)
        lse = torch.logaddexp(l_a, l_b)
        o = _merge(o_a, l_a, o_b, l_b, lse)
        ctx.save_for_backward(q_pre, k_pre, v_pre, bias_pre, q_own, k_own, v_own, pre_slots, own_slots, o, lse)
        return o

    @staticmethod
    def backward(ctx, g):
        q_pre, k_pre, v_pre, bias_pre, q_own, k_own, v_own, pre_slots, own_slots, o, lse = ctx.saved_tensors
        g = g.to(o.dtype)

        def padded(t, slots, like):  # real rows back into the padded layout, zeros elsewhere
            n, H, L = like.shape[:3]
            if slots is None:
                return t.view(H, n, L, *t.shape[2:]).transpose(0, 1).contiguous()
            full = t.new_zeros(H, n * L, *t.shape[2:])
            full.index_copy_(1, slots, t)
            return full.view(H, n, L, *t.shape[2:]).transpose(0, 1).contiguous()

        # zero queries with zero gradient, output and lse on padded slots: every term vanishes
        dq_pre, dk_pre, dv_pre = _bwd(padded(g, pre_slots, q_pre), q_pre, k_pre, v_pre,
                                      padded(o, pre_slots, q_pre), padded(lse, pre_slots, q_pre), False, bias_pre)
        dq_own, dk_own, dv_own = _bwd(padded(g, own_slots, q_own), q_own, k_own, v_own,
                                      padded(o, own_slots, q_own), padded(lse, own_slots, q_own), True, None)
        return dq_pre, dk_pre, dv_pre, None, dq_own, dk_own, dv_own, None, None
