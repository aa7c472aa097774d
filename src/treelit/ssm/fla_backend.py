"""``ssm=fla``: the recurrences through CUDA kernels (flash-linear-attention's Triton kernels,
and mamba-ssm's for the Mamba2 mixers of transformers' hybrids).

Segments of one depth level are packed into one varlen batch (``cu_seqlens``), each
starting from its parent segment's final state (``initial_state [n, H, K, V]``), and
the kernel returns every segment's final state for the next level: one kernel call
per level of segment depth. Gated DeltaNet uses ``chunk_gated_delta_rule`` and Kimi
Delta Attention ``chunk_kda``, with the gate, beta and q/k normalisation already applied
(the tree layer computes them; grouped value heads are the kernels' own GVA); native
Mamba2 layers use ``chunk_simple_gla`` (the SSD recurrence is a simple gated linear
attention with ``q = C``, ``k = B``, ``v = dt x``, ``g = dt A``, scale 1), plus ``D x``.

transformers' Mamba2 mixers run on mamba-ssm's ``mamba_chunk_scan_combined``
(:func:`ssd_scan_mamba`). Its API takes one initial state per *batch row*
(``initial_states [b, H, P, N]``; with ``seq_idx`` the later sequences of a packed row
start from zero) and its per-sequence final states (``return_varlen_states``) have no
backward, so a level's segments run as batch rows instead, padded to the longest
segment of their length class (lengths in ``(2^(c-1), 2^c]`` share a call, so padding
at most doubles the work). Padding tokens get ``dt = 0``: no decay and no input, so
``return_final_states`` is each segment's state after its last token. dt's bias,
softplus and limits are applied before the call (the kernel gets the final dt).

The kernels are resolved by :func:`cuda_kernel` on first use; a missing package is one
line naming ``ssm=fla`` and the package. They compute in float32 internally; this
backend is checked against the exact ``torch`` backend by ``benchmarks/gpu_check.py``
and the ``cuda`` tests (tests/ssm/test_fla_backend.py, tests/models/test_hf_hybrid_fla.py),
and its level-by-level routing on CPU with plain-torch stand-ins of the kernels.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from treelit.ssm.layout import root_state
from treelit.utils.dispatch import upload_all

__all__ = ["cuda_kernel", "level_scan", "gdn_scan_fla", "kda_scan_fla", "ssd_scan_fla", "ssd_scan_mamba"]


def cuda_kernel(name: str) -> Callable:
    """The CUDA kernel ``name`` (``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_simple_gla``,
    ``mamba_chunk_scan_combined``), imported on first use. Raises ``ValueError`` naming the
    missing package."""
    try:
        if name == "chunk_gated_delta_rule":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn  # optional (treelit[cuda]): ssm=fla only
        elif name == "chunk_kda":
            from fla.ops.kda import chunk_kda as fn  # optional (treelit[cuda], Triton): ssm=fla only
        elif name == "chunk_simple_gla":
            from fla.ops.simple_gla import chunk_simple_gla as fn  # optional (treelit[cuda], Triton): ssm=fla only
        elif name == "mamba_chunk_scan_combined":
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as fn  # optional, a CUDA build
        else:
            raise KeyError(name)
    except ImportError as exc:
        package = "mamba-ssm" if name.startswith("mamba") else "flash-linear-attention"
        why = " ".join(str(exc).split())  # (one line, whatever the failed import said)
        raise ValueError(f"ssm=fla needs {package} for {name} ({why}): pip install 'treelit[cuda]'") from None
    return fn


class LevelPlan:
    """Each depth level's tokens (segments in order) and ``cu_seqlens``, planned on the host once
    per layout and uploaded in one copy (views of one buffer), shared by every recurrent layer of
    the forward; ``cu_host`` keeps the host copy for kernels that plan on it (mamba-ssm's calls)."""

    def __init__(self, layout, device: torch.device):
        toks, self.cu_host = [], []
        for segs in layout.levels:
            starts, lens = layout.seg_start[segs], layout.seg_len[segs]
            toks.append(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]))
            self.cu_host.append(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        views = upload_all(toks + self.cu_host, device)
        self.tok, self.cu = views[:len(toks)], views[len(toks):]
        self.out_tokens = torch.cat(self.tok) if toks else torch.zeros(0, dtype=torch.long, device=device)


def level_plan(layout, device: torch.device) -> LevelPlan:
    plans = layout.__dict__.setdefault("_level_plans", {})
    if str(device) not in plans:
        plans[str(device)] = LevelPlan(layout, device)
    return plans[str(device)]


def level_scan(kernel, inputs: List[torch.Tensor], layout, state_shape, init_state: Optional[torch.Tensor],
               dtype: torch.dtype = torch.float32):
    """Run ``kernel(level_inputs, h0 [n,...], cu_seqlens, cu_seqlens on the host) -> (out [T_level, ...],
    h_final [n,...])`` level by level (one call per level of segment depth; the indices from the
    layout's :class:`LevelPlan`); states are kept in ``dtype`` (the kernels' float32, or float64 for
    float64 inputs). Returns ``(out [T, ...], captured states or None)``."""
    plan = level_plan(layout, inputs[0].device)
    final: Dict[int, torch.Tensor] = {}
    zero = inputs[0].new_zeros(state_shape, dtype=dtype)
    out_val = []
    for segs, tok, cu, cu_host in zip(layout.levels, plan.tok, plan.cu, plan.cu_host):
        h0 = torch.stack([
            final[int(p)] if p >= 0 else root_state(int(p), init_state, zero).to(dtype)
            for p in layout.seg_parent[segs]
        ])
        o, hT = kernel([x.index_select(0, tok) for x in inputs], h0, cu, cu_host)
        for j, s in enumerate(segs):
            final[int(s)] = hT[j].to(dtype)
        out_val.append(o)
    vals = torch.cat(out_val)
    out = vals.new_zeros((layout.T, *vals.shape[1:])).index_put((plan.out_tokens,), vals)
    cap = None
    if len(layout.capture):
        seg_of = np.searchsorted(layout.seg_start, layout.capture, side="right") - 1
        cap = torch.stack([final[int(s)] for s in seg_of])
    return out, cap


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _delta_rule(name: str, q, k, v, beta, g, layout, init, scale) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    fn = cuda_kernel(name)

    def kernel(xs, h0, cu, cu_host):
        qq, kk, vv, bb, gg = (x[None] for x in xs)
        o, hT = fn(qq, kk, vv, gg, bb, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        return o[0].to(v.dtype), hT

    state = (v.shape[1], q.shape[2], v.shape[2])
    out, cap = level_scan(kernel, [q, k, v, beta, g], layout, state, init, _state_dtype(q))
    return out, (None if cap is None else cap.to(q.dtype))


def gdn_scan_fla(q, k, v, beta, g, layout, init, scale) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet: ``q/k [T, H, K]``, ``v [T, HV, V]``, ``beta/g [T, HV]`` (value head j reads
    q/k head ``j // (HV/H)``) -> ``(out [T, HV, V], captured [c, HV, K, V] or None)``."""
    return _delta_rule("chunk_gated_delta_rule", q, k, v, beta, g, layout, init, scale)


def kda_scan_fla(q, k, v, beta, g, layout, init, scale) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention: as :func:`gdn_scan_fla` with per-channel log-decays ``g [T, HV, K]``."""
    return _delta_rule("chunk_kda", q, k, v, beta, g, layout, init, scale)


def ssd_scan_fla(xs, dt, A, Bh, Ch, D, layout, init) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Native Mamba2 through ``chunk_simple_gla``: ``xs [T, H, P]``, ``dt [T, H]``, ``A [H]``,
    ``Bh/Ch [T, H, N]``, ``D [H] or [H, P]``."""
    fn = cuda_kernel("chunk_simple_gla")
    Dh = D[:, None] if D.dim() == 1 else D
    H, P, N = xs.shape[1], xs.shape[2], Bh.shape[2]

    def kernel(ins, h0, cu, cu_host):
        x, d, b, c = ins
        o, hT = fn(c[None], b[None], (d[..., None] * x)[None], g=(d * A)[None], scale=1.0,
                   initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True, cu_seqlens=cu)
        return o[0].to(xs.dtype), hT.transpose(-1, -2)  # fla keeps [H, K=N, V=P]; treelit [H, P, N]

    out, cap = level_scan(kernel, [xs, dt, Bh, Ch], layout, (H, P, N), init, _state_dtype(xs))
    return out + Dh * xs, (None if cap is None else cap.to(xs.dtype))


# mamba-ssm's launch limits: batch rows sit on CUDA grid axis 1 (its chunk-state kernel launches
# batch x chunks there, at most 65,535), and its kernels compute pointer offsets in int32, which overflow
# without an error past 2^31 elements of a tensor. A level's rows are split into calls below both.
MAMBA_MAX_GRID_ROWS = 65_535
MAMBA_MAX_ELEMENTS = 2**31 - 1


def _padded_dt(dt: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``dt [rows, L, H]`` with the padded slots (a row's tokens past its segment's end) set to 0: there
    exp(0 * A) = 1 keeps the state and 0 * x adds nothing, so each row's final state is its segment's."""
    return dt * valid[..., None].to(dt.dtype)


def _mamba_calls(rows: np.ndarray, length: int, chunk_size: int, H: int, P: int, G: int, N: int) -> List[np.ndarray]:
    """``rows`` (segments padded to ``length`` tokens) in groups that one mamba-ssm call can take: at most
    ``MAMBA_MAX_GRID_ROWS`` batch x chunks, and no tensor (x / y, B / C, the chunk states) of more than
    ``MAMBA_MAX_ELEMENTS`` elements."""
    chunks = -(-length // chunk_size)
    per_row = max(length * H * P, length * G * N, chunks * H * P * N)
    if per_row > MAMBA_MAX_ELEMENTS or chunks > MAMBA_MAX_GRID_ROWS:
        raise ValueError(f"ssm=fla: a {length}-token segment is too long for one mamba-ssm call (its int32 offsets "
                         f"and grid limit); partition the tree (partition=redundancy_free) or use ssm=torch")
    per_call = max(1, min(MAMBA_MAX_ELEMENTS // per_row, MAMBA_MAX_GRID_ROWS // chunks))
    return [rows[i:i + per_call] for i in range(0, len(rows), per_call)]


def ssd_scan_mamba(x, dt, A, B, C, D, layout, init, chunk_size: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Mamba2 through mamba-ssm's ``mamba_chunk_scan_combined`` (module docs): ``x [T, H, P]``,
    ``dt [T, H]`` (final: bias, softplus and limits applied), ``A [H]``, ``B/C [T, G, N]`` (head h
    reads group ``h // (H/G)``), ``D [H] or [H, P]`` -> ``(y [T, H, P], captured [c, H, P, N] or None)``."""
    fn = cuda_kernel("mamba_chunk_scan_combined")
    Dh = D[:, None] if D.dim() == 1 else D
    H, P, N = x.shape[1], x.shape[2], B.shape[2]

    def kernel(ins, h0, cu, cu_h):
        xx, dd, bb, cc = ins
        dev = xx.device
        starts, lens = cu_h[:-1], np.diff(cu_h)
        size_class = np.ceil(np.log2(lens)).astype(np.int64)
        out_idx, out_val, seg_idx, seg_val = [], [], [], []
        for c in np.unique(size_class):
            same = np.flatnonzero(size_class == c)
            for rows in _mamba_calls(same, int(lens[same].max()), chunk_size, H, P, bb.shape[1], N):
                n = lens[rows]
                pos = np.arange(int(n.max()))
                valid_np = pos[None, :] < n[:, None]
                idx = torch.from_numpy(starts[rows][:, None] + np.minimum(pos[None, :], n[:, None] - 1)).to(dev)
                valid = torch.from_numpy(valid_np).to(dev)
                rows_t = torch.from_numpy(rows).to(dev)
                y, hT = fn(xx[idx], _padded_dt(dd[idx], valid), A, bb[idx], cc[idx], chunk_size,
                           initial_states=h0[rows_t], return_final_states=True)
                out_idx.append(idx[valid])
                out_val.append(y[valid])
                seg_idx.append(rows_t)
                seg_val.append(hT)
        o = torch.cat(out_val)
        o = o.new_zeros((xx.shape[0], *o.shape[1:])).index_put((torch.cat(out_idx),), o)
        order = torch.empty_like(torch.cat(seg_idx))
        order[torch.cat(seg_idx)] = torch.arange(len(order), device=dev)
        return o.to(x.dtype), torch.cat(seg_val).index_select(0, order)

    out, cap = level_scan(kernel, [x, dt, B, C], layout, (H, P, N), init, _state_dtype(x))
    return out + Dh * x, (None if cap is None else cap.to(x.dtype))
