"""``segment``: exact tree attention at the cost of sum over segments of (length x path).

A dense ancestor mask makes a wide tree more expensive than its branches: sixteen
1,024-token branches under a 512-token prefix pack into 8,704 tree tokens, and a
dense mask over them costs about 4.5x the attention of the sixteen causal branches.
The optimal exact cost is the sum over segments of (segment length x length of its
root-to-segment path), because a segment's queries see exactly that path.

This backend computes exactly that, with no N x N tensor anywhere:

* Each segment is cut into query *units* of at most ``chunk`` tokens. A unit's keys
  are the external keys visible to it, its ancestor segments, and its own segment up
  to the unit's last query; its mask is then always the same shape: every key is
  visible except a lower-right causal triangle over the unit's own queries.
* Units with equal (queries, keys) sizes are batched into one SDPA call per layer.
  Their mask is a strided *view* into one shared ``[chunk, chunk + max_prefix]``
  bias, so masks cost no memory per unit (a square unit uses ``is_causal``, a
  one-query unit needs no mask).
* Units whose external keys are visible to only part of their queries (possible only
  with unusual external layouts) fall back to explicit per-unit masks.

The plan (gather indices, masks) is built once per forward and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from treelit.attention.base import ATTENTION, AttentionBackend


@dataclass
class _Group:
    q_idx: torch.Tensor  # [n * lq] row-token index of each query slot
    k_idx: torch.Tensor  # [n * lk] key index (into the E + N keys) of each key slot
    n: int
    lq: int
    lk: int
    keep: Optional[torch.Tensor] = None  # real query slots (irregular groups only)
    mask: Optional[torch.Tensor] = None  # [n, 1, lq, lk] bool (irregular groups only)


@dataclass
class SegmentPlan:
    groups: List[_Group]
    order: torch.Tensor  # concatenated group outputs -> row order
    max_q: int
    max_prefix: int
    cost: int  # query x key pairs computed (per head and layer), padding included
    exact_cost: int  # pairs that are visible: the sum over tokens of their depth + 1
    _bias: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def lower_right_bias(self, dtype: torch.dtype, device: torch.device, lq: int, lk: int) -> Optional[torch.Tensor]:
        """``[lq, lk]`` additive bias: key j visible to query i iff ``j <= lk - lq + i``."""
        if lq == 1:
            return None
        key = (dtype, device)
        G = self._bias.get(key)
        if G is None:
            rows = torch.arange(self.max_q, device=device)[:, None]
            cols = torch.arange(self.max_q + self.max_prefix, device=device)[None, :]
            zero = torch.zeros((), dtype=dtype, device=device)
            G = torch.where(cols <= self.max_prefix + rows, zero, torch.finfo(dtype).min)
            self._bias[key] = G
        start = self.max_prefix - (lk - lq)
        return G[:lq, start : start + lk]


@ATTENTION.register("segment")
class SegmentAttention(AttentionBackend):
    """Exact tree attention over segments (CPU and CUDA; no N x N tensors).

    Args:
        chunk: maximum queries per unit. Long segments are cut into units so that the
            causal triangle inside a unit (computed, then masked) stays small.
    """

    name = "segment"

    def __init__(self, chunk: int = 512) -> None:
        if chunk < 1:
            raise ValueError(f"segment attention chunk must be >= 1, got {chunk}")
        self.chunk = int(chunk)

    def __repr__(self) -> str:
        return f"SegmentAttention(chunk={self.chunk})"

    # planning ------------------------------------------------------------------------
    def plan(self, layout) -> SegmentPlan:
        batch = layout.batch
        dev = layout.kv_lo.device
        E = layout.num_external
        seg_start = batch.seg_start.cpu().numpy()
        seg_len = batch.seg_len.cpu().numpy()
        seg_parent = batch.seg_parent.cpu().numpy()
        kv_lo = layout.kv_lo.cpu().numpy()
        kv_hi = layout.kv_hi.cpu().numpy()
        ext_lo, ext_hi = kv_lo[:E], kv_hi[:E]

        regular: Dict[Tuple[int, int], List[Tuple[int, int, np.ndarray]]] = {}
        irregular: List[Tuple[int, int, np.ndarray]] = []
        anc: List[np.ndarray] = []  # ancestor key indices per segment (parents come first)
        exact = 0
        for s in range(len(seg_start)):
            p = seg_parent[s]
            if p < 0:
                anc.append(np.zeros(0, dtype=np.int64))
            else:
                own_p = np.arange(seg_start[p], seg_start[p] + seg_len[p], dtype=np.int64) + E
                anc.append(np.concatenate([anc[p], own_p]))
            a, L = int(seg_start[s]), int(seg_len[s])
            if E:
                touches = (ext_lo < a + L) & (ext_hi > a)
                full = touches & (ext_lo <= a) & (ext_hi >= a + L)
                base = np.concatenate([np.flatnonzero(touches).astype(np.int64), anc[s]])
                partial = bool((touches & ~full).any())
            else:
                base, partial = anc[s], False
            for q0 in range(a, a + L, self.chunk):
                q1 = min(a + L, q0 + self.chunk)
                keys = np.concatenate([base, np.arange(a, q1, dtype=np.int64) + E])
                lq = q1 - q0
                exact += lq * (len(base) + q0 - a) + lq * (lq + 1) // 2
                if partial:
                    irregular.append((q0, q1, keys))
                else:
                    regular.setdefault((lq, len(keys)), []).append((q0, q1, keys))

        groups, rows, cost, max_q, max_prefix = [], [], 0, 1, 0
        for (lq, lk), units in sorted(regular.items()):
            n = len(units)
            q_idx = np.concatenate([np.arange(q0, q1) for q0, q1, _ in units])
            k_idx = np.concatenate([keys for _, _, keys in units])
            rows.append(q_idx)
            groups.append(_Group(torch.from_numpy(q_idx).to(dev), torch.from_numpy(k_idx).to(dev), n, lq, lk))
            cost += n * lq * lk
            max_q, max_prefix = max(max_q, lq), max(max_prefix, lk - lq)
        if irregular:
            g, r = _irregular_group(irregular, kv_lo, kv_hi, dev)
            groups.append(g)
            rows.append(r)
            cost += g.n * g.lq * g.lk
        all_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        order = np.empty_like(all_rows)
        order[all_rows] = np.arange(len(all_rows))
        return SegmentPlan(groups, torch.from_numpy(order).to(dev), max_q, max_prefix, cost, exact)

    # compute -------------------------------------------------------------------------
    def __call__(self, q, k, v, plan: SegmentPlan):
        _, Hq, N, D = q.shape
        Hkv = k.shape[1]
        gqa = Hq != Hkv
        q0, k0, v0 = q[0], k[0], v[0]  # [H, tokens, D]
        outs = []
        for g in plan.groups:
            qb = q0.index_select(1, g.q_idx).view(Hq, g.n, g.lq, D).transpose(0, 1)
            kb = k0.index_select(1, g.k_idx).view(Hkv, g.n, g.lk, D).transpose(0, 1)
            vb = v0.index_select(1, g.k_idx).view(Hkv, g.n, g.lk, D).transpose(0, 1)
            if g.mask is not None:
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, enable_gqa=gqa)
            elif g.lq == g.lk:
                ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)
            else:
                bias = plan.lower_right_bias(q.dtype, q.device, g.lq, g.lk)
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, enable_gqa=gqa)
            ob = ob.transpose(0, 1).reshape(Hq, g.n * g.lq, D)
            outs.append(ob if g.keep is None else ob.index_select(1, g.keep))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return out.index_select(1, plan.order).unsqueeze(0)


def _irregular_group(units, kv_lo, kv_hi, dev) -> Tuple[_Group, np.ndarray]:
    """Pad units to a common size and mask each pair by the visibility intervals."""
    n = len(units)
    lq = max(q1 - q0 for q0, q1, _ in units)
    lk = max(len(keys) for _, _, keys in units)
    q_idx = np.zeros((n, lq), dtype=np.int64)
    k_idx = np.zeros((n, lk), dtype=np.int64)
    q_valid = np.zeros((n, lq), dtype=bool)
    k_valid = np.zeros((n, lk), dtype=bool)
    for r, (q0, q1, keys) in enumerate(units):
        q_idx[r, : q1 - q0] = np.arange(q0, q1)
        q_valid[r, : q1 - q0] = True
        k_idx[r, : len(keys)] = keys
        k_valid[r, : len(keys)] = True
    qpos = q_idx[:, :, None]
    mask = (kv_lo[k_idx][:, None, :] <= qpos) & (qpos < kv_hi[k_idx][:, None, :])
    mask &= q_valid[:, :, None] & k_valid[:, None, :]
    mask[~q_valid, 0] = True  # padded queries attend to one key: finite, then dropped
    keep = np.flatnonzero(q_valid.reshape(-1))
    group = _Group(
        torch.from_numpy(q_idx.reshape(-1)).to(dev),
        torch.from_numpy(k_idx.reshape(-1)).to(dev),
        n,
        lq,
        lk,
        keep=torch.from_numpy(keep).to(dev),
        mask=torch.from_numpy(mask[:, None]).to(dev),
    )
    return group, q_idx.reshape(-1)[keep]
