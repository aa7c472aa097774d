"""Sequence contexts: what each token of a forward pass may see.

A context is handed to every layer. Attention layers call
``ctx.attention(layer_index, q, k, v)`` with post-RoPE ``q [B, Hq, L, D]`` and
un-expanded ``k, v [B, Hkv, L, D]``; recurrent layers ask the context how to
route their state (see :mod:`treelit.ssm`).

* :class:`CausalContext`: B independent right-padded causal rows.
* :class:`TreeContext`: one DFS-serialized tree row (B = 1). Query ``q`` sees key
  ``j`` iff ``kv_lo[j] <= q < kv_hi[j]``. Keys ``0..E-1`` may be *external*:
  per-layer K/V of ancestors that live outside the row (a partition's
  ancestors), supplied as tensors that may require grad; keys ``E..E+N-1`` are
  the row's own tokens with ``kv_lo = index``, ``kv_hi = subtree_end``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from treelit.tree.batch import TreeBatch

__all__ = ["CausalContext", "TreeContext", "TreeLayout", "ExternalKV"]


class CausalContext:
    """Independent causal sequences (the linearized baseline). Rows are right-padded."""

    kind = "causal"

    def __init__(self, lengths: Optional[torch.Tensor] = None) -> None:
        self.lengths = lengths  # [B] real lengths (for recurrent layers); None = no padding
        self._layouts: Dict[tuple, Any] = {}

    captures_recurrent = False

    def recurrent_layout(self, K: int, B: int, L: int, device=None):
        key = (K, B, L)
        if key not in self._layouts:
            from treelit.ssm.layout import causal_layout

            self._layouts[key] = causal_layout(B, L, self.lengths, K, device)
        return self._layouts[key]

    def recurrent_external(self, layer: int):
        return None

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class ExternalKV:
    """Ancestor K/V that live outside the packed row.

    ``k[layer], v[layer]``: ``[1, Hkv, E, D]`` per attention layer (may require grad).
    ``lo, hi``: ``[E]`` long; row query ``q`` sees external key ``e`` iff ``lo[e] <= q < hi[e]``.
    ``state``: per-layer recurrent boundary state for recurrent layers (see :mod:`treelit.ssm`).
    """

    k: Dict[int, torch.Tensor]
    v: Dict[int, torch.Tensor]
    lo: torch.Tensor
    hi: torch.Tensor
    state: Dict[int, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.lo.shape[0])


@dataclass
class TreeLayout:
    """Everything an attention backend needs to plan a tree row.

    ``kv_lo, kv_hi [E + N]``: visibility interval of every key over query indices.
    ``batch``: the row (segment tables for structure-aware backends).
    ``num_external``: E, number of external keys in front of the row's own keys.
    """

    batch: TreeBatch
    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    num_external: int

    @property
    def num_queries(self) -> int:
        return self.batch.num_tokens

    def dense_mask(self) -> torch.Tensor:
        """Boolean ``[N, E+N]`` ancestor mask (True = attend)."""
        q = torch.arange(self.num_queries, device=self.kv_lo.device).unsqueeze(1)
        return (self.kv_lo.unsqueeze(0) <= q) & (q < self.kv_hi.unsqueeze(0))


class TreeContext:
    """A DFS-serialized tree row attended through a tree attention backend.

    Args:
        batch: the row.
        backend: an attention backend instance (see :mod:`treelit.attention`).
        external: ancestor K/V outside the row (partitioning), or None.
        capture_kv: keep each attention layer's own (k, v) in ``self.captured``.
    """

    kind = "tree"

    def __init__(
        self,
        batch: TreeBatch,
        backend,
        external: Optional[ExternalKV] = None,
        capture_kv: bool = False,
        capture_tokens: Optional[Any] = None,
    ):
        self.batch = batch
        self.capture_tokens = capture_tokens  # tokens whose recurrent state/conv context to return
        self._layouts: Dict[int, Any] = {}
        self.backend = backend
        self.external = external
        self.capture_kv = capture_kv
        self.captured: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.recurrent_out: Dict[int, Any] = {}  # boundary states produced by recurrent layers
        self._plan = None
        idx = torch.arange(batch.num_tokens, device=batch.device)
        if external is not None:
            kv_lo = torch.cat([external.lo.to(batch.device), idx])
            kv_hi = torch.cat([external.hi.to(batch.device), batch.subtree_end])
            E = external.num_tokens
        else:
            kv_lo, kv_hi, E = idx, batch.subtree_end, 0
        self.layout = TreeLayout(batch=batch, kv_lo=kv_lo, kv_hi=kv_hi, num_external=E)

    # recurrent layers ----------------------------------------------------------------------
    @property
    def captures_recurrent(self) -> bool:
        return self.capture_tokens is not None

    def recurrent_layout(self, K: int, B: int = 1, L: int = 0, device=None):
        if K not in self._layouts:
            from treelit.ssm.layout import tree_layout

            ext = self.external is not None and bool(self.external.state)
            self._layouts[K] = tree_layout(self.batch, K, external=ext, capture=self.capture_tokens)
        return self._layouts[K]

    def recurrent_external(self, layer: int):
        return None if self.external is None else self.external.state.get(layer)

    def record_recurrent(self, layer: int, values: Dict[str, Any]) -> None:
        self.recurrent_out[layer] = values

    @property
    def plan(self):
        if self._plan is None:
            self._plan = self.backend.plan(self.layout)
        return self._plan

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != 1:
            raise ValueError("a tree row has batch size 1")
        if self.capture_kv:
            self.captured[layer] = (k, v)
        if self.external is not None and self.layout.num_external:
            k = torch.cat([self.external.k[layer], k], dim=2)
            v = torch.cat([self.external.v[layer], v], dim=2)
        return self.backend(q, k, v, self.plan)

