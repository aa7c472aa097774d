"""Context parallelism's exchanges (:mod:`treelit.partition.context_parallel`): path rows,
recurrent states and convolution inputs between the ranks of a group, partitioned passes'
ancestor K/V assembled from the group, and the bytes received (:data:`TRAFFIC`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from treelit.partition import p2p
from treelit.partition.passes import ShardedRows
from treelit.ssm.layout import RecurrentLayout, external_layout
from treelit.tree.batch import TreeBatch


@dataclass
class _Route:
    """Rows one rank receives from the others and sends them: ``path`` (full-row indices of
    the received rows, in order), ``recv`` (src rank -> positions in ``path`` it fills),
    ``send`` (dst rank -> this rank's rows it needs)."""

    path: np.ndarray
    recv: Dict[int, np.ndarray]
    send: Dict[int, np.ndarray]


class _PathRows(torch.autograd.Function):
    """``[ext; own]`` along ``dim``: the path rows other ranks hold (received), then this rank's
    own ``x`` (for attention, one layer's keys and values side by side; for a recurrent layer,
    its convolution inputs). Backward: the received rows' gradients go back to their owners;
    what later ranks send back is added into the own rows' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, route, group, tag: int, dim: int) -> torch.Tensor:
        ctx.route, ctx.group, ctx.tag, ctx.dim = route, group, tag, dim
        E = len(route.path)
        shape = list(x.shape)
        shape[dim] = E
        ext = x.new_zeros(shape)
        ops, bufs = [], {}
        for dst, rows in sorted(route.send.items()):
            out = x.index_select(dim, torch.from_numpy(rows).to(x.device)).contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, dst), group, tag))
        for src, pos in sorted(route.recv.items()):
            shape[dim] = len(pos)
            bufs[src] = x.new_empty(shape)
            ops.append(dist.P2POp(dist.irecv, bufs[src], _global(group, src), group, tag))
        _exchange(ops, "rows")
        for src, pos in route.recv.items():
            ext.index_copy_(dim, torch.from_numpy(pos).to(x.device), bufs[src])
        return torch.cat([ext, x], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        route, group, dim = ctx.route, ctx.group, ctx.dim
        E = len(route.path)
        g_ext = grad.narrow(dim, 0, E)
        g_own = grad.narrow(dim, E, grad.shape[dim] - E).clone()
        ops, bufs = [], {}
        for src, pos in sorted(route.recv.items()):
            out = g_ext.index_select(dim, torch.from_numpy(pos).to(grad.device)).contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, src), group, ctx.tag + 1))
        shape = list(g_own.shape)
        for dst, rows in sorted(route.send.items()):
            shape[dim] = len(rows)
            bufs[dst] = grad.new_empty(shape)
            ops.append(dist.P2POp(dist.irecv, bufs[dst], _global(group, dst), group, ctx.tag + 1))
        _exchange(ops, "rows")
        for dst, rows in route.send.items():
            g_own.index_add_(dim, torch.from_numpy(rows).to(grad.device), bufs[dst])
        return g_own, None, None, None, None


class _StateIn(torch.autograd.Function):
    """The initial states ``[slots, *shape]`` of a range's external slots, received from the
    earlier ranks that own the slots' parent tokens. Backward: their gradients go back to the
    owners. ``like`` (a tensor of the layer's graph, downstream of the layer's convolution
    exchange) gives dtype and device and orders the backward: this function's gradients leave
    before that exchange's backward runs."""

    @staticmethod
    def forward(ctx, like: torch.Tensor, route: _Route, group, tag: int, shape: Tuple[int, ...]) -> torch.Tensor:
        ctx.route, ctx.group, ctx.tag = route, group, tag
        init = like.new_zeros(len(route.path), *shape)
        ops, bufs = [], {}
        for src, pos in sorted(route.recv.items()):
            bufs[src] = like.new_empty(len(pos), *shape)
            ops.append(dist.P2POp(dist.irecv, bufs[src], _global(group, src), group, tag))
        _exchange(ops, "states")
        for src, pos in route.recv.items():
            init[torch.from_numpy(pos).to(like.device)] = bufs[src]
        return init

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        route, group = ctx.route, ctx.group
        ops = []
        for src, pos in sorted(route.recv.items()):
            out = grad[torch.from_numpy(pos).to(grad.device)].contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, src), group, ctx.tag + 1))
        _exchange(ops, "states")
        return None, None, None, None, None


