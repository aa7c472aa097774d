"""``flex``: tree attention with PyTorch FlexAttention (CUDA).

The mask is the ancestor relation itself, as a ``mask_mod``:
``visible(q, kv) = kv_lo[kv] <= q < kv_hi[kv]`` (``kv_lo = kv``, ``kv_hi =
subtree_end`` for the row's own keys; external ancestor keys come first with their
own intervals). The ``BlockMask`` is built directly from per-block interval bounds:
a (query block, key block) pair is *skipped* when no key of the block can be seen by
any query of the block, *full* when every key is seen by every query, and *partial*
otherwise (the mask_mod then decides per element). Only ``[num_q_blocks,
num_kv_blocks]`` tensors are formed, never an N x N one.

With a sliding window the mask_mod also requires ``q_pos[q] - kv_pos[kv] < window``, and
the block classification uses each block's position range (a pair of blocks is skipped
when even its closest positions are out of the window, full only when its farthest are
within it).

FlexAttention's fused kernels (forward and backward) need CUDA; on CPU only an
unfused forward exists, so choosing this backend on CPU fails at configuration time.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from treelit.attention.base import ATTENTION, AttentionBackend


def tree_block_mask(kv_lo: torch.Tensor, kv_hi: torch.Tensor, num_queries: int, block_size: int = 128,
                    q_pos: torch.Tensor = None, kv_pos: torch.Tensor = None, window: int = None):
    """A FlexAttention ``BlockMask`` for queries ``0..num_queries-1`` over keys with
    visibility intervals ``[kv_lo, kv_hi)`` (and, with ``window``, positions within it)."""
    dev = kv_lo.device
    N, KV, bs = num_queries, kv_lo.shape[0], block_size
    Qb, Kb = math.ceil(N / bs), math.ceil(KV / bs)
    pad = Kb * bs - KV
    big = torch.iinfo(torch.long).max // 2
    lo = torch.cat([kv_lo, torch.full((pad,), big, dtype=torch.long, device=dev)]).view(Kb, bs)
    hi = torch.cat([kv_hi, torch.zeros(pad, dtype=torch.long, device=dev)]).view(Kb, bs)
    i0 = torch.arange(Qb, device=dev)[:, None] * bs
    i1 = torch.clamp(i0 + bs, max=N)
    some = (lo.amin(1)[None, :] <= i1 - 1) & (hi.amax(1)[None, :] > i0)
    full = (lo.amax(1)[None, :] <= i0) & (hi.amin(1)[None, :] >= i1)
    if window is not None:
        qpad = Qb * bs - N
        qp = torch.cat([q_pos, q_pos[-1:].expand(qpad)]).view(Qb, bs)
        kp_lo = torch.cat([kv_pos, torch.full((pad,), big, dtype=torch.long, device=dev)]).view(Kb, bs)
        kp_hi = torch.cat([kv_pos, torch.full((pad,), -big, dtype=torch.long, device=dev)]).view(Kb, bs)
        some &= (qp.amin(1)[:, None] - kp_hi.amax(1)[None, :]) < window
        full &= (qp.amax(1)[:, None] - kp_lo.amin(1)[None, :]) < window
    partial = some & ~full

    def ordered(m: torch.Tensor):
        num = m.sum(-1).to(torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None, None], idx[None, None]

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)

    if window is None:
        def mask_mod(b, h, q_idx, kv_idx_):
            return (kv_lo[kv_idx_] <= q_idx) & (q_idx < kv_hi[kv_idx_])
    else:
        def mask_mod(b, h, q_idx, kv_idx_):
            near = (q_pos[q_idx] - kv_pos[kv_idx_]) < window
            return (kv_lo[kv_idx_] <= q_idx) & (q_idx < kv_hi[kv_idx_]) & near

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(N, KV)
    )


@ATTENTION.register("flex")
class FlexTreeAttention(AttentionBackend):
    """Tree attention through FlexAttention's fused CUDA kernels.

    Args:
        block_size: FlexAttention block size (128 by default).
        compile: run ``torch.compile(flex_attention)`` (required for fused kernels).
    """

    name = "flex"
    requires_cuda = True
    bidirectional_blocks = True  # the mask_mod and the block bounds read any interval (Gemma-3's image blocks)

    def __init__(self, block_size: int = 128, compile: bool = True) -> None:
        self.block_size = int(block_size)
        self.compile = compile
        self._fn = None

    def plan(self, layout):
        if layout.window is None:
            return tree_block_mask(layout.kv_lo, layout.kv_hi, layout.num_queries, self.block_size)
        return tree_block_mask(layout.kv_lo, layout.kv_hi, layout.num_queries, self.block_size,
                               q_pos=layout.q_pos, kv_pos=layout.kv_pos, window=layout.window)

    def _flex(self):
        if self._fn is None:
            self._fn = torch.compile(flex_attention, dynamic=True) if self.compile else flex_attention
        return self._fn

    def __call__(self, q, k, v, plan):
        return self._flex()(q, k, v, block_mask=plan, enable_gqa=q.shape[1] != k.shape[1])
