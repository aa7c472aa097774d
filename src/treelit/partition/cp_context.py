"""Context parallelism's passes (:mod:`treelit.partition.context_parallel`): the tree context
that routes attention and recurrent layers through the exchanges, a range's forward, and a
partitioned pass's captures and gradient relay."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from treelit.attention.base import resolve_backend
from treelit.loss.logprobs import token_logprobs
from treelit.models.context import ExternalKV, TreeContext
from treelit.models.forward import decoder_hidden, in_forward, output_weight
from treelit.objectives.folding import target_selection
from treelit.partition import p2p
from treelit.partition.passes import ShardedRows, empty_row
from treelit.tree.batch import TreeBatch
from treelit.partition.cp_exchange import (_RECURRENT_TAGS, TRAFFIC, KVShard, _AncestorsIdle, _assembled, _attend,
                                          _PathRows, _Recurrent, _recurrent_route, _StateIn, _StateOut,
                                          _WithAncestors)
from treelit.partition.cp_plan import CPPlan


class _CPContext(TreeContext):
    """The range's row with the path's K/V fetched per attention layer, and the recurrent
    layers' convolution contexts and slot states routed between ranks. Message tags:
    ``4 * layer`` for an attention layer's path rows; ``_RECURRENT_TAGS + 2 * i`` for the i-th
    distinct recurrent exchange of the pass (a layer's convolution inputs, or one of its
    states, by name: a layer may make several, and a transformers layer may share its index
    with an attention layer); each ``+ 1`` in the backward. Every rank with tokens runs the
    same layers in the same order, so the numbering agrees; a recomputation (activation
    checkpointing) finds the tags of the first pass."""

    def __init__(self, sub: TreeBatch, backend, external: Optional[ExternalKV], plan: Optional[CPPlan], group,
                 full: TreeBatch, pre: Optional[ExternalKV] = None, capture_kv: bool = False,
                 boundary: Optional[np.ndarray] = None):
        in_range = None
        if boundary is not None and plan is not None:
            in_range = boundary[(boundary >= plan.start) & (boundary < plan.end)] - plan.start
        super().__init__(sub, backend, external=external, capture_kv=capture_kv, capture_tokens=in_range)
        self.cp_plan, self.group, self.full = plan, group, full
        # a partitioned pass below another: its ancestors' K/V, and its root's state and convolution
        # context (the same on every rank); a rank whose range of the pass is empty keeps them
        # apart (``idle_pre``): it still takes part in assembling the ancestors' K/V
        self.pre = pre if plan is not None else None
        self.idle_pre = pre if plan is None else None
        self.external_root = pre is not None and bool(pre.state)
        self.boundary = boundary  # row tokens whose states the passes below start from (captured)
        self._recurrent: Dict[int, _Recurrent] = {}
        self._tags: Dict[Tuple[int, str], int] = {}

    def _tag(self, layer: int, key: str) -> int:
        return self._tags.setdefault((layer, key), _RECURRENT_TAGS + 2 * len(self._tags))

    def _route_for(self, K: int) -> _Recurrent:
        if K not in self._recurrent:
            self._recurrent[K] = _recurrent_route(self.full, self.cp_plan.ranges, self.cp_plan.rank, K,
                                                  self.external_root, self.boundary)
        return self._recurrent[K]

    @property
    def captured_rows(self) -> np.ndarray:
        """The range's rows whose states the layers return (``layout.capture``)."""
        return self._route_for(next(iter(self._recurrent), 1)).layout.capture

    def recurrent_layout(self, K: int, B: int = 1, L: int = 0, device=None):
        if self.cp_plan is None:
            return super().recurrent_layout(K, B, L, device)
        return self._route_for(K).layout

    def recurrent_conv_inputs(self, layer: int, K: int, inputs: Dict[str, torch.Tensor]):
        if self.cp_plan is None:
            return super().recurrent_conv_inputs(layer, K, inputs)
        route = self._route_for(K).conv
        names = list(inputs)
        widths = [inputs[n].shape[1] for n in names]
        tag = self._tag(layer, ",".join(names))
        both = _PathRows.apply(torch.cat([inputs[n] for n in names], dim=1), route, self.group, tag, 0)
        M = len(route.path)
        ext, own = both[:M].split(widths, dim=1), both[M:].split(widths, dim=1)
        ext = dict(zip(names, ext))
        if self.external_root:  # then the K-1 inputs before the pass's root (context rows after the received)
            outside = self.pre.state[layer]
            ext = {n: torch.cat([ext[n], outside[n].to(ext[n].dtype)]) for n in names}
        return dict(zip(names, own)), ext

    def recurrent_scan(self, layer: int, scan, state_shape, like: torch.Tensor, name: str = "state"):
        if self.cp_plan is None:
            return super().recurrent_scan(layer, scan, state_shape, like, name)
        route = self._route_for(next(iter(self._recurrent), 1)).state  # the same for every kernel size
        tag = self._tag(layer, name)
        init = _StateIn.apply(like, route, self.group, tag, tuple(state_shape)) if len(route.path) else None
        if self.external_root and self.cp_plan.start == 0:  # the pass's root: one more slot, its outside state
            outside = self.pre.state[layer][name][None]
            init = outside if init is None else torch.cat([init, outside.to(init.dtype)])
        out, cap = scan(init)
        if route.send:
            out = _StateOut.apply(out, cap, route, self.group, tag)
        return out, cap

    def attention(self, layer, q, k, v, window=None):
        if self.cp_plan is None:
            out = super().attention(layer, q, k, v, window)
            idle = self.idle_pre.k.get(layer) if self.idle_pre is not None else None
            if isinstance(idle, ShardedRows):  # an empty range: still a part of the ancestors' assembly
                out = out + _AncestorsIdle.apply(q, idle, self.group, *(sh.own for sh, _ in idle.parts))
            return out
        if q.shape[0] != 1:
            raise ValueError("a tree row has batch size 1")
        if self.capture_kv:  # (the rank's own rows, for the passes below)
            self.captured[layer] = (k, v)
        dk = k.shape[-1]
        # [path | own] keys and values: one copy each of what the attention keeps for its backward
        # (the exchange's joint tensor and the received rows are not held beyond this call)
        both = _PathRows.apply(torch.cat([k, v], dim=-1), self.cp_plan, self.group, 4 * layer, 2)
        k, v = both[..., :dk].contiguous(), both[..., dk:].contiguous()
        del both
        plan = self.plan_for(window)
        pre = self.pre.k[layer] if self.pre is not None else None
        if isinstance(pre, ShardedRows):  # the partition's ancestors (earlier passes), assembled in front
            # (not a closure over this context: the graph it would join keeps the context's captures)
            return _WithAncestors.apply(q, k, v, functools.partial(_attend, self.backend, plan), pre, self.group,
                                        *(sh.own for sh, _ in pre.parts))
        if pre is not None:
            k, v = torch.cat([pre, k], 2), torch.cat([self.pre.v[layer], v], 2)
        return self.backend(q, k, v, plan)