class _StateOut(torch.autograd.Function):
    """The layer's scan output ``out`` unchanged, after sending the later ranks the captured
    states ``cap [captures, ...]`` they start from. Backward: their gradients, received from
    those ranks, are added into ``cap``'s (it runs once ``out``'s gradient is complete, before
    this rank's scan is back-propagated)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, cap: torch.Tensor, route: _Route, group, tag: int) -> torch.Tensor:
        ctx.route, ctx.group, ctx.tag = route, group, tag
        ctx.cap_shape, ctx.cap_dtype = cap.shape, cap.dtype
        ops = []
        for dst, rows in sorted(route.send.items()):
            sent = cap[torch.from_numpy(rows).to(cap.device)].contiguous()
            ops.append(dist.P2POp(dist.isend, sent, _global(group, dst), group, tag))
        _exchange(ops, "states")
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        route, group = ctx.route, ctx.group
        g_cap = grad.new_zeros(ctx.cap_shape, dtype=ctx.cap_dtype)
        ops, bufs = [], {}
        for dst, rows in sorted(route.send.items()):
            bufs[dst] = g_cap.new_empty(len(rows), *ctx.cap_shape[1:])
            ops.append(dist.P2POp(dist.irecv, bufs[dst], _global(group, dst), group, ctx.tag + 1))
        _exchange(ops, "states")
        for dst, rows in route.send.items():
            g_cap.index_add_(0, torch.from_numpy(rows).to(grad.device), bufs[dst])
        return grad, g_cap, None, None, None


@dataclass
class _Recurrent:
    """One rank's recurrent routing for one convolution kernel size."""

    layout: RecurrentLayout
    conv: _Route    # convolution inputs of outside ancestors (path tokens within K-1 of a range token)
    state: _Route   # path = the slots' parent tokens; send rows index ``layout.capture``


def _owners(ranges, idx: np.ndarray) -> np.ndarray:
    ends = np.array([e for _, e in ranges], dtype=np.int64)
    return np.searchsorted(ends, idx, side="right")


def _route(ranges, rank: int, wanted: List[np.ndarray], local: Optional[np.ndarray] = None) -> _Route:
    """The route of ``wanted[r]`` (sorted full-row indices each rank r receives); this rank
    sends its rows of them as local rows, or as positions in ``local`` (sorted local rows)."""
    own = wanted[rank]
    owner = _owners(ranges, own)
    recv = {int(src): np.flatnonzero(owner == src) for src in np.unique(owner)}
    s0 = ranges[rank][0]
    send: Dict[int, np.ndarray] = {}
    for dst, w in enumerate(wanted):
        if dst == rank or not len(w):
            continue
        rows = w[_owners(ranges, w) == rank] - s0
        if len(rows):
            send[dst] = rows if local is None else np.searchsorted(local, rows)
    return _Route(own, recv, send)


def _recurrent_route(batch: TreeBatch, ranges, rank: int, K: int, external_root: bool = False,
                     boundary: Optional[np.ndarray] = None) -> _Recurrent:
    """This rank's recurrent routing. ``external_root`` (a partitioned pass below another): the
    row's root continues the partition's outside path, from the pass's external state (one more
    slot, after the received ones) and its ``K-1`` external convolution inputs (context rows
    after the received ones). ``boundary``: row tokens whose state and convolution context the
    passes below need (captured too)."""
    parent = batch.parent.cpu().numpy()
    slots, conv_need, table, depth = [], [], None, None
    for r, (s, e) in enumerate(ranges):
        p = parent[s:e]
        slots.append(np.unique(p[(p >= 0) & (p < s)]))
        cols, ext_cols, cur = [], [], np.arange(s, e)
        ext = np.zeros(e - s, dtype=np.int64)  # > 0: that many steps beyond the row's root (external context)
        for _ in range(1, K):  # the j-th ancestor of each range token (-1: none or external)
            nxt = np.where(cur >= 0, parent[np.maximum(cur, 0)], -1)
            leaving = (cur >= 0) & (nxt < 0) & external_root
            ext = np.where(leaving, 1, np.where(ext > 0, ext + 1, 0))
            cur = nxt
            cols.append(cur)
            ext_cols.append(ext)
        anc = np.stack(cols, 1) if cols else np.zeros((e - s, 0), dtype=np.int64)
        conv_need.append(np.unique(anc[(anc >= 0) & (anc < s)]))
        if r == rank:
            table = anc
            depth = np.stack(ext_cols, 1) if ext_cols else np.zeros((e - s, 0), dtype=np.int64)
    s, e = ranges[rank]
    T, M = e - s, len(conv_need[rank])
    X = K - 1 if external_root else 0
    # the padded source of the convolution: [own tokens | outside ancestors (conv_need) | external context | zero]
    src = np.where(table >= s, table - s,
                   np.where(table >= 0, T + np.searchsorted(conv_need[rank], np.maximum(table, 0)),
                            np.where((depth > 0) & (depth <= X), T + M + X - depth, T + M + X)))
    p = parent[s:e]
    local_parent = np.where(p >= s, p - s, -1)
    n_slots = len(slots[rank])
    root_slot = np.where((p >= 0) & (p < s), np.searchsorted(slots[rank], np.maximum(p, 0)),
                         n_slots if external_root else -1)
    root_slot = np.where(p >= s, -1, root_slot)
    later = np.concatenate([slots[d] for d in range(len(ranges)) if d != rank] + [np.zeros(0, np.int64)])
    capture = later[_owners(ranges, later) == rank] - s
    if boundary is not None and len(boundary):
        b = np.asarray(boundary, dtype=np.int64)
        capture = np.concatenate([capture, b[(b >= s) & (b < e)] - s])
    capture = np.unique(capture).astype(np.int64)
    layout = external_layout(local_parent, root_slot, src[:, ::-1], M + X, K, capture, batch.device)
    return _Recurrent(layout, _route(ranges, rank, conv_need), _route(ranges, rank, slots, capture))


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


