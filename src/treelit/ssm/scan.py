"""Exact recurrences over a :class:`~treelit.ssm.layout.RecurrentLayout` (pure torch).

Both recurrences keep a per-head state that is decayed, updated and read once per
token. Segments of one depth level run together (one batched step per token offset);
a segment's initial state is its parent's state after the parent's last token (zero
for a root, the external state for a root continuing another partition). Everything
stays in the input precision, so float64 runs are exact to rounding.

* Gated DeltaNet (state ``S [HV, K, V]``)::

      S = exp(g_t) S;   u = beta_t (v_t - k_t^T S);   S = S + k_t u^T;   o_t = (scale q_t)^T S

* Mamba2 / SSD (state ``h [H, P, N]``)::

      h = exp(dt_t A) h + (dt_t x_t) B_t^T;   y_t = h C_t + D x_t

Two ways to run them, same results to rounding:

* :func:`segment_scan` with a ``*_step`` function: one batched step per token offset,
  the plain recurrence (the reference, ``chunk_size=1``);
* :func:`chunked_scan` with a ``*_chunk`` function: one call per block of up to
  ``chunk_size`` tokens of every active segment, the block's recurrence unrolled into
  matrix products (the default). Within a block of a segment with cumulative log-decay
  ``c_t`` (``g`` for Gated DeltaNet, ``dt A`` for Mamba2) and entry state ``S_0``:

      Mamba2:  h_t = e^{c_t} h_0 + sum_{s<=t} e^{c_t - c_s} dt_s x_s B_s^T,
               y_t = e^{c_t} h_0 C_t + sum_{s<=t} e^{c_t - c_s} (C_t . B_s) dt_s x_s + D x_t
      GDN:     S_t = e^{c_t} S_0 + sum_{s<=t} e^{c_t - c_s} k_s u_s^T, where the u_t solve
               u_t + beta_t sum_{s<t} e^{c_t - c_s} (k_t . k_s) u_s = beta_t (v_t - e^{c_t} S_0^T k_t)
               (unit lower-triangular), and o_t = scale q_t^T S_t.

  Blocks are padded at their end with tokens of zero decay and zero input (``dt = 0``,
  ``beta = 0``), which leave the state unchanged. The pairwise decays are summed
  directly (no differences of running sums), and half-precision inputs run their blocks
  in float32.

Faster backends are tested against these.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from treelit.ssm.layout import RecurrentLayout, root_state
from treelit.utils.dispatch import upload_all

__all__ = ["segment_scan", "chunked_scan", "gdn_step", "ssd_step", "kda_step", "gdn_chunk", "ssd_chunk", "kda_chunk"]

Step = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
Chunk = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def gdn_step(q, k, v, beta, g, scale):
    """Returns ``step(state, idx) -> (new state, output)`` for token indices ``idx``."""

    def step(S: torch.Tensor, idx: torch.Tensor):
        S = S * torch.exp(g[idx])[:, :, None, None]
        kt = k[idx]
        u = beta[idx][..., None] * (v[idx] - torch.einsum("nhk,nhkv->nhv", kt, S))
        S = S + kt[..., None] * u[:, :, None, :]
        return S, torch.einsum("nhk,nhkv->nhv", q[idx] * scale, S)

    return step


def ssd_step(x, dt, A, Bh, Ch, D):
    """Mamba2: ``x [T,H,P]``, ``dt [T,H]``, ``A [H]``, ``Bh/Ch [T,H,N]``, ``D [H] or [H,P]``."""
    Dh = D[:, None] if D.dim() == 1 else D

    def step(h: torch.Tensor, idx: torch.Tensor):
        d = dt[idx]
        xt = x[idx]
        h = h * torch.exp(d * A)[:, :, None, None] + (d[..., None] * xt)[..., None] * Bh[idx][:, :, None, :]
        return h, torch.einsum("bhps,bhs->bhp", h, Ch[idx]) + Dh * xt

    return step


def segment_scan(
    step: Step,
    layout: RecurrentLayout,
    state_shape: Tuple[int, ...],
    out_shape: Tuple[int, ...],
    like: torch.Tensor,
    init_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``step`` over every token, level by level, segments of a level in parallel.

    ``init_state``: the state of roots continuing an outside path (``seg_parent`` -2), or
    ``[slots, *state_shape]`` for roots continuing one of several (``seg_parent = -2 - slot``).
    Returns ``(outputs [T, *out_shape], captured [len(layout.capture), *state_shape] or None)``:
    the states right after each token of ``layout.capture`` (which the layout made segment ends).
    """

    def one_token(S: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor):
        S, o = step(S, idx[:, 0])
        return S, o[:, None]

    return chunked_scan(one_token, layout, state_shape, out_shape, like, init_state, chunk_size=1)


