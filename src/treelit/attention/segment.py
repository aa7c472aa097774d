"""``segment``: exact tree attention at the cost of sum over segments of (length x path).

A dense ancestor mask makes a wide tree more expensive than its branches: sixteen
1,024-token branches under a 512-token prefix pack into 8,704 tree tokens, and a
dense mask over them costs about 4.5x the attention of the sixteen causal branches.
The optimal exact cost is the sum over segments of (segment length x length of its
root-to-segment path), because a segment's queries see exactly that path.

This backend computes exactly that, with no N x N tensor anywhere.

*Chains.* In DFS order a segment's first child starts right where the segment ends,
so a segment followed by its first child, its first grandchild, ... is one
contiguous run of the row that is a single path: a *chain*. Every token belongs to
exactly one chain. (treelit orders children heaviest-first, so the longest paths
are single chains.) A chain's queries see two key sets: its *prefix* (the chain's
ancestors, plus visible external keys), visible to all of them, and the chain
itself, causally. The two parts are computed separately on the fastest kernels (no
mask, and ``is_causal``) and merged through their log-sum-exps
(:mod:`treelit.attention.merged`). Long chains read their queries and own keys as
slices of the row; only prefixes are gathered.

*Prefix units.* A chain with a prefix belongs to a *unit*: the chains that share that
prefix (the branches of a fan-out, at most 1.5x apart in padded causal work), or the
chain alone. A unit's queries, concatenated, attend to its prefix in one pass, never
to a copy of the prefix per chain; each chain attends to itself causally.

*Batching across units.* Units of similar shape (the sibling groups under the different
parents of one tree level, the short chains under different prefixes) run together: one
call for their prefix parts (``[units, H, A, D]`` queries against ``[units, Hkv, P, D]``
prefixes, padded keys hidden by a ``[units, 1, 1, P]`` bias, padded query slots reading a
real query and answering for a dummy row) and one padded causal call for all their chains
(padded keys come after every real query, so causality hides them); the two parts merge by
log-sum-exp. Units join a bucket, largest prefixes first, while its padded work stays
within 1.1x its real work, so the number of calls follows the tree's depth and the spread
of its shapes, not its number of segments
(a GRPO group: its first chain plus one batched group; a 3-level tree of 27 leaves with
equal segment lengths: its first chain plus one group per level). A unit alone in its
bucket whose chains have equal lengths and follow each other in the row (a GRPO group's
completions) needs no padded slot: its queries, own keys and (when contiguous) prefix are
read as slices of the row, with no index and no slot mapping. Chains longer
than ``batch_below`` that have no siblings run alone on slices of the row; short chains
without a prefix (the roots of a packed row) are padded into groups of similar length.

*One node per layer, token-major.* A layer's attention is one autograd node
(:class:`_SegmentLayer`) that reads q, k and v as ``[tokens, heads, D]``, the layout the
projections wrote: slices of the row are views, gathers copy whole token rows, and the
kernels write their outputs token-major too. Each group's merged rows go straight to their
place in the output (which the output projection then reads without a copy); the backward
pass reads each part's output gradient, merged output and log-sum-exp from the row and adds
every part's gradients into one buffer per tensor. Padded slots read a dummy row (zero
gradient, log-sum-exp +inf: probability exactly 0), so nothing is zero-filled, padded or
reordered per group. (Before, each read was a copy in head-major order, every group's
output was gathered to slot order, concatenated and reordered, and the backward padded the
gradient, output and log-sum-exp of each part into zeroed buffers: 28% of the 27-leaf agent
tree's attention time outside the kernels.)

*Half precision.* For bfloat16 / float16 inputs the parts' log-sum-exps are float32, the
merge of a prefix part and its chains' causal part runs in float32 and the merged rows are
rounded once; in the backward pass every part's q, k, v gradients are summed into float32
buffers (a shared ancestor's keys receive one per group that reads them) and rounded once.
On CUDA the parts themselves compute in float32 (:mod:`treelit.attention.merged`).

*Irregular externals.* External keys visible to only part of a chain (not produced
by treelit's partitioner) fall back to explicitly masked blocks.

*Sliding windows.* A windowed layer (query sees the ancestors less than ``window``
positions above it) gets its own plan. A chain's queries are cut into blocks of at most
``window_block`` tokens; a block reads only the path keys that are within the window
of its first query (at most ``window_block + window - 1`` keys, the chain's own ones up
to its last query), under an explicit mask of visibility and distance. The work is
O(tokens x (block + window)) instead of O(tokens x path). A window that no pair of the
row can exceed is ignored (the layout says so), so long windows cost nothing extra.

The plan is built once per forward and shared by all layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from treelit.attention.base import ATTENTION, AttentionBackend
from treelit.attention.merged import _bwd, _fwd


@dataclass
class _Group:
    """Chains computed together. ``n`` chains padded to ``lq`` queries and ``lp`` prefix keys."""

    n: int
    lq: int
    lp: int
    q_slice: Optional[Tuple[int, int]] = None  # a single chain read as a slice [a, b)
    q_idx: Optional[torch.Tensor] = None  # [n * lq] query token per slot (batched groups)
    own_idx: Optional[torch.Tensor] = None  # [n * lq] own key (E + token) per slot
    pre_idx: Optional[torch.Tensor] = None  # [n * lp] prefix key per slot
    pre_bias: Optional[torch.Tensor] = None  # [n, 1, 1, lp] bool: real prefix keys
    keep: Optional[torch.Tensor] = None  # real query slots
    mask: Optional[torch.Tensor] = None  # irregular groups: [n, 1, lq, lp] bool over pre_idx keys
    # prefix units (one prefix call, one causal call): ``units`` units of at most ``la`` queries each
    # against their own ``lp`` prefix keys (q_idx [units * la], pre_idx [units * lp]), and
    # ``n`` chains padded to ``lq`` for their causal parts (qpad_idx, own_idx [n * lq])
    units: int = 0
    la: int = 0
    qpad_idx: Optional[torch.Tensor] = None
    pre_slots: Optional[torch.Tensor] = None  # [M] slot of each real query in units * la
    own_slots: Optional[torch.Tensor] = None  # [M] slot of each real query in n * lq
    # one unit of equal chains in row order: its queries are the row's tokens [a, b) in slot
    # order for both parts, read as slices; slots are the identity (None)
    q_range: Optional[Tuple[int, int]] = None
    pre_range: Optional[Tuple[int, int]] = None  # ... and its prefix the keys [a, b)

    @property
    def shared(self) -> bool:
        """One prefix call serves several chains (a unit of siblings)."""
        return self.units > 0 and self.n > self.units


@dataclass
class SegmentPlan:
    groups: List[_Group]
    order: Optional[torch.Tensor]  # concatenated group outputs -> row order (None: already in order)
    cost: int  # query x key pairs computed per head and layer (padding included)
    exact_cost: int  # visible pairs: sum over queries of the keys they see
    chains: int
    _works: Optional[tuple] = None  # ((N, E), the groups as _Work), built on first use


@dataclass
class _Part:
    """One kernel call of a group: ``n`` rows of ``lq`` query slots against ``lk`` keys each.

    ``q``: the row token each slot reads (padded slots read any real token); ``rows``: the
    row token each slot answers for, ``N`` (the dummy row) for padded slots; ``k``: the key
    (E-offset) each key slot reads. Each is a range ``(a, b)`` (a slice of the row, nothing
    gathered) or an index tensor. ``bias``: a bool mask of visible keys broadcastable to
    ``[n, 1, lq, lk]`` (None: all visible, or causal)."""

    n: int
    lq: int
    lk: int
    q: object
    rows: object
    k: object
    causal: bool
    bias: Optional[torch.Tensor] = None
    _bias: Optional[Dict[torch.dtype, torch.Tensor]] = None

    def bias_for(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if self.bias is None:
            return None
        if self._bias is None:
            self._bias = {}
        if dtype not in self._bias:
            zero = torch.zeros((), dtype=dtype, device=self.bias.device)
            self._bias[dtype] = torch.where(self.bias, zero, torch.finfo(dtype).min)
        return self._bias[dtype]


@dataclass
class _Work:
    """A group as the layer function runs it: the ``own`` part (its slots are the group's
    output slots) and, for chains with a prefix, the ``pre`` part, merged into ``own``'s slots
    through their log-sum-exps (``pre_of_own``: the ``pre`` slot of each ``own`` slot, None
    when the two parts have the same slots)."""

    own: _Part
    pre: Optional[_Part] = None
    pre_of_own: Optional[torch.Tensor] = None


def _works(groups: List[_Group], N: int, E: int, dev) -> List[_Work]:
    """The plan's groups as :class:`_Work` for a row of ``N`` queries and ``E`` external keys."""
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dev)  # noqa: E731
    works: List[_Work] = []
    for g in groups:
        if g.units:
            if g.q_range is not None:  # one unit of equal chains in row order: all slices
                a, b = g.q_range
                own = _Part(g.n, g.lq, g.lq, (a, b), (a, b), (E + a, E + b), True)
                pre = _Part(1, g.la, g.lp, (a, b), (a, b), g.pre_range if g.pre_range is not None else g.pre_idx, False)
                works.append(_Work(own, pre))
                continue
            q_pre, q_own = g.q_idx.cpu().numpy(), g.qpad_idx.cpu().numpy()  # N: a padded slot
            pre_of_own = np.zeros(g.n * g.lq, dtype=np.int64)
            pre_of_own[g.own_slots.cpu().numpy()] = g.pre_slots.cpu().numpy()
            own = _Part(g.n, g.lq, g.lq, t(np.where(q_own == N, 0, q_own)), t(q_own), g.own_idx, True)
            pre = _Part(g.units, g.la, g.lp, t(np.where(q_pre == N, 0, q_pre)), t(q_pre), g.pre_idx, False, g.pre_bias)
            works.append(_Work(own, pre, t(pre_of_own)))
            continue
        if g.q_slice is not None and g.mask is None:  # one chain on slices of the row
            a, b = g.q_slice
            own = _Part(1, g.lq, g.lq, (a, b), (a, b), (E + a, E + b), True)
            pre = None if g.pre_idx is None else _Part(1, g.lq, g.lp, (a, b), (a, b), g.pre_idx, False)
            works.append(_Work(own, pre))
            continue
        q = g.q_idx.cpu().numpy()
        rows = np.full(g.n * g.lq, N, dtype=np.int64)
        keep = np.arange(g.n * g.lq) if g.keep is None else g.keep.cpu().numpy()
        rows[keep] = q[keep]
        rows = t(rows)
        if g.mask is not None:  # explicit masks over gathered keys
            works.append(_Work(_Part(g.n, g.lq, g.lp, g.q_idx, rows, g.pre_idx, False, g.mask)))
            continue
        own = _Part(g.n, g.lq, g.lq, g.q_idx, rows, g.own_idx, True)
        pre = None if g.pre_idx is None else _Part(g.n, g.lq, g.lp, g.q_idx, rows, g.pre_idx, False, g.pre_bias)
        works.append(_Work(own, pre))
    return works


