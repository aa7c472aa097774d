"""``segment``: exact tree attention at the cost of sum over segments of (length x path).

A dense ancestor mask makes a wide tree more expensive than its branches: sixteen
1,024-token branches under a 512-token prefix pack into 8,704 tree tokens, and a
dense mask over them costs about 4.5x the attention of the sixteen causal branches.
The optimal exact cost is the sum over segments of (segment length x length of its
root-to-segment path), because a segment's queries see exactly its path.

This backend computes exactly that. Each segment is cut into query chunks of at most
``chunk`` tokens; a chunk attends to the external keys visible to it, its ancestor
segments and its own segment up to the chunk's end. Chunks are grouped into buckets of
similar (query length, key length), gathered into padded ``[n, H, Lq, D]`` /
``[n, Hkv, Lk, D]`` blocks with a small boolean mask (causal inside the own segment,
padding off), and run through torch's SDPA, one call per bucket per layer. Nothing is
ever N x N. The plan (index and mask tensors) is built once per forward and shared by
all layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from treelit.attention.base import ATTENTION, AttentionBackend


@dataclass
class _Bucket:
    q_idx: torch.Tensor  # [n * Lq] row-token index per padded query slot
    k_idx: torch.Tensor  # [n * Lk] key index (into the E + N keys) per padded key slot
    mask: torch.Tensor  # [n, 1, Lq, Lk] bool
    n: int
    lq: int
    lk: int
    keep: torch.Tensor  # positions (into n * Lq) of real queries


@dataclass
class SegmentPlan:
    buckets: List[_Bucket]
    order: torch.Tensor  # inverse permutation: concatenated real query rows -> row order
    cost: int  # sum of padded Lq * Lk over buckets (attention work per head)
    exact_cost: int  # sum over chunks of real query x key pairs computed


def _round_up(n: int, minimum: int = 16) -> int:
    """Round up with at most ~25% padding (4 bins per power of two)."""
    if n <= minimum:
        return minimum
    g = 1 << max(0, int(math.floor(math.log2(n))) - 2)
    return int(math.ceil(n / g) * g)


@ATTENTION.register("segment")
class SegmentAttention(AttentionBackend):
    """Exact tree attention over segments (CPU and CUDA; no N x N tensors).

    Args:
        chunk: maximum queries per block; long segments are cut into chunks so that the
            causal part of a block wastes at most about half a chunk of keys.
    """

    name = "segment"

    def __init__(self, chunk: int = 512) -> None:
        if chunk < 1:
            raise ValueError(f"segment attention chunk must be >= 1, got {chunk}")
        self.chunk = int(chunk)

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

        # Ancestor key indices of every segment (parents precede children in DFS order).
        anc: List[np.ndarray] = [None] * len(seg_start)  # type: ignore[list-item]
        for s in range(len(seg_start)):
            p = seg_parent[s]
            if p < 0:
                anc[s] = np.zeros(0, dtype=np.int64)
            else:
                own_p = np.arange(seg_start[p], seg_start[p] + seg_len[p], dtype=np.int64) + E
                anc[s] = np.concatenate([anc[p], own_p])

        units: Dict[Tuple[int, int], List[Tuple[int, int, np.ndarray]]] = {}
        exact = 0
        for s in range(len(seg_start)):
            a, L = int(seg_start[s]), int(seg_len[s])
            if E:
                vis = np.flatnonzero((ext_lo <= a + L - 1) & (ext_hi > a))
                base = np.concatenate([vis.astype(np.int64), anc[s]])
            else:
                base = anc[s]
            for q0 in range(a, a + L, self.chunk):
                q1 = min(a + L, q0 + self.chunk)
                keys = np.concatenate([base, np.arange(a, q1, dtype=np.int64) + E])
                key = (_round_up(q1 - q0, 1), _round_up(len(keys)))
                units.setdefault(key, []).append((q0, q1, keys))
                exact += (q1 - q0) * len(base) + (q1 - q0) * (q1 - q0 + 1) // 2 + (q1 - q0) * (q0 - a)

        buckets, rows, cost = [], [], 0
        for (lq, lk), group in sorted(units.items()):
            n = len(group)
            q_idx = np.zeros((n, lq), dtype=np.int64)
            k_idx = np.zeros((n, lk), dtype=np.int64)
            q_valid = np.zeros((n, lq), dtype=bool)
            k_valid = np.zeros((n, lk), dtype=bool)
            for r, (q0, q1, keys) in enumerate(group):
                q_idx[r, : q1 - q0] = np.arange(q0, q1)
                q_valid[r, : q1 - q0] = True
                k_idx[r, : len(keys)] = keys
                k_valid[r, : len(keys)] = True
            qpos = q_idx[:, :, None]
            mask = (kv_lo[k_idx][:, None, :] <= qpos) & (qpos < kv_hi[k_idx][:, None, :])
            mask &= q_valid[:, :, None] & k_valid[:, None, :]
            mask[~q_valid, 0] = True  # padded queries attend to one key: finite, then dropped
            keep = np.flatnonzero(q_valid.reshape(-1))
            rows.append(q_idx.reshape(-1)[keep])
            buckets.append(
                _Bucket(
                    q_idx=torch.from_numpy(q_idx.reshape(-1)).to(dev),
                    k_idx=torch.from_numpy(k_idx.reshape(-1)).to(dev),
                    mask=torch.from_numpy(mask[:, None]).to(dev),
                    n=n,
                    lq=lq,
                    lk=lk,
                    keep=torch.from_numpy(keep).to(dev),
                )
            )
            cost += n * lq * lk
        all_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        order = np.empty_like(all_rows)
        order[all_rows] = np.arange(len(all_rows))
        return SegmentPlan(buckets, torch.from_numpy(order).to(dev), cost, exact)

    # compute -------------------------------------------------------------------------
    def __call__(self, q, k, v, plan: SegmentPlan):
        _, Hq, N, D = q.shape
        Hkv = k.shape[1]
        q0, k0, v0 = q[0], k[0], v[0]  # [H, tokens, D]
        outs = []
        for b in plan.buckets:
            qb = q0.index_select(1, b.q_idx).view(Hq, b.n, b.lq, D).transpose(0, 1)
            kb = k0.index_select(1, b.k_idx).view(Hkv, b.n, b.lk, D).transpose(0, 1)
            vb = v0.index_select(1, b.k_idx).view(Hkv, b.n, b.lk, D).transpose(0, 1)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, enable_gqa=Hq != Hkv)
            ob = ob.transpose(0, 1).reshape(Hq, b.n * b.lq, D)
            outs.append(ob.index_select(1, b.keep))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return out.index_select(1, plan.order).unsqueeze(0)
