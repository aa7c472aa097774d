"""``segment``'s math path (CUDA, or CPU with ``merged.MATH_ON_CPU``): a layer in a fixed number of calls.

The CPU path of :mod:`treelit.attention.segment` runs each plan group's prefix and causal parts on
the CPU flash kernels, one pair of calls per group. Off the CPU those parts are plain math (scores,
softmax, products: :func:`treelit.attention.merged._math_fwd`), about 96 kernel launches per group
and layer, and a tree with a branch at every turn has about one group per 4 segments: the launches,
each ~5-20 us of host time on a GPU, grew with the tree. Here the whole layer is one batch of
equal tiles instead, so its launches do not depend on the tree.

*Tiles.* The row's queries are cut into blocks of ``BLOCK_Q`` consecutive tokens (DFS order). The
keys any query of block ``[a, b)`` can see are the strict ancestors of ``a`` (a key ``j < a`` seen
by some ``q >= a`` has ``a`` in its subtree too), the block's own tokens, and the external keys
whose visibility interval meets ``[a, b)``; with a sliding window only those within the window of
the block's lowest position. That key list is cut into tiles of ``BLOCK_K`` keys. Every tile is
``BLOCK_Q`` query slots x ``BLOCK_K`` key slots, so all of a layer's tiles run as one batched
matmul; a boolean ``hidden`` mask (built on the device once per forward from ``kv_lo, kv_hi``
and the positions, so it is exact whatever the tree) hides the pairs a query does not see,
padded slots included.

*Merge.* Each query's softmax spans its tiles: the forward takes each query's maximum score over
all its tiles (``scatter_reduce_`` amax), exponentiates every tile against it and sums the
probabilities and ``p @ v`` into the query's row (``index_add_``): ``out = O / L``,
``lse = M + log L``. The backward recomputes each tile's probabilities from the merged
log-sum-exp and adds each tile's q, k, v gradients into one buffer per tensor. Grouped-query
heads are folded (the ``H / Hkv`` query heads of a key/value head are one block of
``H / Hkv * BLOCK_Q`` rows against it), so keys are neither repeated per head nor summed back.
Half inputs are computed in float32 and the output rounded once, as the per-group math path did.
On CUDA ``index_add_`` sums the tiles of a query with atomics (the per-group backward already
did for shared keys), so the last bits can differ from run to run unless
``torch.use_deterministic_algorithms(True)``.

*Launches.* A layer is 25 kernels forward and 30 backward (float32; 29 and 38 for half inputs),
whatever the tree, when one call holds all its tiles. That holds while their transient buffers
(:func:`tile_bytes`) fit :func:`chunk_bytes` (1/16 of a GPU's memory); beyond it the tiles run in
``ceil(bytes / budget)`` calls, each further call 20 kernels forward and 20 backward (the forward
rescales the running sums between calls, as flash attention does between key blocks): the count
then grows with a layer's attention work over the memory budget, never with its segments or plan
groups.

*Work.* ``cost`` = tiles x ``BLOCK_Q`` x ``BLOCK_K`` (query, key) pairs per head, against
``exact_pairs()`` visible ones. The padding is a block's last partial key tile, the masked half of
its own ``BLOCK_Q`` x ``BLOCK_Q`` diagonal, and, where a block starts deep in a subtree and goes
on into a shallower one, the deeper path's keys for the shallower queries (at most ``BLOCK_Q``
queries x that path per such block). ``benchmarks/segment_math_launches.py`` reports it.

Nothing here asks the host inside a layer: the tile indices are planned on the host, uploaded
once per forward (one tensor) and shared by every layer with the same window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from treelit.utils.dispatch import upload

BLOCK_Q = 64  # queries per tile (consecutive row tokens)
BLOCK_K = 128  # keys per tile
CHUNK_BYTES: Optional[int] = None  # transient buffers of one call (None: 1/16 of a GPU's memory, 2 GiB on CPU)

_HALF = (torch.float16, torch.bfloat16)


@dataclass
class TiledPlan:
    """The tiles of a row: ``tiles`` tiles of ``block_q`` query slots x ``block_k`` key slots.

    ``rows [tiles * block_q]``: the query row of each slot (``N``, a dummy row, for padded slots);
    ``q_read``: the row each slot reads (padded slots read a real one); ``k_read
    [tiles * block_k]``: the key (E-offset) each key slot reads; ``hidden [tiles, block_q,
    block_k]`` bool: pairs not visible (padding included). ``cost``: pairs computed per head."""

    tiles: int
    block_q: int
    block_k: int
    num_queries: int
    rows: torch.Tensor
    q_read: torch.Tensor
    k_read: torch.Tensor
    hidden: torch.Tensor
    cost: int

    def exact_pairs(self) -> int:
        """Visible (query, key) pairs: the work without padding (reads the mask: a host sync)."""
        return int((~self.hidden).sum())


def _ancestor_keys(seg_start, seg_len, seg_parent):
    """``keys(s)``: the row tokens of segment ``s``'s ancestors, in path order (memoised)."""
    memo: Dict[int, np.ndarray] = {}

    def keys(s: int) -> np.ndarray:
        if s not in memo:
            p = int(seg_parent[s])
            if p < 0:
                memo[s] = np.zeros(0, dtype=np.int64)
            else:
                own = np.arange(seg_start[p], seg_start[p] + seg_len[p], dtype=np.int64)
                memo[s] = np.concatenate([keys(p), own])
        return memo[s]

    return keys


