"""Redundancy-free partitioned forward/backward: every token forwarded once, memory bounded.

The row is cut into partitions (:mod:`treelit.partition.plan`) and processed depth
first over the partition tree:

1. *forward* a partition with its ancestors' per-layer K/V (and, for recurrent layers,
   their boundary states) given as **leaf tensors that require grad**, gathered from the
   ancestor partitions' own leaf copies of what they produced;
2. its loss covers its own targets plus the first token of each child partition, whose
   log-prob is read from this partition's hidden state of that token's parent;
3. before a partition that is not a descendant is forwarded, the finished partitions
   are *backwarded* deepest first: ``backward([loss, K, V, ...], [1, dK, dV, ...])``
   where ``dK, dV`` are the gradients its descendants accumulated into its leaf copies.
   That relays every descendant's gradient into the partition's graph and on into its
   own ancestors' leaves.

Only partitions on the current root-to-leaf chain hold graphs. The result equals the
unpartitioned loss and gradients (tested in float64 to 1e-9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import numpy as np
import torch

from treelit.attention.base import AttentionBackend
from treelit.loss.logprobs import weighted_nll
from treelit.loss.tree import prepare_batch, tree_hidden, tree_loss
from treelit.models.context import ExternalKV
from treelit.models.decoder import output_weight
from treelit.partition.plan import PartitionPlan, plan_partitions
from treelit.tree.batch import TreeBatch, global_normalizer
from treelit.tree.token_tree import TokenTree

__all__ = ["tree_backward", "PartitionStats"]


@dataclass
class PartitionStats:
    partitions: int = 0
    token_forwards: int = 0  # tokens run through the model (== tree tokens when redundancy-free)
    tree_tokens: int = 0
    budget: Optional[int] = None
    max_chain_tokens: int = 0
    per_partition: List[int] = field(default_factory=list)


@dataclass
class _Live:
    """A forwarded partition whose backward is pending."""

    index: int
    loss: torch.Tensor
    produced: List[torch.Tensor]  # tensors in this partition's graph that descendants read ...
    leaves: List[torch.Tensor]  # ... and their detached leaf copies (descendants' grads land here)


def tree_backward(
    model,
    batch: Union[TreeBatch, TokenTree],
    aggregation: str = "token-mean",
    partition: str = "redundancy_free",
    budget_tokens: Optional[int] = None,
    *,
    normalizer: Optional[float] = None,
    attention: Union[str, AttentionBackend, None] = "auto",
    chunk_rows: Optional[int] = None,
    stats: Optional[PartitionStats] = None,
) -> float:
    """Forward and backward the SFT loss of ``batch`` (accumulating ``.grad``); return its value.

    Args:
        partition: ``redundancy_free`` (cut into partitions when the row exceeds
            ``budget_tokens``) or ``none`` (one pass).
        budget_tokens: tokens allowed along any chain of partitions (>= the longest branch).
        normalizer: the step-global normaliser Z (default: this row's own).
        stats: filled with partition counts and token-forward counts when given.
    """
    batch = prepare_batch(model, batch)
    Z = global_normalizer([batch], aggregation) if normalizer is None else float(normalizer)
    stats = stats if stats is not None else PartitionStats()
    stats.tree_tokens += batch.num_tokens
    stats.budget = budget_tokens
    if partition not in ("none", "redundancy_free"):
        raise ValueError(f"unknown partition strategy {partition!r}; known: none, redundancy_free")
    if partition == "none" or budget_tokens is None or budget_tokens >= batch.num_tokens:
        loss = tree_loss(model, batch, aggregation, attention, normalizer=Z, chunk_rows=chunk_rows)
        loss.backward()
        stats.partitions += 1
        stats.token_forwards += batch.num_tokens
        stats.max_chain_tokens = max(stats.max_chain_tokens, batch.num_tokens)
        stats.per_partition.append(batch.num_tokens)
        return float(loss.detach())
    plan = plan_partitions(batch, budget_tokens)
    return _run_plan(model, batch, plan, aggregation, Z, attention, chunk_rows, stats)


def _run_plan(model, batch: TreeBatch, plan: PartitionPlan, aggregation, Z, attention, chunk_rows, stats) -> float:
    N = batch.num_tokens
    parts = plan.partitions
    owner = np.full(N, -1, dtype=np.int64)
    local = np.full(N, -1, dtype=np.int64)
    for p in parts:
        owner[p.tokens] = p.index
        local[p.tokens] = np.arange(p.size)
    parent = batch.parent.cpu().numpy()
    W = batch.token_weights(aggregation)
    W_out = output_weight(model)
    # One gradient buffer per vocabulary-sized weight for all passes, instead of a [V, D]
    # gradient per pass kept alive along the chain (vocab x hidden dominates small trees).
    emb = model.tok_embeddings.weight
    emb_buf = torch.zeros_like(emb) if emb.requires_grad else None
    out_buf = emb_buf if W_out is emb else (torch.zeros_like(W_out) if W_out.requires_grad else None)
    kv_leaves: Dict[int, Dict[int, tuple]] = {}  # partition -> layer -> (k leaf, v leaf)
    state_leaves: Dict[int, Dict[int, Dict[str, torch.Tensor]]] = {}  # partition -> layer -> name -> [n, ...]
    boundary_slot: Dict[int, int] = {}  # child partition -> its parent token's row in the parent's captures
    chain: List[_Live] = []
    total = 0.0
    stats.max_chain_tokens = max(stats.max_chain_tokens, plan.max_chain_tokens)
    roots_of = {}  # partition -> its root token
    for p in parts:
        roots_of[p.index] = int(p.tokens[0])

    def finish(live: _Live) -> None:
        tensors, grads = [live.loss], [torch.ones_like(live.loss)]
        for t, leaf in zip(live.produced, live.leaves):
            if leaf.grad is not None:
                tensors.append(t)
                grads.append(leaf.grad)
        torch.autograd.backward(tensors, grads)
        kv_leaves.pop(live.index, None)
        state_leaves.pop(live.index, None)

    for p in parts:
        while chain and chain[-1].index != p.parent:
            finish(chain.pop())
        # ancestors of the partition's root token, in path order, each owned by a chain partition
        anc = []
        a = parent[roots_of[p.index]]
        while a >= 0:
            anc.append(a)
            a = parent[a]
        anc = np.array(anc[::-1], dtype=np.int64)
        external = None
        if len(anc):
            ks: Dict[int, List[torch.Tensor]] = {}
            vs: Dict[int, List[torch.Tensor]] = {}
            for q in np.unique(owner[anc]):  # ancestor partitions in chain (= index) order
                idx = torch.from_numpy(local[anc[owner[anc] == q]]).to(batch.device)
                for layer, (kl, vl) in kv_leaves[int(q)].items():
                    ks.setdefault(layer, []).append(kl.index_select(2, idx))
                    vs.setdefault(layer, []).append(vl.index_select(2, idx))
            E = len(anc)
            slot = boundary_slot[p.index]
            states = {
                layer: {name: t[slot] for name, t in named.items()}
                for layer, named in state_leaves.get(p.parent, {}).items()
            }
            external = ExternalKV(
                {layer: torch.cat(x, 2) for layer, x in ks.items()},
                {layer: torch.cat(x, 2) for layer, x in vs.items()},
                torch.zeros(E, dtype=torch.long, device=batch.device),
                torch.full((E,), p.size, dtype=torch.long, device=batch.device),
                state=states,
            )
        tokens = torch.from_numpy(p.tokens).to(batch.device)
        sub = batch.subset(tokens)
        # targets: own tokens with a parent inside, plus the roots of child partitions
        child_roots = [roots_of[c.index] for c in parts if c.parent == p.index]
        boundary = np.unique(local[parent[child_roots]]) if child_roots else np.zeros(0, dtype=np.int64)
        for c in parts:
            if c.parent == p.index:
                boundary_slot[c.index] = int(np.searchsorted(boundary, local[parent[roots_of[c.index]]]))
        h, ctx = tree_hidden(model, sub, attention, external=external, capture_kv=True,
                             capture_tokens=boundary if len(boundary) else None, embedding_grad_accumulator=emb_buf)
        own = torch.nonzero(sub.parent >= 0).squeeze(1)
        tgt_tok = torch.cat([tokens[own], torch.tensor(child_roots, dtype=torch.long, device=batch.device)])
        rows = torch.cat([sub.parent[own], torch.from_numpy(local[parent[child_roots]]).to(batch.device)]) if child_roots else sub.parent[own]
        w = W[tgt_tok]
        keep = w != 0
        coef = (w[keep] / Z if Z > 0 else torch.zeros_like(w[keep])).to(h.dtype)
        loss = weighted_nll(h[rows[keep]], W_out, batch.input_ids[tgt_tok[keep]], coef, chunk_rows=chunk_rows,
                            weight_grad_accumulator=out_buf)
        produced, leaves = [], []
        layer_leaves = {}
        for layer, (k, v) in ctx.captured.items():
            kl, vl = k.detach().requires_grad_(), v.detach().requires_grad_()
            layer_leaves[layer] = (kl, vl)
            produced += [k, v]
            leaves += [kl, vl]
        kv_leaves[p.index] = layer_leaves
        named_leaves: Dict[int, Dict[str, torch.Tensor]] = {}
        for layer, named in ctx.recurrent_out.items():
            named_leaves[layer] = {}
            for name, t in named.items():
                leaf = t.detach().requires_grad_()
                named_leaves[layer][name] = leaf
                produced.append(t)
                leaves.append(leaf)
        state_leaves[p.index] = named_leaves
        chain.append(_Live(p.index, loss, produced, leaves))
        total += float(loss.detach())
        stats.partitions += 1
        stats.token_forwards += p.size
        stats.per_partition.append(p.size)
    while chain:
        finish(chain.pop())
    for param, buf in ((emb, emb_buf), (W_out, out_buf if out_buf is not emb_buf else None)):
        if buf is not None:
            param.grad = buf if param.grad is None else param.grad.add_(buf)
    return total