def _forward_range(model, batch: TreeBatch, plan: CPPlan, group, attention, chunk_rows, with_entropy: bool):
    """This rank's target tokens (full-row indices), their log-probs / entropies (with graph)
    and the range's hidden states."""
    dev = batch.device
    if plan.size == 0:  # fewer tokens than ranks: an empty pass (nothing sent or received)
        sub, external = empty_row(dev, batch), None
        tokens = torch.zeros(0, dtype=torch.long, device=dev)
    else:
        tokens = torch.arange(plan.start, plan.end, device=dev)
        sub = batch if plan.size == batch.num_tokens else batch.subset(tokens)
        E = len(plan.path)
        external = None
        if E:
            path = torch.from_numpy(plan.path).to(dev)
            hi = torch.clamp(batch.subtree_end[path], max=plan.end) - plan.start
            external = ExternalKV({}, {}, torch.zeros(E, dtype=torch.long, device=dev), hi,
                                  pos=batch.position_ids[path])
    backend = resolve_backend(attention, dev, sub)

    def run(m):
        ctx = _CPContext(sub, backend, external, plan if plan.size else None, group, batch)
        h = decoder_hidden(m, sub.input_ids[None], sub.position_ids[None], ctx)[0]
        if plan.size == 0:
            return tokens, h[:0, 0], None, h
        sel = target_selection(batch)
        par = batch.parent[sel]
        mine = sel[(par >= plan.start) & (par < plan.end)]
        rows = batch.parent[mine] - plan.start
        logp, ent = token_logprobs(h[rows], output_weight(m), batch.input_ids[mine], chunk_rows=chunk_rows,
                                   with_entropy=with_entropy)
        return mine, logp, ent, h

    return _drained(lambda: in_forward(model, run))


