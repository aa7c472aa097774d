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
zero query) and one padded causal call for all their chains (padded keys come after every
real query, so causality hides them); the two parts merge by log-sum-exp
(:class:`~treelit.attention.merged.BatchedPrefixAttention`). Units join a bucket, largest
prefixes first, while its padded work stays within 1.1x its real work, so the number of
calls follows the tree's depth and the spread of its shapes, not its number of segments
(a GRPO group: its first chain plus one batched group; a 3-level tree of 27 leaves with
equal segment lengths: its first chain plus one group per level). A unit alone in its
bucket whose chains have equal lengths and follow each other in the row (a GRPO group's
completions) needs no padded slot: its queries, own keys and (when contiguous) prefix are
read as slices of the row, with no index and no slot mapping. Chains longer
than ``batch_below`` that have no siblings run alone on slices of the row; short chains
without a prefix (the roots of a packed row) are padded into groups of similar length.

*One read per layer.* All the groups' reads of q, k and v (slices and gathers) go through
one autograd node (:class:`_Reads`), whose backward adds each read's gradient into one
buffer per tensor. Read one by one, every read's backward would fill a zero gradient of
the whole row and autograd would add them all up: with many groups, one full-row buffer,
fill and addition per read and layer (the 27-leaf agent tree: 17% of its attention time).

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
import torch.nn.functional as F

