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

These are the references (``ssm=torch``); faster backends are tested against them.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from treelit.ssm.layout import RecurrentLayout

__all__ = ["segment_scan", "gdn_step", "ssd_step"]

Step = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


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

    Returns ``(outputs [T, *out_shape], captured [len(layout.capture), *state_shape] or None)``:
    the states right after each token of ``layout.capture`` (which the layout made segment ends).
    """
    dev = like.device
    seg_start, seg_len, seg_parent = layout.seg_start, layout.seg_len, layout.seg_parent
    final: Dict[int, torch.Tensor] = {}
    zero = like.new_zeros(state_shape)
    out_idx, out_val = [], []
    for segs in layout.levels:
        starts = torch.from_numpy(seg_start[segs]).to(dev)
        lens = seg_len[segs]
        init = []
        for s in segs:
            p = seg_parent[s]
            init.append(final[int(p)] if p >= 0 else (init_state if (p == -2 and init_state is not None) else zero))
        S = torch.stack(init)
        for t in range(int(lens.max())):
            act = np.flatnonzero(lens > t)
            full = len(act) == len(segs)
            act_t = torch.from_numpy(act).to(dev)
            idx = starts[act_t] + t
            Sa, o = step(S if full else S[act_t], idx)
            S = Sa if full else S.index_copy(0, act_t, Sa)
            out_idx.append(idx)
            out_val.append(o)
            for j in act[lens[act] == t + 1]:
                final[int(segs[j])] = S[j]
    idx = torch.cat(out_idx)
    vals = torch.cat(out_val)
    out = vals.new_zeros((layout.T, *out_shape)).index_put((idx,), vals)
    cap = None
    if len(layout.capture):
        seg_of = np.searchsorted(seg_start, layout.capture, side="right") - 1
        cap = torch.stack([final[int(s)] for s in seg_of])
    return out, cap