def _take(src: torch.Tensor, idx) -> torch.Tensor:
    """Rows of a token-major ``[tokens, ...]`` tensor: a slice (a view) or a gather."""
    if isinstance(idx, tuple):
        return src[idx[0] : idx[1]]
    return src.index_select(0, idx)


def _add_into(buf: torch.Tensor, idx, x: torch.Tensor) -> None:
    x = x.to(buf.dtype)  # a half part's gradient into a float32 buffer
    if isinstance(idx, tuple):
        buf[idx[0] : idx[1]].add_(x)
    else:
        buf.index_add_(0, idx, x)


def _heads_first(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """Token-major ``[n * length, H, D]`` -> ``[n, H, length, D]`` (a view)."""
    return x.view(n, length, *x.shape[1:]).transpose(1, 2)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, length, ...]`` -> token-major ``[n * length, H, ...]`` (a view when the kernel
    wrote it token-major, as the CPU kernels do)."""
    x = x.transpose(1, 2)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


class _SegmentLayer(torch.autograd.Function):
    """One layer's tree attention in one autograd node, token-major throughout.

    ``q [1, H, N, D]``, ``k, v [1, Hkv, E + N, D]`` are read as ``[tokens, heads, D]`` (the
    layout the projections wrote): slices of the row are views, gathers copy whole token rows.
    Each group's parts run on the kernels (which also write token-major), a prefix part merges
    into its chains' slots by log-sum-exp, and the merged rows go straight to their place in
    the output, whose token-major layout the output projection reads without a copy. The
    backward pass reads the output gradient, merged output and log-sum-exp of each part's
    slots from the row (padded slots read a dummy row: zero gradient, log-sum-exp +inf, so
    their probabilities are exactly 0) and adds every part's gradients into one buffer per
    tensor. Nothing is padded, zero-filled or reordered per group."""

    @staticmethod
    def forward(ctx, q, k, v, works):
        Q, K, V = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
        N, H, D = Q.shape
        out = Q.new_empty(N + 1, H, D)  # row N: the dummy row of padded slots
        lse = None
        for w in works:
            parts = [w.own] if w.pre is None else [w.own, w.pre]
            res = []
            taken: Dict[int, torch.Tensor] = {}  # the parts of a group often read the same queries
            for p in parts:
                if id(p.q) not in taken:
                    taken[id(p.q)] = _take(Q, p.q)
                qp = _heads_first(taken[id(p.q)], p.n, p.lq)
                kp, vp = (_heads_first(_take(X, p.k), p.n, p.lk) for X in (K, V))
                o, l = _fwd(qp, kp, vp, p.causal, p.bias_for(q.dtype))
                res.append((_tokens_first(o), _tokens_first(l)))
            o, l = res[0]
            if lse is None:
                lse = l.new_empty(N + 1, H)
            if w.pre is not None:
                o_a, l_a = res[1]
                if w.pre_of_own is not None:
                    o_a, l_a = o_a.index_select(0, w.pre_of_own), l_a.index_select(0, w.pre_of_own)
                joint = torch.logaddexp(l_a, l)
                weight = torch.exp(l_a - joint).unsqueeze(-1)
                # half inputs: float32 log-sum-exps (and, on the math path, float32 outputs)
                o = torch.lerp(o.to(weight.dtype), o_a.to(weight.dtype), weight)
                l = joint
            o = o.to(out.dtype)  # half inputs: rounded once, after the merge
            if isinstance(w.own.rows, tuple):
                a, b = w.own.rows
                out[a:b].copy_(o)
                lse[a:b].copy_(l)
            else:
                out.index_copy_(0, w.own.rows, o)
                lse.index_copy_(0, w.own.rows, l)
        out[N].zero_()
        lse[N].fill_(float("inf"))
        # q, k and v themselves are kept, not the parts' gathered rows: a gather copies (a prefix's
        # rows once per group that reads them), and the backward gathers each part again in turn
        ctx.works, ctx.shapes = works, (q.shape, k.shape, v.shape)
        result = out[:N].transpose(0, 1).unsqueeze(0)
        # the output itself is saved, not ``out`` (a saved intermediate that the output is a view of
        # cannot be traced by torch.compile); the backward appends the dummy row again
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, result, lse = ctx.saved_tensors
        Q, K, V = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
        qs, ks, vs = ctx.shapes
        G = torch.cat([grad[0].transpose(0, 1), grad.new_zeros(1, qs[1], qs[3])])  # row N: zero gradient
        out = torch.cat([result[0].transpose(0, 1), result.new_zeros(1, qs[1], qs[3])])  # row N: the dummy row
        acc = torch.float32 if G.dtype in (torch.float16, torch.bfloat16) else G.dtype  # parts summed in float32
        dQ = G.new_zeros(qs[2] + 1, qs[1], qs[3], dtype=acc)
        dK = G.new_zeros(ks[2], ks[1], ks[3], dtype=acc)
        dV = G.new_zeros(vs[2], vs[1], vs[3], dtype=acc)
        lse = lse.unsqueeze(-1)
        for w in ctx.works:
            taken: Dict[int, tuple] = {}
            queries: Dict[int, torch.Tensor] = {}
            for p in [w.own] if w.pre is None else [w.own, w.pre]:
                if id(p.q) not in queries:
                    queries[id(p.q)] = _take(Q, p.q)
                qp = _heads_first(queries[id(p.q)], p.n, p.lq)
                kp, vp = (_heads_first(_take(X, p.k), p.n, p.lk) for X in (K, V))
                if id(p.rows) not in taken:
                    taken[id(p.rows)] = tuple(_take(X, p.rows) for X in (G, out, lse))
                g, o, l = (_heads_first(x, p.n, p.lq) for x in taken[id(p.rows)])
                dq, dk, dv = _bwd(g, qp, kp, vp, o, l[..., 0], p.causal, p.bias_for(qp.dtype))
                _add_into(dQ, p.rows, _tokens_first(dq))
                _add_into(dK, p.k, _tokens_first(dk))
                _add_into(dV, p.k, _tokens_first(dv))
        dt = grad.dtype
        return (dQ[: qs[2]].to(dt).transpose(0, 1).unsqueeze(0), dK.to(dt).transpose(0, 1).unsqueeze(0),
                dV.to(dt).transpose(0, 1).unsqueeze(0), None)


BUCKET_WASTE = 1.1  # default bound on a batched call's padded work over its real work


def _round_up(n: int, minimum: int = 8) -> int:
    """Round up with at most ~12.5% padding (8 bins per power of two)."""
    if n <= minimum:
        return minimum
    g = 1 << max(0, int(math.floor(math.log2(n))) - 3)
    return int(math.ceil(n / g) * g)


@ATTENTION.register("segment")
class SegmentAttention(AttentionBackend):
    """Exact tree attention over segment chains (no N x N tensors).

    Args:
        batch_below: chains of at most this many tokens are batched with similar ones;
            longer chains without siblings run one by one on slices of the row.
        share_prefixes: sibling chains with the same prefix attend to it in one call
            (otherwise every chain is a unit of its own; units are still batched).
        bucket_waste: prefix units share a padded call while its padded work stays within
            this factor of their real work (>= 1; 1: only units of one shape share a call).
    """

    name = "segment"

    def __init__(self, batch_below: int = 256, share_prefixes: bool = True, window_block: int = 128,
                 bucket_waste: float = BUCKET_WASTE) -> None:
        if batch_below < 0:
            raise ValueError(f"segment attention batch_below must be >= 0, got {batch_below}")
        if window_block < 1:
            raise ValueError(f"segment attention window_block must be >= 1, got {window_block}")
        if not bucket_waste >= 1.0:
            raise ValueError(f"segment attention bucket_waste must be >= 1, got {bucket_waste}")
        self.bucket_waste = float(bucket_waste)
        self.batch_below = int(batch_below)
        self.share_prefixes = bool(share_prefixes)
        self.window_block = int(window_block)

    def __repr__(self) -> str:
        return (f"SegmentAttention(batch_below={self.batch_below}, share_prefixes={self.share_prefixes}, "
                f"window_block={self.window_block}, bucket_waste={self.bucket_waste})")

    # planning ------------------------------------------------------------------------
    def plan(self, layout) -> SegmentPlan:
        if layout.window is not None:
            return self._plan_windowed(layout)
        batch = layout.batch
        dev = layout.kv_lo.device
        E = layout.num_external
        kv_lo = layout.kv_lo.cpu().numpy()
        kv_hi = layout.kv_hi.cpu().numpy()
        ext_lo, ext_hi = kv_lo[:E], kv_hi[:E]
        chains, ancestors = _chains(batch, E)

        single: List[_Group] = []
        small: Dict[Tuple[int, int, bool], List[Tuple[int, int, np.ndarray]]] = {}
        by_prefix: Dict[bytes, List[Tuple[int, int, np.ndarray]]] = {}
        loose: List[Tuple[int, int, np.ndarray]] = []
        irregular: List[Tuple[int, int, np.ndarray]] = []
        rows: List[np.ndarray] = []
        exact = cost = 0
        for first, a, b in chains:
            pre = ancestors(first)
            if E:
                touches = (ext_lo < b) & (ext_hi > a)
                partial = bool((touches & ~((ext_lo <= a) & (ext_hi >= b))).any())
                pre = np.concatenate([np.flatnonzero(touches).astype(np.int64), pre])
                if partial:
                    irregular.append((a, b, pre))
                    continue
            exact += (b - a) * len(pre) + (b - a) * (b - a + 1) // 2
            if len(pre) and self.share_prefixes:
                by_prefix.setdefault(pre.tobytes(), []).append((a, b, pre))
            else:
                loose.append((a, b, pre))
        units: List[list] = []  # chains sharing one prefix (siblings, or one chain alone)
        for siblings in by_prefix.values():
            for members in _similar_lengths(siblings):
                if len(members) >= 2:  # siblings: one prefix call for all their queries
                    units.append(members)
                else:
                    loose.extend(members)
        for a, b, pre in loose:
            lq, lp = b - a, len(pre)
            if lq > self.batch_below:
                single.append(_Group(1, lq, lp, q_slice=(a, b), pre_idx=torch.from_numpy(pre).to(dev) if lp else None))
                rows.append(np.arange(a, b))
                cost += lq * lp + lq * (lq + 1) // 2
            elif lp:
                units.append([(a, b, pre)])
            else:
                small.setdefault((_round_up(lq), 0, False), []).append((a, b, pre))
        groups: List[_Group] = list(single)
        for bucket in _bucket_units(units, self.bucket_waste):
            g, r, c = _batched_group(bucket, E, batch.num_tokens, dev)
            groups.append(g)
            rows.append(r)
            cost += c
        for (lq, lp, _), members in sorted(small.items()):
            g, r = _padded_group(members, lq, lp, E, dev)
            groups.append(g)
            rows.append(r)
            cost += g.n * (lq * lp + lq * (lq + 1) // 2)
        if irregular:
            units = [(a, b, np.concatenate([pre, np.arange(a, b, dtype=np.int64) + E])) for a, b, pre in irregular]
            g, r, pairs = _masked_group(units, kv_lo, kv_hi, dev)
            groups.append(g)
            rows.append(r)
            cost += g.n * g.lq * g.lp
            exact += pairs
        return SegmentPlan(groups, _order(rows, dev), cost, exact, len(chains))

    def _plan_windowed(self, layout) -> SegmentPlan:
        """Blocks of each chain's queries against the path keys within the window (see the
        module docstring), in masked groups of similar padded size."""
        batch, w, bs = layout.batch, int(layout.window), self.window_block
        dev = layout.kv_lo.device
        E = layout.num_external
        kv_lo, kv_hi = layout.kv_lo.cpu().numpy(), layout.kv_hi.cpu().numpy()
        kv_pos, q_pos = layout.kv_pos.cpu().numpy(), layout.q_pos.cpu().numpy()
        chains, ancestors = _chains(batch, E)
        by_size: Dict[Tuple[int, int], list] = {}
        for first, a, b in chains:
            pre = ancestors(first)
            if E:  # external keys that any query of the chain may see
                touches = (kv_lo[:E] < b) & (kv_hi[:E] > a)
                pre = np.concatenate([np.flatnonzero(touches).astype(np.int64), pre])
            path = np.concatenate([pre, np.arange(a, b, dtype=np.int64) + E])
            for qa in range(a, b, bs):
                qb = min(qa + bs, b)
                keys = path[: len(pre) + (qb - a)]
                keys = keys[kv_pos[keys] > q_pos[qa] - w]  # older keys are out of every query's window
                by_size.setdefault((_round_up(qb - qa), _round_up(len(keys))), []).append((qa, qb, keys))
        groups: List[_Group] = []
        rows: List[np.ndarray] = []
        cost = exact = 0
        for _, units in sorted(by_size.items()):
            g, r, pairs = _masked_group(units, kv_lo, kv_hi, dev, q_pos=q_pos, kv_pos=kv_pos, window=w)
            groups.append(g)
            rows.append(r)
            cost += g.n * g.lq * g.lp
            exact += pairs
        return SegmentPlan(groups, _order(rows, dev), cost, exact, len(chains))

    # compute -------------------------------------------------------------------------
    def __call__(self, q, k, v, plan: SegmentPlan):
        N, E = q.shape[2], k.shape[2] - q.shape[2]
        if plan._works is None or plan._works[0] != (N, E):
            plan._works = ((N, E), _works(plan.groups, N, E, q.device))
        return _SegmentLayer.apply(q, k, v, plan._works[1])


def _padded_group(members, lq: int, lp: int, E: int, dev) -> Tuple[_Group, np.ndarray]:
    n = len(members)
    q_idx = np.zeros((n, lq), dtype=np.int64)
    own_idx = np.zeros((n, lq), dtype=np.int64)
    q_valid = np.zeros((n, lq), dtype=bool)
    pre_idx = np.zeros((n, max(lp, 1)), dtype=np.int64)
    pre_valid = np.zeros((n, max(lp, 1)), dtype=bool)
    for r, (a, b, pre) in enumerate(members):
        q_idx[r, : b - a] = np.arange(a, b)
        own_idx[r, : b - a] = np.arange(a, b) + E
        q_valid[r, : b - a] = True
        pre_idx[r, : len(pre)] = pre
        pre_valid[r, : len(pre)] = True
    keep = np.flatnonzero(q_valid.reshape(-1))
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dev)  # noqa: E731
    group = _Group(
        n,
        lq,
        lp,
        q_idx=t(q_idx.reshape(-1)),
        own_idx=t(own_idx.reshape(-1)),
        pre_idx=t(pre_idx.reshape(-1)) if lp else None,
        pre_bias=(t(pre_valid[:, None, None, :]) if lp and not pre_valid.all() else None),
        keep=None if q_valid.all() else t(keep),
    )
    return group, q_idx.reshape(-1)[keep]


def _similar_lengths(members, waste: float = 1.5):
    """Split siblings (longest first) into runs whose padded causal cost stays within
    ``waste`` times their real causal cost, so one long sibling does not pad many short ones."""
    members = sorted(members, key=lambda m: m[0] - m[1])
    runs: List[list] = []
    run: list = []
    real = 0
    for m in members:
        lq = m[1] - m[0]
        top = (run[0][1] - run[0][0]) if run else lq
        if run and (len(run) + 1) * top * (top + 1) > waste * (real + lq * (lq + 1)):
            runs.append(run)
            run, real = [], 0
        run.append(m)
        real += lq * (lq + 1)
    if run:
        runs.append(run)
    return runs


def _bucket_units(units, waste: float = BUCKET_WASTE):
    """Prefix units (lists of chains ``(a, b, prefix)`` sharing the prefix) in buckets, one
    batched call each: largest prefixes first, a unit joins the current bucket while the
    bucket's padded work (prefix part and causal part) stays within ``waste`` times its real
    work. Units of the same shape (the sibling groups of one tree level) share a bucket, so
    the number of calls follows the tree's depth rather than its number of segments. With
    a bound of 1.5, the step benchmark's agent trees computed 11-24% more (query, key) pairs
    than their queries see; with 1.1, 1-3%, in 7-9 calls per layer instead of 3-4."""
    def shape(u):
        lens = [b - a for a, b, _ in u]
        return sum(lens), len(u[0][2]), lens

    items = sorted((shape(u) + (u,) for u in units), key=lambda x: (-x[1], -x[0]))
    buckets: List[list] = []
    cur: list = []
    real = A = P = L = C = 0
    for a_len, p_len, lens, u in items:
        r = a_len * p_len + sum(n * (n + 1) // 2 for n in lens)
        nA, nP, nL, nC = max(A, a_len), max(P, p_len), max([L] + lens), C + len(lens)
        padded = (len(cur) + 1) * nA * nP + nC * nL * (nL + 1) // 2
        if cur and padded > waste * (real + r):
            buckets.append(cur)
            cur, real, nA, nP, nL, nC = [], 0, a_len, p_len, max(lens), len(lens)
        cur.append(u)
        real, A, P, L, C = real + r, nA, nP, nL, nC
    if cur:
        buckets.append(cur)
    return buckets


def _batched_group(units, E: int, N: int, dev) -> Tuple[_Group, np.ndarray, int]:
    """One bucket of prefix units: each unit's concatenated queries (padded to A, padding
    reads the zero query N) against its prefix (padded to P, hidden by the bias), and every
    chain padded to L for its causal part (padded keys after each chain's tokens)."""
    chains = [m for u in units for m in u]
    G, C = len(units), len(chains)
    A = max(sum(b - a for a, b, _ in u) for u in units)
    P = max(len(u[0][2]) for u in units)
    L = max(b - a for a, b, _ in chains)
    q_pre = np.full((G, A), N, dtype=np.int64)  # N: the zero query
    pre = np.zeros((G, P), dtype=np.int64)
    pre_valid = np.zeros((G, P), dtype=bool)
    q_own = np.full((C, L), N, dtype=np.int64)
    own = np.zeros((C, L), dtype=np.int64)
    pre_slots, own_slots, rows = [], [], []
    c = 0
    for u_i, u in enumerate(units):
        p = u[0][2]
        pre[u_i, : len(p)], pre[u_i, len(p):] = p, p[0]
        pre_valid[u_i, : len(p)] = True
        t = 0
        for a, b, _ in u:
            n = b - a
            q_pre[u_i, t : t + n] = np.arange(a, b)
            q_own[c, :n] = np.arange(a, b)
            own[c, :n], own[c, n:] = np.arange(a, b) + E, b - 1 + E  # padded keys: never seen by real queries
            pre_slots.append(u_i * A + t + np.arange(n))
            own_slots.append(c * L + np.arange(n))
            rows.append(np.arange(a, b))
            t += n
            c += 1
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dev)  # noqa: E731
    cost = G * A * P + C * L * (L + 1) // 2
    q_flat = q_pre.reshape(-1)
    a0 = int(q_flat[0])
    if (G == 1 and a0 + A <= N and np.array_equal(q_flat, np.arange(a0, a0 + A))  # N: the zero query
            and np.array_equal(q_own.reshape(-1), q_flat)):
        # one unit of equal chains in row order (a GRPO group): slices of the row, no padded slot
        p0 = int(pre[0, 0])
        pre_range = (p0, p0 + P) if np.array_equal(pre[0], np.arange(p0, p0 + P)) else None
        group = _Group(C, L, P, pre_idx=None if pre_range else t(pre.reshape(-1)), units=1, la=A,
                       q_range=(a0, a0 + A), pre_range=pre_range)
        return group, np.concatenate(rows), cost
    group = _Group(
        C, L, P, q_idx=t(q_flat), own_idx=t(own.reshape(-1)), pre_idx=t(pre.reshape(-1)),
        pre_bias=None if pre_valid.all() else t(pre_valid[:, None, None, :]),
        units=G, la=A, qpad_idx=t(q_own.reshape(-1)),
        pre_slots=t(np.concatenate(pre_slots)), own_slots=t(np.concatenate(own_slots)),
    )
    return group, np.concatenate(rows), cost