class Traffic:
    """Bytes this process received for context parallelism since the last :meth:`take`: the
    point-to-point messages (path K/V and convolution inputs, states, and their gradients in the
    backward) and, in partitioned passes, the all-reduced boundary states and each assembly of
    a pass's ancestor K/V (counted at their size)."""

    def __init__(self) -> None:
        self.received = 0
        self.forward = 0  # of which in forward passes (even message tags; the captures' all-reduce)

    def take(self) -> int:
        got, self.received, self.forward = self.received, 0, 0
        return got


TRAFFIC = Traffic()


def _exchange(ops, kind: str) -> None:
    """Post ``ops`` (point-to-point sends and receives), wait for the receives; the sends
    complete in the background (:mod:`treelit.partition.p2p`, ``kind`` names its wait times)."""
    got = [(op.tensor.numel() * op.tensor.element_size(), op.tag) for op in ops if op.op is dist.irecv]
    TRAFFIC.received += sum(n for n, _ in got)
    TRAFFIC.forward += sum(n for n, tag in got if tag % 2 == 0)
    p2p.post(ops, kind)  # (with no ops too: inside a backward it queues the drain of earlier sends)


_RECURRENT_TAGS = 1 << 24  # the recurrent exchanges' tags start above every attention layer's


@dataclass
class KVShard:
    """One attention layer's captures of a partitioned pass under context parallelism, as one
    rank holds them: ``own [1, Hkv, n_own, Dk + Dv]`` (keys and values side by side) are the
    rows ``at`` of the ``size`` rows the passes below read (:meth:`RowPlan.needed`) that lie in
    this rank's range. A pass below assembles them from every rank of the group in each attention
    layer as it runs, and again in its backward (:func:`_WithAncestors`), so that no rank holds
    the whole path above the pass beyond one layer at a time; the gradients of the rows come
    back summed over the group into each owner's ``own``."""

    own: torch.Tensor
    at: torch.Tensor
    size: int
    dk: int


def _zeros_of_captures(pre: ShardedRows) -> torch.Tensor:
    """Zeros ``[1, Hkv, rows, Dk + Dv]`` for every row of the ancestor partitions' captures, one
    partition after another (what the group's all-reduces fill or sum)."""
    first = pre.parts[0][0].own
    return first.new_zeros(*first.shape[:2], sum(sh.size for sh, _ in pre.parts), first.shape[-1])


def _ancestor_rows(pre: ShardedRows, group) -> torch.Tensor:
    """The ancestors' K/V ``[1, Hkv, E, Dk + Dv]`` of one attention layer, from the shards of
    every rank of ``group`` (one all-reduce of each ancestor partition's captured rows, each rank
    filling its own)."""
    whole = _zeros_of_captures(pre)
    off = 0
    for sh, _ in pre.parts:
        whole[:, :, off:off + sh.size].index_copy_(2, sh.at, sh.own.detach())
        off += sh.size
    dist.all_reduce(whole, group=group)
    n = whole.numel() * whole.element_size()
    TRAFFIC.received += n
    TRAFFIC.forward += n
    out, off = [], 0
    for sh, idx in pre.parts:
        out.append(whole[:, :, off:off + sh.size].index_select(2, idx))
        off += sh.size
    return out[0] if len(out) == 1 else torch.cat(out, 2)


