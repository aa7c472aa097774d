"""One partition's forward pass: ancestors' K/V and states in, hidden states and captures out.

A partition is forwarded with its ancestors' per-layer K/V (and, for recurrent layers,
their boundary state and convolution context) as *external* inputs. In a gradient pass
those inputs are leaf copies that require grad, so that the partition's backward leaves
their gradients there for the ancestor partition to relay into its own graph; in a
no-gradient pass they are plain tensors. A partition's targets are its own tokens whose
parent lies inside it, plus the first token of each child partition, whose log-prob is
read from this partition's hidden state of that token's parent.

An *empty pass* (two tokens, no target) runs every block of the model and contributes
nothing: ranks use it to take part in the collectives of a pass they have no work for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from treelit.attention.base import resolve_backend
from treelit.models.context import ExternalKV, TreeContext
from treelit.models.forward import decoder_hidden
from treelit.partition.plan import Partition, PartitionPlan
from treelit.tree.batch import TreeBatch
from treelit.tree.token_tree import TokenTree

__all__ = ["RowPlan", "whole_row_plan", "empty_row", "Captures", "forward_partition"]


def whole_row_plan(batch: TreeBatch) -> PartitionPlan:
    """The trivial plan: the whole row is one pass."""
    N = batch.num_tokens
    part = Partition(0, -1, list(range(batch.num_segments)), np.arange(N), 0)
    longest = int(batch.position_ids.max()) + 1 if N else 0
    return PartitionPlan([part], N, N, longest)


def empty_row(device, like: Optional[TreeBatch] = None) -> TreeBatch:
    """A two-token row without targets (an empty pass); with ``like`` given, its recorded MoE
    routing has ``like``'s shape and no entry (routing replay: the row's tokens route live)."""
    row = TokenTree.from_branches([[0, 0]], loss_masks=[[0, 0]]).to_batch()
    routing = getattr(like, "token_routing", None)
    if routing is not None:
        row.token_routing = torch.full((2, *routing.shape[1:]), -1, dtype=torch.long)
    return row.to(device)


@dataclass
class Captures:
    """What a forwarded partition hands its descendants: per attention layer ``(k, v)``
    ``[1, Hkv, n, D]`` over its tokens (under context parallelism a
    :class:`~treelit.partition.context_parallel.KVShard`: the rank's own rows of them), per
    recurrent layer named states ``[slots, ...]`` at its boundary tokens (one slot per distinct
    parent token of a child partition)."""

    kv: Dict[int, Any]
    states: Dict[int, Dict[str, torch.Tensor]]


@dataclass
class ShardedRows:
    """A pass's ancestors' K/V for one attention layer under context parallelism, not yet
    assembled: per ancestor partition (chain order) its capture's shard and the positions of
    the ancestors among the capture's rows. The attention layer assembles them from the group's
    ranks when it runs (:func:`treelit.partition.context_parallel.attention_with_ancestors`)."""

    parts: List[Tuple[Any, torch.Tensor]]


class RowPlan:
    """Host-side bookkeeping of a plan over one row: owners, ancestors, targets."""

    def __init__(self, batch: TreeBatch, plan: PartitionPlan) -> None:
        self.batch, self.plan = batch, plan
        N = batch.num_tokens
        self.parts = plan.partitions
        self.owner = np.full(N, -1, dtype=np.int64)
        self.local = np.full(N, -1, dtype=np.int64)
        for p in self.parts:
            self.owner[p.tokens] = p.index
            self.local[p.tokens] = np.arange(p.size)
        self.parent = batch.parent.cpu().numpy()
        self.root_token = [int(p.tokens[0]) for p in self.parts]
        self.children: List[List[int]] = [[] for _ in self.parts]
        for p in self.parts:
            if p.parent >= 0:
                self.children[p.parent].append(p.index)
        # boundary tokens of each partition (local rows that parent a child partition's root)
        self.boundary: List[np.ndarray] = []
        self.slot: Dict[int, int] = {}
        for p in self.parts:
            kids = self.children[p.index]
            b = np.unique(self.local[self.parent[[self.root_token[c] for c in kids]]]) if kids else np.zeros(0, np.int64)
            self.boundary.append(b)
            for c in kids:
                self.slot[c] = int(np.searchsorted(b, self.local[self.parent[self.root_token[c]]]))

    @property
    def parents(self) -> List[int]:
        return [p.parent for p in self.parts]

    def ancestors(self, i: int) -> np.ndarray:
        """Tokens above partition ``i``'s root, in path order."""
        anc = []
        a = self.parent[self.root_token[i]]
        while a >= 0:
            anc.append(a)
            a = self.parent[a]
        return np.array(anc[::-1], dtype=np.int64)

    def row(self, i: int) -> Tuple[TreeBatch, torch.Tensor]:
        """Partition ``i`` as a row of its own, and its token indices in the full row."""
        p = self.parts[i]
        dev = self.batch.device
        tokens = torch.from_numpy(p.tokens).to(dev)
        sub = self.batch if p.size == self.batch.num_tokens else self.batch.subset(tokens)
        return sub, tokens

    def targets(self, i: int, sub: TreeBatch, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(rows, tok)``: partition ``i``'s targets as hidden-state rows of the partition and
        token indices of the full row."""
        dev = self.batch.device
        own = torch.nonzero(sub.parent >= 0).squeeze(1)
        kids = self.children[i]
        if not kids:
            return sub.parent[own], tokens[own]
        roots = [self.root_token[c] for c in kids]
        tok = torch.cat([tokens[own], torch.tensor(roots, dtype=torch.long, device=dev)])
        rows = torch.cat([sub.parent[own], torch.from_numpy(self.local[self.parent[roots]]).to(dev)])
        return rows, tok

    def needed(self, q: int) -> np.ndarray:
        """Partition ``q``'s rows (sorted local indices) on the paths to its child partitions'
        roots: the only ones its descendants attend to."""
        rows = set()
        for c in self.children[q]:
            a = self.parent[self.root_token[c]]
            while a >= 0 and self.owner[a] == q:
                rows.add(int(self.local[a]))
                a = self.parent[a]
        return np.array(sorted(rows), dtype=np.int64)

    def external(self, i: int, captured: Dict[int, Captures],
                 rows: Optional[Dict[int, np.ndarray]] = None) -> Optional[ExternalKV]:
        """Partition ``i``'s ancestors' K/V and states from their captures (None for a root).
        ``rows``: partition -> the rows its captures hold (:meth:`needed`; None: all its rows)."""
        anc = self.ancestors(i)
        if not len(anc):
            return None
        dev = self.batch.device
        ks: Dict[int, List[torch.Tensor]] = {}
        vs: Dict[int, List[torch.Tensor]] = {}
        shards: Dict[int, List[Tuple[Any, torch.Tensor]]] = {}
        for q in np.unique(self.owner[anc]):  # ancestor partitions in chain (= index) order
            local = self.local[anc[self.owner[anc] == q]]
            pos = local if rows is None else np.searchsorted(rows[int(q)], local)
            idx = torch.from_numpy(pos).to(dev)
            for layer, kv in captured[int(q)].kv.items():
                if not isinstance(kv, tuple):  # a shard (context parallelism): assembled when the layer runs
                    shards.setdefault(layer, []).append((kv, idx))
                    continue
                kl, vl = kv
                every = len(pos) == kl.shape[2] and bool((pos == np.arange(len(pos))).all())
                ks.setdefault(layer, []).append(kl if every else kl.index_select(2, idx))  # (all rows: no copy)
                vs.setdefault(layer, []).append(vl if every else vl.index_select(2, idx))
        E = len(anc)
        parent_part = self.parts[i].parent
        slot = self.slot[i]
        states = {layer: {name: t[slot] for name, t in named.items()}
                  for layer, named in captured[parent_part].states.items()}
        join = lambda x: x[0] if len(x) == 1 else torch.cat(x, 2)  # noqa: E731  (one ancestor partition: no copy)
        return ExternalKV(
            {**{layer: join(x) for layer, x in ks.items()}, **{layer: ShardedRows(x) for layer, x in shards.items()}},
            {layer: join(x) for layer, x in vs.items()},
            torch.zeros(E, dtype=torch.long, device=dev),
            torch.full((E,), self.parts[i].size, dtype=torch.long, device=dev),
            state=states,
            pos=self.batch.position_ids[torch.from_numpy(anc).to(dev)],
        )


def forward_partition(model, sub: TreeBatch, attention, external: Optional[ExternalKV], capture: bool,
                      boundary: Optional[np.ndarray], embedding_grad_accumulator=None, oom_guard=None):
    """Final hidden states ``[n, D]`` of the row ``sub`` and its context (with the captures
    when ``capture``). Call inside the model's forward (:func:`~treelit.models.forward.in_forward`)."""
    backend = resolve_backend(attention, sub.device, sub)
    bnd = boundary if capture and boundary is not None and len(boundary) else None
    ctx = TreeContext(sub, backend, external=external, capture_kv=capture, capture_tokens=bnd)
    ctx.embedding_grad_accumulator = embedding_grad_accumulator
    ctx.oom_guard = oom_guard
    h = decoder_hidden(model, sub.input_ids[None], sub.position_ids[None], ctx)[0]
    return h, ctx


def captures_of(ctx, grad: bool) -> Tuple[Captures, List[torch.Tensor], List[torch.Tensor]]:
    """The partition's captures for its descendants. With ``grad``, leaf copies that require
    grad, plus the graph tensors they copy (``produced``) to relay their gradients into."""
    produced: List[torch.Tensor] = []
    leaves: List[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if not grad:
            return t.detach()
        c = t.detach().requires_grad_()
        produced.append(t)
        leaves.append(c)
        return c

    kv = {layer: (leaf(k), leaf(v)) for layer, (k, v) in ctx.captured.items()}
    states = {layer: {name: leaf(t) for name, t in named.items()} for layer, named in ctx.recurrent_out.items()}
    return Captures(kv, states), produced, leaves