def _drained(fn):
    """``fn()``, a forward pass whose sends are all waited on when it returns (and none of an
    earlier pass is still in flight when it starts: the passes reuse their tags), or abandoned
    (:func:`~treelit.partition.p2p.abandon`) when it raises."""
    p2p.drain()
    try:
        out = fn()
    except BaseException:
        p2p.abandon()
        raise
    p2p.drain()
    return out


# -- context parallelism within a partitioned pass (see :mod:`treelit.partition.engine`) -----------------
def cp_forward_pass(model, sub: TreeBatch, plan: CPPlan, group, attention, pre: Optional[ExternalKV] = None,
                    capture: bool = False, boundary: Optional[np.ndarray] = None, embedding_grad_accumulator=None):
    """This rank's range of the partition row ``sub`` through ``model`` (call inside the model's
    forward): ``(h [range, D], ctx)``. ``pre``: the K/V of the partition's ancestors (earlier
    passes), the same on every rank and visible to every query of the range, in front of the
    path rows fetched from the other ranks of this pass, and (recurrent layers) the state and
    convolution context the pass's root continues. ``capture``: keep the range's own K/V
    (``ctx.captured``) and the recurrent states and convolution contexts at the ``boundary``
    tokens it holds (the parents of child partitions' roots) for the passes below. A rank whose
    range is empty runs an empty row (its captured K/V give the shapes of what it contributes:
    nothing)."""
    dev = sub.device
    if plan.size == 0:  # (``pre`` stays: the ancestors' K/V are assembled with every rank of the group)
        row, external, live = empty_row(dev, sub), None, None
    else:
        live = plan
        row = sub if plan.size == sub.num_tokens else sub.subset(torch.arange(plan.start, plan.end, device=dev))
        path = torch.from_numpy(plan.path).to(dev)
        P = pre.num_tokens if pre is not None else 0
        E = len(plan.path) + P
        external = None
        if E:
            hi = torch.clamp(sub.subtree_end[path], max=plan.end) - plan.start
            if P:
                hi = torch.cat([torch.full((P,), plan.size, dtype=torch.long, device=dev), hi])
            pos = sub.position_ids[path]
            if P:
                pos = torch.cat([pre.pos.to(dev), pos])
            external = ExternalKV({}, {}, torch.zeros(E, dtype=torch.long, device=dev), hi, pos=pos)
    backend = resolve_backend(attention, dev, row)
    ctx = _CPContext(row, backend, external, live, group, sub, pre=pre, capture_kv=capture,
                     boundary=boundary if capture else None)
    ctx.embedding_grad_accumulator = embedding_grad_accumulator  # (no [V, D] gradient per pass)
    h = _drained(lambda: decoder_hidden(model, row.input_ids[None], row.position_ids[None], ctx)[0])
    return h, ctx