def _masked_group(units, kv_lo, kv_hi, dev, q_pos=None, kv_pos=None, window=None) -> Tuple[_Group, np.ndarray, int]:
    """Query runs ``(a, b, keys)`` padded into one batch, each (query, key) pair masked by the
    visibility intervals (and, with ``window``, by the position distance)."""
    n = len(units)
    lq = max(b - a for a, b, _ in units)
    lk = max(max(len(keys) for _, _, keys in units), 1)
    q_idx = np.zeros((n, lq), dtype=np.int64)
    k_idx = np.zeros((n, lk), dtype=np.int64)
    q_valid = np.zeros((n, lq), dtype=bool)
    k_valid = np.zeros((n, lk), dtype=bool)
    for r, (a, b, keys) in enumerate(units):
        q_idx[r, : b - a] = np.arange(a, b)
        q_valid[r, : b - a] = True
        k_idx[r, : len(keys)] = keys
        k_valid[r, : len(keys)] = True
    qpos = q_idx[:, :, None]
    mask = (kv_lo[k_idx][:, None, :] <= qpos) & (qpos < kv_hi[k_idx][:, None, :])
    if window is not None:
        mask &= (q_pos[q_idx][:, :, None] - kv_pos[k_idx][:, None, :]) < window
    mask &= q_valid[:, :, None] & k_valid[:, None, :]
    pairs = int(mask.sum())
    mask[:, :, 0] |= ~mask.any(-1)  # rows that see nothing (padding) attend to one key: finite, dropped
    keep = np.flatnonzero(q_valid.reshape(-1))
    group = _Group(
        n,
        lq,
        lk,
        q_idx=torch.from_numpy(q_idx.reshape(-1)).to(dev),
        pre_idx=torch.from_numpy(k_idx.reshape(-1)).to(dev),
        keep=torch.from_numpy(keep).to(dev),
        mask=torch.from_numpy(mask[:, None]).to(dev),
    )
    return group, q_idx.reshape(-1)[keep], pairs