def _decays(a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-decays ``a [..., L]`` of a block -> ``(entry [..., L], pair [..., L, L])``:
    ``entry_t = sum_{r<=t} a_r`` and ``pair[t, s] = sum_{s<r<=t} a_r`` for ``s <= t``
    (``-inf`` above the diagonal). Pair sums are accumulated directly rather than as
    differences of running sums, so nothing cancels (large decays, low precision) and an
    infinite decay gives ``-inf`` (a zero factor), never ``inf - inf``."""
    L = a.shape[-1]
    ones = torch.ones(L, L, dtype=torch.bool, device=a.device)
    rows = a[..., :, None].expand(*a.shape, L).masked_fill(~ones.tril(-1), 0.0)  # [t, s] = a_t if t > s
    pair = rows.cumsum(-2).masked_fill(~ones.tril(), float("-inf"))
    return a.cumsum(-1), pair


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks run in at least float32: triangular solves have no half-precision kernels,
    and decay products lose too much in bf16/fp16 (the state keeps the input dtype)."""
    return torch.promote_types(dtype, torch.float32)


def gdn_chunk(q, k, v, beta, g, scale):
    """Returns ``chunk(state [n, HV, K, V], idx [n, L], valid [n, L]) -> (state, out [n, L, HV, V])``."""
    wd = _work_dtype(q.dtype)

    def chunk(S: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor):
        m = valid.to(wd)[..., None]
        entry, pair = _decays((g[idx].to(wd) * m).transpose(1, 2))  # [n, HV, L], [n, HV, L, L]
        b = (beta[idx].to(wd) * m).transpose(1, 2)[..., None]  # [n, HV, L, 1]
        kk, vv = k[idx].to(wd).transpose(1, 2), v[idx].to(wd).transpose(1, 2)  # [n, HV, L, K|V]
        qq = q[idx].to(wd).transpose(1, 2) * scale
        S0 = S.to(wd)
        L = idx.shape[1]
        decay = torch.exp(pair)
        start = torch.exp(entry)[..., None]  # e^{c_t}
        A = (b * decay * (kk @ kk.transpose(-1, -2))).tril(-1)
        eye = torch.eye(L, dtype=wd, device=A.device)
        u = torch.linalg.solve_triangular(eye + A, b * (vv - start * (kk @ S0)), upper=False, unitriangular=True)
        o = start * (qq @ S0) + (decay * (qq @ kk.transpose(-1, -2))) @ u
        tail = decay[..., -1, :, None]  # e^{c_L - c_s}
        S1 = torch.exp(entry[..., -1])[..., None, None] * S0 + (kk * tail).transpose(-1, -2) @ u
        return S1.to(S.dtype), o.transpose(1, 2).to(q.dtype)

    return chunk


def kda_step(q, k, v, beta, g, scale):
    """Kimi Delta Attention: Gated DeltaNet with a per-key-channel log-decay ``g [T, H, K]``::

        S = diag(exp(g_t)) S;   u = beta_t (v_t - k_t^T S);   S = S + k_t u^T;   o_t = (scale q_t)^T S
    """

    def step(S: torch.Tensor, idx: torch.Tensor):
        S = S * torch.exp(g[idx])[..., None]
        kt = k[idx]
        u = beta[idx][..., None] * (v[idx] - torch.einsum("nhk,nhkv->nhv", kt, S))
        S = S + kt[..., None] * u[:, :, None, :]
        return S, torch.einsum("nhk,nhkv->nhv", q[idx] * scale, S)

    return step


def kda_chunk(q, k, v, beta, g, scale):
    """Kimi Delta Attention blocks (arguments as :func:`kda_step`). With per-channel cumulative
    decays ``c_t [K]``, the Gated DeltaNet block (module docs) holds with every ``e^{c_t - c_s}``
    moved inside the key-channel sums: ``A[t, s] = sum_k k_t[k] e^{c_t[k] - c_s[k]} k_s[k]``, the
    entry state read through ``e^{c_t} * k_t`` / ``e^{c_t} * q_t``, the exit state
    ``diag(e^{c_L}) S_0 + sum_s diag(e^{c_L - c_s}) k_s u_s^T``."""
    wd = _work_dtype(q.dtype)

    def chunk(S: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor):
        m = valid.to(wd)
        entry, pair = _decays((g[idx].to(wd) * m[..., None, None]).permute(0, 2, 3, 1))  # [n,H,K,L], [n,H,K,L,L]
        b = (beta[idx].to(wd) * m[..., None]).transpose(1, 2)[..., None]  # [n, H, L, 1]
        kk, vv = k[idx].to(wd).transpose(1, 2), v[idx].to(wd).transpose(1, 2)  # [n, H, L, K|V]
        qq = q[idx].to(wd).transpose(1, 2) * scale
        S0 = S.to(wd)
        L = idx.shape[1]
        decay = torch.exp(pair)  # [n, H, K, t, s]
        start = torch.exp(entry).transpose(-1, -2)  # [n, H, L, K]: e^{c_t}
        A = (b * torch.einsum("nhtk,nhkts,nhsk->nhts", kk, decay, kk)).tril(-1)
        eye = torch.eye(L, dtype=wd, device=A.device)
        u = torch.linalg.solve_triangular(eye + A, b * (vv - (kk * start) @ S0), upper=False, unitriangular=True)
        o = (qq * start) @ S0 + torch.einsum("nhtk,nhkts,nhsk->nhts", qq, decay, kk) @ u
        tail = decay[..., -1, :].transpose(-1, -2)  # [n, H, L, K]: e^{c_L - c_s}
        S1 = torch.exp(entry[..., -1])[..., None] * S0 + (kk * tail).transpose(-1, -2) @ u
        return S1.to(S.dtype), o.transpose(1, 2).to(q.dtype)

    return chunk


def ssd_chunk(x, dt, A, Bh, Ch, D):
    """Mamba2 blocks; arguments as :func:`ssd_step`."""
    Dh = D[:, None] if D.dim() == 1 else D
    wd = _work_dtype(x.dtype)

    def chunk(h: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor):
        d = (dt[idx].to(wd) * valid.to(wd)[..., None]).transpose(1, 2)  # [n, H, L]
        entry, pair = _decays(d * A.to(wd)[:, None])
        xt = x[idx]  # [n, L, H, P]
        xs = xt.to(wd).transpose(1, 2) * d[..., None]  # dt_s x_s, [n, H, L, P]
        Bs, Cs = Bh[idx].to(wd).transpose(1, 2), Ch[idx].to(wd).transpose(1, 2)  # [n, H, L, N]
        h0 = h.to(wd)
        decay = torch.exp(pair)
        y = torch.exp(entry)[..., None] * (Cs @ h0.transpose(-1, -2)) + (decay * (Cs @ Bs.transpose(-1, -2))) @ xs
        tail = decay[..., -1, :, None]
        h1 = torch.exp(entry[..., -1])[..., None, None] * h0 + (xs * tail).transpose(-1, -2) @ Bs
        return h1.to(h.dtype), y.transpose(1, 2).to(x.dtype) + Dh * xt

    return chunk


class _Block:
    """One block of one depth level: ``n`` active segments, ``L`` token offsets."""

    __slots__ = ("rows", "idx", "valid", "flat", "finals")

    def __init__(self, rows, idx, valid, flat, finals):
        self.rows = rows  # [n] long: the level's active segments (None: all of them)
        self.idx = idx  # [n, L] long: token of each (segment, offset); past a segment's end its last token
        self.valid = valid  # [n, L] long 0/1: real tokens
        self.flat = flat  # [m] long: positions of the real tokens in the block's n * L outputs
        self.finals = finals  # host: (row j, segment) pairs whose last token is in this block


class ScanPlan:
    """Every index a scan of ``layout`` in blocks of ``chunk_size`` reads, planned on the host once
    and uploaded in one copy (the views below slice that buffer). Built once per layout and block
    size and shared by every recurrent layer of the forward (and its backward), so a scan asks
    the host nothing: no index uploads per block, no boolean masks, no ``nonzero``."""

    def __init__(self, layout: RecurrentLayout, chunk_size: int, device: torch.device):
        seg_start, seg_len = layout.seg_start, layout.seg_len
        arrays: List[np.ndarray] = []  # every index array, uploaded together below

        def put(a: np.ndarray) -> int:
            arrays.append(a)
            return len(arrays) - 1

        out_tokens = []
        levels = []
        for segs in layout.levels:
            lens, starts = seg_len[segs], seg_start[segs]
            blocks = []
            for t0 in range(0, int(lens.max()), chunk_size):
                act = np.flatnonzero(lens > t0)
                L = min(chunk_size, int(lens[act].max()) - t0)
                pos = t0 + np.arange(L)
                valid = pos[None, :] < lens[act][:, None]
                idx = starts[act][:, None] + np.minimum(pos[None, :], lens[act][:, None] - 1)
                flat = np.flatnonzero(valid)
                out_tokens.append(idx.reshape(-1)[flat])
                finals = [(int(j), int(segs[j])) for j in act[lens[act] <= t0 + L]]
                rows = None if len(act) == len(segs) else put(act)
                blocks.append((rows, put(idx), put(valid), put(flat), finals))
            levels.append((segs, blocks))
        out_at = put(np.concatenate(out_tokens) if out_tokens else np.zeros(0, dtype=np.int64))
        views = upload_all(arrays, device)
        self.levels: List[Tuple[np.ndarray, List[_Block]]] = [
            (segs, [_Block(None if r is None else views[r], views[i], views[v], views[f], fin)
                    for r, i, v, f, fin in blocks])
            for segs, blocks in levels]
        self.out_tokens = views[out_at]  # [T'] the token of each output row, blocks in order


def scan_plan(layout: RecurrentLayout, chunk_size: int, device: torch.device) -> ScanPlan:
    """The layout's :class:`ScanPlan` for ``chunk_size`` on ``device`` (made on first use)."""
    plans = layout.__dict__.setdefault("_scan_plans", {})
    key = (int(chunk_size), str(device))
    if key not in plans:
        plans[key] = ScanPlan(layout, chunk_size, device)
    return plans[key]


def chunked_scan(
    chunk: Chunk,
    layout: RecurrentLayout,
    state_shape: Tuple[int, ...],
    out_shape: Tuple[int, ...],
    like: torch.Tensor,
    init_state: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``chunk`` over every segment in blocks of up to ``chunk_size`` tokens, level by
    level, segments of a level in parallel; contract as :func:`segment_scan`. ``chunk``
    gets ``(states [n, ...], token indices [n, L], valid [n, L])``, where the rows of
    ``valid`` (0/1) are 1 on a prefix (the block's real tokens; the rest repeat the last one).
    The indices come from the layout's :class:`ScanPlan` (uploaded once per forward)."""
    if chunk_size < 1:
        raise ValueError(f"ssm chunk_size must be >= 1, got {chunk_size}")
    plan = scan_plan(layout, chunk_size, like.device)
    seg_parent = layout.seg_parent
    final: Dict[int, torch.Tensor] = {}
    zero = like.new_zeros(state_shape)
    out_val = []
    for segs, blocks in plan.levels:
        init = []
        for s in segs:
            p = seg_parent[s]
            init.append(final[int(p)] if p >= 0 else root_state(int(p), init_state, zero))
        S = torch.stack(init)
        for b in blocks:
            Sa, o = chunk(S if b.rows is None else S.index_select(0, b.rows), b.idx, b.valid)
            S = Sa if b.rows is None else S.index_copy(0, b.rows, Sa)
            out_val.append(o.flatten(0, 1).index_select(0, b.flat))
            for j, seg in b.finals:
                final[seg] = S[j]
    vals = torch.cat(out_val)
    out = vals.new_zeros((layout.T, *out_shape)).index_put((plan.out_tokens,), vals)
    cap = None
    if len(layout.capture):
        seg_of = np.searchsorted(layout.seg_start, layout.capture, side="right") - 1
        cap = torch.stack([final[int(s)] for s in seg_of])
    return out, cap
