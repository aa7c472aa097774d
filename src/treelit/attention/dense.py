"""``sdpa_dense``: the reference tree attention backend.

Builds the boolean ``[N, E+N]`` ancestor mask from the visibility intervals
(``kv_lo <= q < kv_hi``) and calls torch's scaled-dot-product attention. Its
cost is quadratic in the row; it exists to be obviously right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treelit.attention.base import ATTENTION, AttentionBackend


@ATTENTION.register("sdpa_dense")
class DenseAttention(AttentionBackend):
    name = "sdpa_dense"
    bidirectional_blocks = True  # any interval mask (Gemma-3's image blocks)

    def plan(self, layout) -> torch.Tensor:
        return layout.dense_mask()

    def __call__(self, q, k, v, plan):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan, enable_gqa=q.shape[1] != k.shape[1])