def _chains(batch, E: int):
    """The row's chains ``(first segment, token start, token end)`` (runs of segments where each
    is the previous one's contiguous first child) and ``ancestors(first segment)``: the
    E-offset keys of a chain's ancestors in path order."""
    seg_start = batch.seg_start.cpu().numpy()
    seg_len = batch.seg_len.cpu().numpy()
    seg_parent = batch.seg_parent.cpu().numpy()
    chains: List[Tuple[int, int, int]] = []
    for s in range(len(seg_start)):
        p = seg_parent[s]
        if chains and p == s - 1 and seg_start[s] == seg_start[p] + seg_len[p]:
            first, a, _ = chains[-1]
            chains[-1] = (first, a, int(seg_start[s] + seg_len[s]))
        else:
            chains.append((s, int(seg_start[s]), int(seg_start[s] + seg_len[s])))
    anc: Dict[int, np.ndarray] = {}  # ancestor keys of segments that start chains (memoised)

    def ancestors(s: int) -> np.ndarray:
        if s in anc:
            return anc[s]
        out: List[np.ndarray] = []
        p = seg_parent[s]
        while p >= 0:
            out.append(np.arange(seg_start[p], seg_start[p] + seg_len[p], dtype=np.int64) + E)
            if p in anc:  # reuse a chain start's ancestors
                out.append(anc[p])
                break
            p = seg_parent[p]
        anc[s] = np.concatenate(out[::-1]) if out else np.zeros(0, dtype=np.int64)
        return anc[s]

    return chains, ancestors


def _order(rows: List[np.ndarray], dev) -> Optional[torch.Tensor]:
    """Concatenated group outputs -> row order (None when already in order)."""
    all_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    if np.array_equal(all_rows, np.arange(len(all_rows))):
        return None
    inv = np.empty_like(all_rows)
    inv[all_rows] = np.arange(len(all_rows))
    return torch.from_numpy(inv).to(dev)