from treelit.attention.base import ATTENTION, AttentionBackend
from treelit.attention.merged import BatchedPrefixAttention, prefix_causal_attention


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
    # prefix units (BatchedPrefixAttention): ``units`` units of at most ``la`` queries each
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
    _bias: Optional[Dict[torch.dtype, torch.Tensor]] = None

    @property
    def shared(self) -> bool:
        """One prefix call serves several chains (a unit of siblings)."""
        return self.units > 0 and self.n > self.units

    def bias(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if self.pre_bias is None:
            return None
        if self._bias is None:
            self._bias = {}
        if dtype not in self._bias:
            zero = torch.zeros((), dtype=dtype, device=self.pre_bias.device)
            self._bias[dtype] = torch.where(self.pre_bias, zero, torch.finfo(dtype).min)
        return self._bias[dtype]


@dataclass
class SegmentPlan:
    groups: List[_Group]
    order: Optional[torch.Tensor]  # concatenated group outputs -> row order (None: already in order)
    cost: int  # query x key pairs computed per head and layer (padding included)
    exact_cost: int  # visible pairs: sum over queries of the keys they see
    chains: int
    _reads: Optional[list] = None  # the groups' reads of q, k and v (_reads_of), built on first use


_Q, _K, _V = 0, 1, 2  # the tensors a group reads: queries (row N: a zero query), keys, values


def _reads_of(groups: List[_Group], E: int) -> List[Tuple[int, object]]:
    """Every read of q, k and v by the groups, in the order :meth:`SegmentAttention.__call__`
    takes them: ``(tensor, index)`` with an index tensor or a range ``(a, b)`` along the token
    axis (keys: the E external keys first)."""
    reads: List[Tuple[int, object]] = []
    for g in groups:
        if g.units:
            if g.q_range is not None:
                a, b = g.q_range
                reads += [(_Q, (a, b)), (_K, (E + a, E + b)), (_V, (E + a, E + b))]
            else:
                reads += [(_Q, g.q_idx), (_K, g.own_idx), (_V, g.own_idx), (_Q, g.qpad_idx)]
            pre = g.pre_range if g.pre_range is not None else g.pre_idx
            reads += [(_K, pre), (_V, pre)]
        elif g.mask is not None or g.q_slice is None:
            reads += [(_Q, g.q_idx)]
            if g.mask is None:
                reads += [(_K, g.own_idx), (_V, g.own_idx)]
            if g.pre_idx is not None:
                reads += [(_K, g.pre_idx), (_V, g.pre_idx)]
        else:
            a, b = g.q_slice
            reads += [(_Q, (a, b)), (_K, (E + a, E + b)), (_V, (E + a, E + b))]
            if g.pre_idx is not None:
                reads += [(_K, g.pre_idx), (_V, g.pre_idx)]
    return reads


class _Reads(torch.autograd.Function):
    """All the groups' reads of one layer's ``q [1, H, N, D]``, ``k, v [1, Hkv, E + N, D]`` in
    one autograd node: ``[heads, tokens, D]`` copies, in the order of ``reads``.

    Read separately (an ``index_select`` or a slice per read), every read's backward fills a
    zero gradient of the whole row and autograd adds them all up: a tree of many groups paid
    one full-row buffer, fill and addition per read and layer (agent_tree_27: ~0.5 s of a 12 s
    step). Here the backward adds every read's gradient into one buffer per tensor."""

    @staticmethod
    def forward(ctx, q, k, v, reads):
        H, N, D = q.shape[1:]
        # Only gathers need whole-row copies (slices read the row as it is): the queries with a
        # zero query appended (row N, read by padded slots), and k and v made contiguous once
        # (they are transposed views of the projections; index_select would otherwise copy the
        # whole source on every read). A GRPO group's reads are all slices and copy nothing.
        gathered = {t for t, idx in reads if not isinstance(idx, tuple)}
        src = (torch.cat([q[0], q.new_zeros(H, 1, D)], dim=1) if _Q in gathered else q[0],
               k[0].contiguous() if _K in gathered else k[0], v[0].contiguous() if _V in gathered else v[0])
        out = []
        for t, idx in reads:
            if isinstance(idx, tuple):
                out.append(src[t][:, idx[0] : idx[1]].clone())
            else:
                out.append(src[t].index_select(1, idx))
        ctx.reads, ctx.shapes = reads, (q.shape, k.shape, v.shape)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        qs, ks, vs = ctx.shapes
        ref = next(g for g in grads if g is not None)
        buf = (ref.new_zeros(qs[1], qs[2] + 1, qs[3]), ref.new_zeros(ks[1:]), ref.new_zeros(vs[1:]))
        for (t, idx), g in zip(ctx.reads, grads):
            if g is None:
                continue
            if isinstance(idx, tuple):
                buf[t][:, idx[0] : idx[1]].add_(g)
            else:
                buf[t].index_add_(1, idx, g)
        return buf[0][None, :, : qs[2]], buf[1][None], buf[2][None], None


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
        _, Hq, N, D = q.shape
        Hkv = k.shape[1]
        E = k.shape[2] - N
        if plan._reads is None:
            plan._reads = _reads_of(plan.groups, E)
        read = iter(_Reads.apply(q, k, v, plan._reads))
        outs = []
        for g in plan.groups:
            if g.units:
                G, A, P = g.units, g.la, g.lp
                rq, rk, rv = next(read), next(read), next(read)
                q_own = rq if g.q_range is not None else next(read)
                q_pre = rq.view(Hq, G, A, D).transpose(0, 1)
                q_own = q_own.view(Hq, g.n, g.lq, D).transpose(0, 1)
                ko = rk.view(Hkv, g.n, g.lq, D).transpose(0, 1)
                vo = rv.view(Hkv, g.n, g.lq, D).transpose(0, 1)
                kp = next(read).view(Hkv, G, P, D).transpose(0, 1)
                vp = next(read).view(Hkv, G, P, D).transpose(0, 1)
                outs.append(BatchedPrefixAttention.apply(q_pre, kp, vp, g.bias(q.dtype), q_own, ko, vo,
                                                         g.pre_slots, g.own_slots))
                continue
            if g.mask is not None:  # irregular: explicit masks over gathered keys
                qb = next(read).view(Hq, g.n, g.lq, D).transpose(0, 1)
                kb = next(read).view(Hkv, g.n, g.lp, D).transpose(0, 1)
                vb = next(read).view(Hkv, g.n, g.lp, D).transpose(0, 1)
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, enable_gqa=Hq != Hkv)
            elif g.q_slice is not None:
                qb, ko, vo = next(read)[None], next(read)[None], next(read)[None]
                kp = vp = None
                if g.pre_idx is not None:
                    kp, vp = next(read)[None], next(read)[None]
                ob = prefix_causal_attention(qb, kp, vp, None, ko, vo)
            else:
                qb = next(read).view(Hq, g.n, g.lq, D).transpose(0, 1)
                ko = next(read).view(Hkv, g.n, g.lq, D).transpose(0, 1)
                vo = next(read).view(Hkv, g.n, g.lq, D).transpose(0, 1)
                kp = vp = None
                if g.pre_idx is not None:
                    kp = next(read).view(Hkv, g.n, g.lp, D).transpose(0, 1)
                    vp = next(read).view(Hkv, g.n, g.lp, D).transpose(0, 1)
                ob = prefix_causal_attention(qb, kp, vp, g.bias(q.dtype), ko, vo)
            if g.q_slice is not None:
                outs.append(ob[0])
            else:
                ob = ob.transpose(0, 1).reshape(Hq, g.n * g.lq, D)
                outs.append(ob if g.keep is None else ob.index_select(1, g.keep))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        if plan.order is not None:
            out = out.index_select(1, plan.order)
        return out.unsqueeze(0)


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