def cp_captures(ctx, plan: CPPlan, need: np.ndarray, group, grad: bool):
    """What a partition's pass hands the passes below, under context parallelism: per attention
    layer a :class:`KVShard` of the K/V of its rows ``need`` (the ancestors of its child
    partitions' roots): the rows of them in this rank's range (none: an empty shard). With
    ``grad``, the shards are leaves that require grad, and each rank's own rows (a tensor of its
    graph) are noted to relay their gradients into: see :func:`cp_relay`. Returns ``(kv,
    produced, leaves)``."""
    lo, hi = (plan.start, plan.end) if plan.size else (0, 0)
    at = np.flatnonzero((need >= lo) & (need < hi))
    produced: List[Any] = []
    leaves: List[torch.Tensor] = []
    kv: Dict[int, KVShard] = {}
    for layer in sorted(ctx.captured):
        k, v = ctx.captured[layer]
        dev = k.device
        # (only the rows wanted: not a copy of the range's K/V)
        rows = torch.from_numpy(need[at] - lo).to(dev)
        own = torch.cat([k.index_select(2, rows), v.index_select(2, rows)], dim=-1)
        leaf = own.detach()
        if grad:
            leaf.requires_grad_()
            produced.append((own if len(at) else None, None, None))  # (its gradient arrives summed)
            leaves.append(leaf)
        kv[layer] = KVShard(leaf, torch.from_numpy(at).to(dev), len(need), k.shape[-1])
    return kv, produced, leaves


def cp_state_captures(ctx, plan: CPPlan, boundary: np.ndarray, group, grad: bool):
    """The recurrent layers' part of :func:`cp_captures`: per layer and name, the states and
    convolution contexts ``[len(boundary), ...]`` at a pass's ``boundary`` tokens (the parents
    of its child partitions' roots, sorted), each from the rank that holds the token, the same on
    every rank. The ranks agree first on the names, shapes and dtypes (a rank whose range holds
    no captured token, or no token at all, has none of its own). Returns ``(states, produced,
    leaves)``."""
    states: Dict[int, Dict[str, torch.Tensor]] = {}
    produced: List[Any] = []
    leaves: List[torch.Tensor] = []
    own = {(layer, n): (tuple(t.shape[1:]), t.dtype) for layer, named in ctx.recurrent_out.items()
           for n, t in named.items() if t is not None} if plan.size else {}
    every: List[Any] = [None] * len(plan.ranges)
    dist.all_gather_object(every, own, group=group)
    meta = {k: v for m in every for k, v in m.items()}
    lo, hi = (plan.start, plan.end) if plan.size else (0, 0)
    at = np.flatnonzero((boundary >= lo) & (boundary < hi))
    rows = np.searchsorted(ctx.captured_rows, boundary[at] - lo) if len(at) else at
    dev = ctx.batch.device
    like = torch.zeros((), device=dev)
    for layer, n in sorted(meta):
        shape, dtype = meta[(layer, n)]
        mine = None
        if len(at):
            t = ctx.recurrent_out[layer][n]
            mine = t[torch.from_numpy(rows).to(dev)].to(dtype)
        states.setdefault(layer, {})[n] = _assembled(mine, torch.from_numpy(at).to(dev), (len(boundary), *shape),
                                                     like.to(dtype), 0, group, grad, produced, leaves)
    return states, produced, leaves


def cp_relay(produced: List[Any], leaves: List[torch.Tensor], group) -> Tuple[list, list]:
    """``(tensors, grads)`` to back-propagate for a partition's captures under context
    parallelism: each leaf's gradient summed over the group (every rank of the group calls this
    for the same pass, in the same order), its rows into the rank's own contribution
    (``produced``: ``(own rows or None, dim, their positions)`` per leaf; a K/V shard's,
    ``(own rows or None, None, None)``, already summed when the passes below ran)."""
    tensors, grads = [], []
    for (t, dim, at), leaf in zip(produced, leaves):
        g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        leaf.grad = None
        if dim is None:  # a K/V shard: its gradient came back summed over the group (``_WithAncestors``)
            if t is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g.to(t.dtype))
            continue
        g = g.contiguous()
        dist.all_reduce(g, group=group)
        TRAFFIC.received += g.numel() * g.element_size()
        if t is not None and t.requires_grad:
            tensors.append(t)
            grads.append(g.index_select(dim, at).to(t.dtype))
    return tensors, grads
