"""``ssm=fla``: the recurrences through flash-linear-attention's Triton kernels (CUDA only).

Segments of one depth level are packed into one varlen batch (``cu_seqlens``), each
starting from its parent segment's final state (``initial_state [n, H, K, V]``), and
the kernel returns every segment's final state for the next level: one kernel call
per level of segment depth. Gated DeltaNet uses ``chunk_gated_delta_rule`` with the
gate, beta and q/k normalisation already applied (the tree layer computes them);
Mamba2 uses ``chunk_simple_gla`` (the SSD recurrence is a simple gated linear
attention with ``q = C``, ``k = B``, ``v = dt x``, ``g = dt A``, scale 1), plus ``D x``.

fla's kernels compute in float32 internally; this backend is checked against the
exact ``torch`` backend by ``benchmarks/gpu_check_ssm.py`` and the ``cuda`` tests.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["gdn_scan_fla", "ssd_scan_fla", "level_scan"]


def level_scan(kernel, inputs: List[torch.Tensor], layout, state_shape, init_state: Optional[torch.Tensor]):
    """Run ``kernel(level_inputs, h0 [n,...], cu_seqlens) -> (out [T_level, ...], h_final [n,...])``
    level by level. Returns ``(out [T, ...], captured states or None)``."""
    dev = inputs[0].device
    final: Dict[int, torch.Tensor] = {}
    zero = inputs[0].new_zeros(state_shape, dtype=torch.float32)
    out_idx, out_val = [], []
    for segs in layout.levels:
        starts, lens = layout.seg_start[segs], layout.seg_len[segs]
        tok = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])).to(dev)
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])).to(dev, torch.long)
        h0 = torch.stack([
            final[int(p)] if p >= 0 else (init_state.float() if p == -2 and init_state is not None else zero)
            for p in layout.seg_parent[segs]
        ])
        o, hT = kernel([x[tok] for x in inputs], h0, cu)
        for j, s in enumerate(segs):
            final[int(s)] = hT[j]
        out_idx.append(tok)
        out_val.append(o)
    idx = torch.cat(out_idx)
    vals = torch.cat(out_val)
    out = vals.new_zeros((layout.T, *vals.shape[1:])).index_put((idx,), vals)
    cap = None
    if len(layout.capture):
        seg_of = np.searchsorted(layout.seg_start, layout.capture, side="right") - 1
        cap = torch.stack([final[int(s)] for s in seg_of])
    return out, cap


def gdn_scan_fla(q, k, v, beta, g, layout, init, scale) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional (treelit[cuda], Triton): ssm=fla only

    def kernel(xs, h0, cu):
        qq, kk, vv, bb, gg = (x[None] for x in xs)
        o, hT = chunk_gated_delta_rule(qq, kk, vv, gg, bb, scale=scale, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu)
        return o[0].to(v.dtype), hT

    out, cap = level_scan(kernel, [q, k, v, beta, g], layout, (q.shape[1], q.shape[2], v.shape[2]), init)
    return out, (None if cap is None else cap.to(q.dtype))


def ssd_scan_fla(xs, dt, A, Bh, Ch, D, layout, init) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    from fla.ops.simple_gla import chunk_simple_gla  # optional (treelit[cuda], Triton): ssm=fla only

    Dh = D[:, None] if D.dim() == 1 else D
    H, P, N = xs.shape[1], xs.shape[2], Bh.shape[2]

    def kernel(ins, h0, cu):
        x, d, b, c = ins
        o, hT = chunk_simple_gla(c[None], b[None], (d[..., None] * x)[None], g=(d * A)[None], scale=1.0,
                                 initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True, cu_seqlens=cu)
        return o[0].to(xs.dtype), hT.transpose(-1, -2)  # fla keeps [H, K=N, V=P]; treelit [H, P, N]

    init_t = None if init is None else init
    out, cap = level_scan(kernel, [xs, dt, Bh, Ch], layout, (H, P, N), init_t)
    return out + Dh * xs, (None if cap is None else cap.to(xs.dtype))