def _ancestor_grads(gk: Optional[torch.Tensor], gv: Optional[torch.Tensor], pre: ShardedRows,
                    group) -> List[torch.Tensor]:
    """Each shard's gradient from the gradients ``gk [1, Hkv, E, Dk]``, ``gv [1, Hkv, E, Dv]`` of
    the assembled rows (None: zero) on every rank of ``group``: summed over the group, the rank's
    own rows."""
    dk = pre.parts[0][0].dk
    whole = _zeros_of_captures(pre)
    e = off = 0
    for sh, idx in pre.parts:
        for g, cols in ((gk, slice(0, dk)), (gv, slice(dk, None))):
            if g is not None:
                whole[:, :, off:off + sh.size, cols].index_add_(2, idx, g[:, :, e:e + len(idx)].to(whole.dtype))
        off += sh.size
        e += len(idx)
    dist.all_reduce(whole, group=group)
    TRAFFIC.received += whole.numel() * whole.element_size()
    out, off = [], 0
    for sh, _ in pre.parts:
        out.append(whole[:, :, off:off + sh.size].index_select(2, sh.at).to(sh.own.dtype))
        off += sh.size
    return out


def _attend(backend, plan, q, k, v):
    return backend(q, k, v, plan)


class _WithAncestors(torch.autograd.Function):
    """One attention layer of a partitioned pass under context parallelism:
    ``attend(q, [ancestors | k], [ancestors | v])`` with the ancestors' K/V (``pre``, earlier
    passes) assembled from the ranks' shards for the call and dropped after it. The backward
    assembles them again and recomputes the attention with its graph (one more attention forward
    per layer), and the ancestors' gradients go back to the shards' owners summed over the group.
    So a rank holds its share of the path above the pass, not all of it in every layer."""

    @staticmethod
    def forward(ctx, q, k, v, attend, pre: ShardedRows, group, *owns):
        ctx.attend, ctx.pre, ctx.group = attend, pre, group
        dk = pre.parts[0][0].dk
        with torch.no_grad():
            anc = _ancestor_rows(pre, group)
            out = attend(q, torch.cat([anc[..., :dk].to(k.dtype), k], 2), torch.cat([anc[..., dk:].to(v.dtype), v], 2))
        del anc
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        pre, group = ctx.pre, ctx.group
        dk = pre.parts[0][0].dk
        anc = _ancestor_rows(pre, group)
        # keys and values apart (a slice of the joint rows would have a joint-sized gradient per half)
        ak, av = (x.to(t.dtype).contiguous().requires_grad_() for x, t in ((anc[..., :dk], k), (anc[..., dk:], v)))
        del anc
        with torch.enable_grad():
            qd, kd, vd = (x.detach().requires_grad_(x.requires_grad) for x in (q, k, v))
            out = ctx.attend(qd, torch.cat([ak, kd], 2), torch.cat([av, vd], 2))
            wrt = [t for t in (qd, kd, vd, ak, av) if t.requires_grad]
            got = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True))
        gq, gk, gv, gak, gav = (next(got) if t.requires_grad else None for t in (qd, kd, vd, ak, av))
        del out, ak, av
        ctx.attend = ctx.pre = None  # (what the node refers to goes with its backward)
        return (gq, gk, gv, None, None, None, *_ancestor_grads(gak, gav, pre, group))


class _AncestorsIdle(torch.autograd.Function):
    """A rank whose range of a partitioned pass is empty: its part of :class:`_WithAncestors`'s
    assemblies, forward and backward (its shards' rows may be read by the other ranks, and their
    gradients come back to it). Returns a zero that ``q`` (the layer's graph) carries."""

    @staticmethod
    def forward(ctx, q, pre: ShardedRows, group, *owns):
        ctx.pre, ctx.group = pre, group
        _ancestor_rows(pre, group)
        return q.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        pre, ctx.pre = ctx.pre, None
        _ancestor_rows(pre, ctx.group)  # (the others' recomputation)
        return (None, None, None, *_ancestor_grads(None, None, pre, ctx.group))


def _assembled(own: Optional[torch.Tensor], at: torch.Tensor, shape, like: torch.Tensor, dim: int, group, grad: bool,
               produced: List[Any], leaves: List[torch.Tensor]) -> torch.Tensor:
    """The ``shape`` tensor whose rows ``at`` (along ``dim``) each rank of ``group`` fills with its
    ``own`` (None: no rows), summed over the group; with ``grad`` a leaf that requires grad,
    noted with ``(own, dim, at)`` for :func:`cp_relay` (a rank holds its own rows, not a copy of
    the whole with zeros elsewhere)."""
    whole = like.new_zeros(shape)
    if own is not None:
        whole.index_copy_(dim, at, own.detach().to(whole.dtype))
    dist.all_reduce(whole, group=group)
    TRAFFIC.received += whole.numel() * whole.element_size()
    TRAFFIC.forward += whole.numel() * whole.element_size()
    if grad:
        whole.requires_grad_()
        produced.append((own, dim, at))
        leaves.append(whole)
    return whole
