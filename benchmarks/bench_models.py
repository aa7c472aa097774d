"""Benchmark models and the compute-weighted ideal speedup.

The default step-benchmark model has the cost shape of a real checkpoint: Qwen2.5-0.5B
spends ``d x V`` = 136M multiply-adds per trained token on its vocabulary head and 358M
per token on its 24 layers (head/trunk 0.38). ``realistic`` (dim 512, 8 layers, 8 heads
with 2 KV heads, MLP 2816, vocab 32768) keeps that ratio (0.42) at a size two CPU cores
can step through. ``head_heavy`` is the earlier tiny model (dim 64, 4 layers, vocab
32768: head ~10x its trunk), kept for comparison.

Tree mode saves trunk work on shared tokens but the head works per trained token, and
a target that belongs to one branch (each model call trains its own output) is not
shared. So flat/tree tokens overstates what sharing can buy. The *compute-weighted
ideal* is the ratio of the floating-point operations the two modes must do at least
(forward and backward = 3x forward):

* trunk: ``2 * P_trunk`` per token (linear layers: attention projections, MLPs,
  recurrent-layer projections);
* attention: ``4 * H * d_head`` per visible (query, key) pair and attention layer
  (scores and weighted values); pairs per branch ``L (L + 1) / 2``, per tree token its
  depth + 1;
* head: ``2 * d * V`` per target row (per branch: its masked targets; tree: one row per
  distinct target token).

The recurrent scans (``O(state)`` per token) and element-wise work are left out.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch

import treelit

PRESETS = {
    "realistic": dict(dim=512, layers=8, heads=8, kv_heads=2, intermediate=2816, vocab=32768),
    "head_heavy": dict(dim=64, layers=4, heads=4, kv_heads=2, intermediate=192, vocab=32768),
}


def attention_model(dim, layers, heads, kv_heads, intermediate, vocab, max_seq_len=32768) -> treelit.TreeDecoder:
    torch.manual_seed(0)
    return treelit.build_decoder(family="qwen2", vocab_size=vocab, num_layers=layers, num_heads=heads,
                                 num_kv_heads=kv_heads, embed_dim=dim, intermediate_dim=intermediate,
                                 max_seq_len=max_seq_len)


def hybrid_model(dim, layers, heads, kv_heads, intermediate, vocab, max_seq_len=32768) -> treelit.TreeDecoder:
    """Gated DeltaNet / attention / Mamba2 / Gated DeltaNet, repeated to ``layers`` layers,
    every layer with an MLP (a Qwen3-Next-like mix of recurrent and attention layers)."""
    pattern = ["gdn", "attention", "mamba2", "gdn"]
    torch.manual_seed(0)
    hd = dim // heads
    return treelit.build_model(
        "hybrid_tiny", vocab_size=vocab, embed_dim=dim, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_dim=intermediate, max_seq_len=max_seq_len,
        layer_types=[pattern[i % len(pattern)] for i in range(layers)],
        recurrent={"gdn": {"head_dim": hd, "num_heads": heads // 2, "num_v_heads": heads, "expand_v": 1.0, "conv_size": 4},
                   "mamba2": {"head_dim": hd, "state_size": 64, "n_groups": 1, "expand": 2, "conv_kernel": 4, "mlp": True}},
    )


def cost_model(model: treelit.TreeDecoder) -> Dict[str, float]:
    """FLOPs (forward + backward) per token, per attention pair, per target row."""
    c = model.config
    trunk = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() >= 2)
    n_attn = sum(1 for i in range(c.num_layers) if c.layer_type(i) == "attention")
    return {
        "per_token": 3 * 2.0 * trunk,
        "per_pair": 3 * 4.0 * c.num_heads * c.head_dim * n_attn,
        "per_target": 3 * 2.0 * c.embed_dim * c.vocab_size,
        "trunk_params": float(trunk),
        "head_over_trunk": c.embed_dim * c.vocab_size / trunk,
    }


def branch_targets(masks: Sequence[Sequence[int]], weights=None) -> int:
    w = weights if weights is not None else [1.0] * len(masks)
    return int(sum(sum(1 for v in m[1:] if v) for m, x in zip(masks, w) if x > 0))


def compute_weighted_ideal(cost: Dict[str, float], branches: List[List[int]], masks, batch: treelit.TreeBatch,
                           aggregation: str = "token-mean") -> Dict[str, float]:
    """Work of per-branch training over work of the tree step (see the module docstring)."""
    lengths = np.array([len(b) for b in branches], dtype=np.float64)
    pairs_flat = float((lengths * (lengths + 1) / 2).sum())
    targets_flat = branch_targets(masks)
    flat = cost["per_token"] * lengths.sum() + cost["per_pair"] * pairs_flat + cost["per_target"] * targets_flat
    W = batch.token_weights(aggregation)
    tree_targets = int(((W != 0) & (batch.parent >= 0)).sum())
    pairs = float((batch.position_ids.double() + 1).sum())
    tree = cost["per_token"] * batch.num_tokens + cost["per_pair"] * pairs + cost["per_target"] * tree_targets
    return {"ideal_compute": flat / tree, "flops_flat": flat, "flops_tree": tree,
            "targets_flat": targets_flat, "targets_tree": tree_targets,
            "pairs_flat": pairs_flat, "pairs_tree": pairs}