def plan_tiles(layout, block_q: Optional[int] = None, block_k: Optional[int] = None) -> TiledPlan:
    """Tiles of ``layout``'s row (see the module docstring; block sizes ``BLOCK_Q`` / ``BLOCK_K`` by
    default); index tensors uploaded once, the mask built on the device. The key lists assume the
    row part of a :class:`~treelit.models.context.TreeLayout`: row key ``E + j`` visible to the
    queries ``[j, subtree_end[j])``; external keys may have any interval."""
    block_q, block_k = block_q or BLOCK_Q, block_k or BLOCK_K
    batch = layout.batch
    dev = layout.kv_lo.device
    N, E = layout.num_queries, layout.num_external
    seg_start, seg_len, seg_parent = batch.host("seg_start"), batch.host("seg_len"), batch.host("seg_parent")
    ext = np.stack([layout.host("kv_lo")[:E], layout.host("kv_hi")[:E]]) if E else np.zeros((2, 0), np.int64)
    w = layout.window
    if w is not None:
        q_pos = layout.host("q_pos")
        kv_pos = layout.host("kv_pos")
    ancestors = _ancestor_keys(seg_start, seg_len, seg_parent)
    starts = np.arange(0, N, block_q)
    seg_of = np.searchsorted(seg_start, starts, side="right") - 1 if len(seg_start) else np.zeros(0, np.int64)
    key_lists: List[np.ndarray] = []
    for a, s in zip(starts.tolist(), seg_of.tolist()):
        b = min(a + block_q, N)
        row = np.concatenate([ancestors(s), np.arange(seg_start[s], b, dtype=np.int64)]) + E
        touch = np.flatnonzero((ext[0] < b) & (ext[1] > a))
        keys = np.concatenate([touch.astype(np.int64), row])
        if w is not None:  # keys out of the window of the block's lowest position are seen by none
            keys = keys[kv_pos[keys] > q_pos[a:b].min() - w]
        key_lists.append(keys)
    per_block = np.array([max(1, -(-len(k) // block_k)) for k in key_lists], dtype=np.int64)
    T = int(per_block.sum())
    k_idx = np.full((T, block_k), -1, dtype=np.int64)
    t = 0
    for keys, n in zip(key_lists, per_block.tolist()):
        k_idx[t : t + n].reshape(-1)[: len(keys)] = keys
        t += n
    block_rows = starts[:, None] + np.arange(block_q)
    rows = np.repeat(np.minimum(block_rows, N), per_block, axis=0)  # N: padded slots
    idx = upload(np.concatenate([rows.reshape(-1), k_idx.reshape(-1)]), dev)
    rows_t, k_raw = idx[: T * block_q], idx[T * block_q :]
    q_read = rows_t.clamp(max=N - 1)
    k_read = k_raw.clamp(min=0)
    qr = rows_t.view(T, block_q, 1)
    visible = (layout.kv_lo[k_read].view(T, 1, block_k) <= qr) & (qr < layout.kv_hi[k_read].view(T, 1, block_k))
    visible &= (k_raw >= 0).view(T, 1, block_k)
    if w is not None:
        visible &= (layout.q_pos[q_read].view(T, block_q, 1) - layout.kv_pos[k_read].view(T, 1, block_k)) < w
    return TiledPlan(T, block_q, block_k, N, rows_t, q_read, k_read, ~visible, T * block_q * block_k)


def tile_bytes(heads: int, kv_heads: int, dim: int, block_q: int, block_k: int, itemsize: int) -> int:
    """An estimate of one tile's transient buffers in the backward pass (the larger one): the
    probabilities and score gradients, and the gathered / produced q, k, v rows and gradients."""
    scores = heads * block_q * block_k
    q_rows = heads * block_q * dim
    kv_rows = kv_heads * block_k * dim
    return itemsize * (3 * scores + 5 * q_rows + 5 * kv_rows)


def chunk_bytes(device) -> int:
    """The transient memory one call may use: ``CHUNK_BYTES``, or 1/16 of a GPU's memory (5 GiB on
    an 80 GiB H100), or 2 GiB elsewhere (no host sync: the device's properties are cached)."""
    if CHUNK_BYTES is not None:
        return CHUNK_BYTES
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 16
    return 2 ** 31


def _chunks(plan: TiledPlan, q, k) -> List[tuple]:
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    size = 4 if q.dtype in _HALF else q.element_size()
    per = max(1, chunk_bytes(q.device) // tile_bytes(H, Hkv, D, plan.block_q, plan.block_k, size))
    return [(c, min(c + per, plan.tiles)) for c in range(0, plan.tiles, per)]


class _Tiles:
    """One call's tiles ``[c0, c1)``. Tensors are read through head-grouped views of the
    token-major rows, ``[Hkv, tokens, rep, ...]`` (``rep = H / Hkv`` query heads per key/value
    head), so that a gather of a tile's rows is already its matmul operand: query slot ``i`` of a
    tile and head ``r`` of a group are row ``i * rep + r`` of the group's ``[bq * rep]`` rows."""

    def __init__(self, plan: TiledPlan, c0: int, c1: int, Hkv: int, rep: int):
        bq, bk = plan.block_q, plan.block_k
        self.t, self.bq, self.bk, self.Hkv, self.rep = c1 - c0, bq, bk, Hkv, rep
        self.rows = plan.rows[c0 * bq : c1 * bq]
        self.q_read = plan.q_read[c0 * bq : c1 * bq]
        self.k_read = plan.k_read[c0 * bk : c1 * bk]
        self.hidden = plan.hidden[None, c0:c1, :, None, :]  # [1, t, bq, 1, bk]

    def queries(self, X: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``[Hkv * t, bq * rep, ...]`` rows ``idx`` of a grouped ``[Hkv, tokens, rep, ...]`` view."""
        x = X.index_select(1, idx)
        return x.view(self.Hkv * self.t, self.bq * self.rep, *x.shape[3:])

    def keys(self, X: torch.Tensor) -> torch.Tensor:
        """``[Hkv * t, bk, D]`` key rows of the tiles from a ``[Hkv, tokens, D]`` view."""
        return X.index_select(1, self.k_read).view(self.Hkv * self.t, self.bk, X.shape[-1])

    def scores(self, Qf: torch.Tensor, Kt: torch.Tensor, scale: float) -> torch.Tensor:
        """Masked scaled scores ``[Hkv * t, bq * rep, bk]`` (hidden pairs at the dtype's minimum:
        a row that sees nothing in a tile stays finite, and its probabilities there are 0)."""
        s = torch.bmm(Qf, Kt.transpose(1, 2)).mul_(scale)
        s.view(self.Hkv, self.t, self.bq, self.rep, self.bk).masked_fill_(self.hidden, torch.finfo(s.dtype).min)
        return s

    def per_row(self, x: torch.Tensor) -> torch.Tensor:
        """``[Hkv * t, bq * rep, ...]`` -> ``[Hkv, t * bq, rep, ...]`` (a view), to add into rows."""
        return x.view(self.Hkv, self.t * self.bq, self.rep, *x.shape[2:])


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _HALF else t


def _grouped(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """Token-major ``[tokens, H, ...]`` -> the view ``[Hkv, tokens, H / Hkv, ...]``."""
    return x.view(x.shape[0], Hkv, x.shape[1] // Hkv, *x.shape[2:]).movedim(1, 0)


class _TiledLayer(torch.autograd.Function):
    """A layer's tree attention over the plan's tiles; ``q [1, H, N, D]``, ``k, v [1, Hkv, E + N, D]``.

    Running maxima, sums, outputs and log-sum-exps accumulate in head-grouped buffers ``[Hkv,
    N + 1, rep, ...]`` (row ``N``: the dummy row of padded slots), the gradients token-major
    (``[N + 1, H, D]``, ``[E + N, Hkv, D]``: the layout the projections wrote q, k, v in): every
    in-place update is on a whole buffer or a plain view of one, none on a permuted view
    (``torch.compile`` traces the layer). The output is returned token-major too (the output
    projection reads it without a copy)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: TiledPlan):
        Q, K, V = (_acc(x[0].transpose(0, 1)) for x in (q, k, v))  # token-major [tokens, heads, D]
        N, H, D = Q.shape
        Hkv = K.shape[1]
        rep = H // Hkv
        Qg, Kg, Vg = _grouped(Q, Hkv), K.transpose(0, 1), V.transpose(0, 1)
        scale = 1.0 / math.sqrt(D)
        M = L = O = None
        for c0, c1 in _chunks(plan, q, k):
            tl = _Tiles(plan, c0, c1, Hkv, rep)
            s = tl.scores(tl.queries(Qg, tl.q_read), tl.keys(Kg), scale)
            m = tl.per_row(s.amax(-1))  # [Hkv, t * bq, rep]
            index = tl.rows.view(1, -1, 1).expand(m.shape)
            if M is None:  # running maxima, sums and outputs
                M = m.new_full((Hkv, N + 1, rep), torch.finfo(m.dtype).min).scatter_reduce_(1, index, m, "amax")
                L, O = m.new_zeros(Hkv, N + 1, rep), m.new_zeros(Hkv, N + 1, rep, D)
            else:  # a later call: rescale the running sums to the new maxima
                M_new = M.clone().scatter_reduce_(1, index, m, "amax")
                f = torch.exp(M - M_new)
                L.mul_(f)
                O.mul_(f.unsqueeze(-1))
                M = M_new
            p = s.sub_(tl.queries(M, tl.rows).unsqueeze(-1)).exp_()
            L.index_add_(1, tl.rows, tl.per_row(p.sum(-1)))
            O.index_add_(1, tl.rows, tl.per_row(torch.bmm(p, tl.keys(Vg))))
            del s, p
        O.div_(L.unsqueeze(-1))
        # token-major, in the input dtype (half inputs: rounded once)
        out = O.movedim(0, 1).reshape(N + 1, H, D).to(q.dtype)
        out[N].zero_()  # the dummy row: zero output, log-sum-exp +inf (probabilities exactly 0)
        lse = M.add_(L.log_())
        lse[:, N].fill_(float("inf"))
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out[:N].transpose(0, 1).unsqueeze(0)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        Q, K, V = (_acc(x[0].transpose(0, 1)) for x in (q, k, v))
        N, H, D = Q.shape
        Hkv = K.shape[1]
        rep = H // Hkv
        scale = 1.0 / math.sqrt(D)
        G = torch.cat([_acc(grad[0].transpose(0, 1)), Q.new_zeros(1, H, D)])  # row N: zero gradient
        delta = (G * _acc(out)).sum(-1)  # [N + 1, H]
        dQ = Q.new_zeros(N + 1, H, D)  # token-major, as the projection wrote q
        dQg = dQ.view(N + 1, Hkv, rep, D)
        dK, dV = K.new_zeros(K.shape), V.new_zeros(V.shape)  # token-major [E + N, Hkv, D]
        Qg, Kg, Vg, Gg = _grouped(Q, Hkv), K.transpose(0, 1), V.transpose(0, 1), _grouped(G, Hkv)
        delta_g = _grouped(delta, Hkv)
        for c0, c1 in _chunks(plan, q, k):
            tl = _Tiles(plan, c0, c1, Hkv, rep)
            Qf, Kt, Vt = tl.queries(Qg, tl.q_read), tl.keys(Kg), tl.keys(Vg)
            p = tl.scores(Qf, Kt, scale).sub_(tl.queries(lse, tl.rows).unsqueeze(-1)).exp_()
            Gf = tl.queries(Gg, tl.rows)
            dV.index_add_(0, tl.k_read, torch.bmm(p.transpose(1, 2), Gf).view(Hkv, -1, D).movedim(0, 1))
            ds = torch.bmm(Gf, Vt.transpose(1, 2))
            ds.sub_(tl.queries(delta_g, tl.rows).unsqueeze(-1)).mul_(p)
            del p, Gf
            dQg.index_add_(0, tl.rows, tl.per_row(torch.bmm(ds, Kt)).movedim(0, 1))
            dK.index_add_(0, tl.k_read, torch.bmm(ds.transpose(1, 2), Qf).view(Hkv, -1, D).movedim(0, 1))
            del ds
        dt = grad.dtype
        return (dQ[:N].mul_(scale).to(dt).transpose(0, 1).unsqueeze(0),
                dK.mul_(scale).to(dt).transpose(0, 1).unsqueeze(0), dV.to(dt).transpose(0, 1).unsqueeze(0), None)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TiledPlan) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D) + mask) v`` of one layer over ``plan``'s tiles, ``[1, H, N, D]``."""
    return _TiledLayer.apply(q, k, v, plan)
