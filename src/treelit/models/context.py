"""Sequence contexts: what each token of a forward pass may see.

A context is handed to every layer. Attention layers call
``ctx.attention(layer_index, q, k, v, window=None)`` with post-RoPE ``q [B, Hq, L, D]``
and un-expanded ``k, v [B, Hkv, L, D]`` (``window``: a sliding window, in tokens a query
sees counting itself; on a tree, positions are depths, so a query sees the ancestors
less than ``window`` levels above it); recurrent layers ask the context how to route
their state (see :mod:`treelit.ssm`); mixture-of-experts layers hand it their router
logits (``ctx.record_router``, read by the router loss).

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

import numpy as np
import torch
import torch.nn.functional as F

from treelit.ssm.layout import causal_layout, tree_layout
from treelit.tree.batch import TreeBatch

__all__ = ["CausalContext", "TreeContext", "TreeLayout", "ExternalKV"]


class _RouterRecord:
    """Router logits of the mixture-of-experts layers of one forward pass: layer -> ``[T, E]``
    (and, under routing replay, the experts each token was sent to: layer -> ``[T, k]``)."""

    routing: Optional[torch.Tensor] = None  # [T, L_moe, k] recorded experts of the pass's rows (-1: none)

    def record_router(self, layer: int, logits: torch.Tensor, experts: Optional[torch.Tensor] = None) -> None:
        if not hasattr(self, "router_logits"):
            self.router_logits: Dict[int, torch.Tensor] = {}
        self.router_logits[layer] = logits  # a recomputation (activation checkpointing) overwrites
        if experts is not None:
            if not hasattr(self, "router_experts"):
                self.router_experts: Dict[int, torch.Tensor] = {}
            self.router_experts[layer] = experts

    def replay_experts(self, moe_index: int, top_k: int) -> torch.Tensor:
        """The recorded experts ``[T, k]`` of MoE layer ``moe_index`` (the ``moe_index``-th MoE
        layer) for the pass's rows; rows of -1 were not recorded (those tokens route live)."""
        r = self.routing
        if r is None:
            raise ValueError("model.moe.routing=replay, but this pass has no recorded routing: give every branch "
                             "its routed_experts (or set model.moe.routing=live)")
        if moe_index >= r.shape[1] or r.shape[2] != top_k:
            raise ValueError(f"the recorded routing covers {r.shape[1]} MoE layers with {r.shape[2]} experts per "
                             f"token; the model routes MoE layer {moe_index} to top_k={top_k}")
        return r[:, moe_index]


class _RecurrentInputs:
    """Where a recurrent layer's convolution contexts and initial states come from (by default
    the external inputs of :meth:`recurrent_external`; context parallelism exchanges them)."""

    def recurrent_external(self, layer: int):
        return None

    def recurrent_conv_inputs(self, layer: int, K: int, inputs: Dict[str, torch.Tensor]):
        """``(inputs, contexts)`` for the kernel-``K`` convolutions of a recurrent layer: the
        inputs ``name -> [T, C]`` to use (these, or the same values through a function that
        routes their gradients) and each one's context ``[rows, C]`` outside the row, read
        through the layout's ancestor table (None: zeros)."""
        ext = self.recurrent_external(layer) or {}
        return inputs, {name: ext.get(name) for name in inputs}

    def recurrent_scan(self, layer: int, scan, state_shape, like: torch.Tensor, name: str = "state"):
        """``scan(initial state) -> (outputs, captured states)`` run with this layer's initial
        state ``name`` (``state_shape``, in ``like``'s dtype and device; ``like`` is a tensor of the
        layer's graph downstream of its convolutions, requiring grad when the scan's inputs do)."""
        ext = self.recurrent_external(layer) or {}
        return scan(ext.get(name))


class CausalContext(_RouterRecord, _RecurrentInputs):
    """Independent causal sequences (the linearized baseline). Rows are right-padded."""

    kind = "causal"

    def __init__(self, lengths: Optional[torch.Tensor] = None, routing: Optional[torch.Tensor] = None,
                 images: Optional[list] = None) -> None:
        self.lengths = lengths  # [B] real lengths (for recurrent layers); None = no padding
        # per row, the images it shows in order (treelit.tree.images.ImageSet, None: none): a vision model
        # encodes each row's own (treelit.models.hf_vision); None: no row shows any
        self.images = images
        # [B, L, L_moe, k] recorded experts per row and position (-1: none, padding included)
        self.routing = None if routing is None else routing.reshape(-1, *routing.shape[2:])
        self._layouts: Dict[tuple, Any] = {}
        self.router_logits: Dict[int, torch.Tensor] = {}

    captures_recurrent = False

    def recurrent_layout(self, K: int, B: int, L: int, device=None):
        key = (K, B, L)
        if key not in self._layouts:
            self._layouts[key] = causal_layout(B, L, self.lengths, K, device)
        return self._layouts[key]

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  window: Optional[int] = None) -> torch.Tensor:
        L = q.shape[2]
        if window is None or window >= L:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        i = torch.arange(L, device=q.device)
        band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)  # [L, L]: key j visible to query i
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class ExternalKV:
    """Ancestor K/V that live outside the packed row.

    ``k[layer], v[layer]``: ``[1, Hkv, E, D]`` per attention layer (may require grad).
    ``lo, hi``: ``[E]`` long; row query ``q`` sees external key ``e`` iff ``lo[e] <= q < hi[e]``.
    ``pos``: ``[E]`` positions (depths) of the external keys, for sliding windows (None: the
    keys are never out of a window, which is only right for models without one).
    ``state``: per-layer recurrent boundary state for recurrent layers (see :mod:`treelit.ssm`).
    """

    k: Dict[int, torch.Tensor]
    v: Dict[int, torch.Tensor]
    lo: torch.Tensor
    hi: torch.Tensor
    state: Dict[int, Any] = field(default_factory=dict)
    pos: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.lo.shape[0])


@dataclass
class TreeLayout:
    """Everything an attention backend needs to plan a tree row.

    ``kv_lo, kv_hi [E + N]``: visibility interval of every key over query indices.
    ``batch``: the row (segment tables for structure-aware backends).
    ``num_external``: E, number of external keys in front of the row's own keys.
    ``kv_pos [E + N]``: key positions (depths); ``window``: a sliding window (tokens a query
    sees, itself included), or None. With a window, query ``q`` sees key ``j`` iff it is
    visible by the intervals *and* ``pos[q] - kv_pos[j] < window``. ``blocks``: some row keys
    are also seen by the earlier tokens of their block (``kv_lo[E + j] < j``:
    :meth:`TreeContext.see_blocks`); only backends with ``bidirectional_blocks`` take such a layout.
    """

    batch: TreeBatch
    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    num_external: int
    kv_pos: Optional[torch.Tensor] = None
    window: Optional[int] = None
    blocks: bool = False

    @property
    def num_queries(self) -> int:
        return self.batch.num_tokens

    @property
    def q_pos(self) -> torch.Tensor:
        return self.batch.position_ids

    def with_window(self, window: Optional[int]) -> "TreeLayout":
        """This layout restricted to a sliding window (itself when the window cannot act)."""
        if window is None or not self.window_acts(window):
            return self
        return TreeLayout(self.batch, self.kv_lo, self.kv_hi, self.num_external, self.kv_pos, int(window), self.blocks)

    def window_acts(self, window: int) -> bool:
        """Whether some query is further than ``window - 1`` positions from a key it could see
        (conservative: the row's position range)."""
        if self.kv_pos is None or self.kv_pos.numel() == 0:
            return False
        return int(self.q_pos.max()) - int(self.kv_pos.min()) >= window

    def host(self, name: str) -> np.ndarray:
        """``kv_lo``, ``kv_hi``, ``kv_pos`` or ``q_pos`` as a host array, for planning: the row's part
        from the row's host copies (:meth:`TreeBatch.host`), so a backend plans without asking the
        device; only external keys' values (a partition pass's ancestors) are read from their tensor."""
        cache = self.__dict__.setdefault("_host", {})
        if name not in cache:
            b, E = self.batch, self.num_external
            if name == "q_pos":
                cache[name] = b.host("position_ids")
            else:
                lo = (lambda: self.kv_lo[E:].detach().cpu().numpy()) if self.blocks else (
                    lambda: np.arange(b.num_tokens, dtype=np.int64))
                row = {"kv_lo": lo, "kv_hi": lambda: b.host("subtree_end"),
                       "kv_pos": lambda: b.host("position_ids")}[name]()
                cache[name] = np.concatenate([getattr(self, name)[:E].detach().cpu().numpy(), row]) if E else row
        return cache[name]

    def dense_mask(self) -> torch.Tensor:
        """Boolean ``[N, E+N]`` ancestor mask (True = attend), windowed if this layout is."""
        q = torch.arange(self.num_queries, device=self.kv_lo.device).unsqueeze(1)
        mask = (self.kv_lo.unsqueeze(0) <= q) & (q < self.kv_hi.unsqueeze(0))
        if self.window is not None:
            mask &= (self.q_pos.unsqueeze(1) - self.kv_pos.unsqueeze(0)) < self.window
        return mask


class TreeContext(_RouterRecord, _RecurrentInputs):
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
        self.routing = batch.token_routing  # [N, L_moe, k] recorded experts (routing replay), or None
        self.capture_tokens = capture_tokens  # tokens whose recurrent state/conv context to return
        self._layouts: Dict[int, Any] = {}
        self.backend = backend
        self.external = external
        self.capture_kv = capture_kv
        self.captured: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.recurrent_out: Dict[int, Any] = {}  # boundary states produced by recurrent layers
        self.router_logits: Dict[int, torch.Tensor] = {}
        self._plans: Dict[Optional[int], Any] = {}
        idx = torch.arange(batch.num_tokens, device=batch.device)
        if external is not None:
            kv_lo = torch.cat([external.lo.to(batch.device), idx])
            kv_hi = torch.cat([external.hi.to(batch.device), batch.subtree_end])
            E = external.num_tokens
            ext_pos = external.pos.to(batch.device) if external.pos is not None else None
            kv_pos = None if ext_pos is None and E else torch.cat(
                [ext_pos if ext_pos is not None else batch.position_ids[:0], batch.position_ids])
        else:
            kv_lo, kv_hi, E = idx, batch.subtree_end, 0
            kv_pos = batch.position_ids
        self.layout = TreeLayout(batch=batch, kv_lo=kv_lo, kv_hi=kv_hi, num_external=E, kv_pos=kv_pos)

    # recurrent layers ----------------------------------------------------------------------
    @property
    def captures_recurrent(self) -> bool:
        return self.capture_tokens is not None

    def recurrent_layout(self, K: int, B: int = 1, L: int = 0, device=None):
        if K not in self._layouts:
            ext = self.external is not None and bool(self.external.state)
            self._layouts[K] = tree_layout(self.batch, K, external=ext, capture=self.capture_tokens)
        return self._layouts[K]

    def recurrent_external(self, layer: int):
        return None if self.external is None else self.external.state.get(layer)

    def record_recurrent(self, layer: int, values: Dict[str, Any]) -> None:
        self.recurrent_out[layer] = values

    @property
    def plan(self):
        return self.plan_for(None)

    def plan_for(self, window: Optional[int]):
        """The backend's plan for this row (one per distinct window, shared by the layers)."""
        layout = self.layout
        if window is not None:
            if layout.kv_pos is None:
                raise ValueError("a sliding window needs the positions of external keys (ExternalKV.pos)")
            layout = layout.with_window(window)
        key = layout.window
        if key not in self._plans:
            self._plans[key] = self.backend.plan(layout)
        return self._plans[key]

    def see_blocks(self, start: torch.Tensor) -> None:
        """Bidirectional blocks (Gemma-3's image blocks): row token ``j`` is also seen by the
        earlier tokens of its block, ``start[j] .. j-1`` (``start [N]``, ``start[j] <= j``; a
        block is a run of consecutive row indices on one path, so each key's visibility stays one
        interval, ``[start[j], subtree_end[j])``). Before the pass's first attention layer."""
        if not getattr(self.backend, "bidirectional_blocks", False):
            raise ValueError(f"attention backend {getattr(self.backend, 'name', type(self.backend).__name__)!r} cannot "
                             "attend bidirectionally inside a block (Gemma-3's image blocks); use attention=sdpa_dense "
                             "or attention=flex")
        if self._plans:
            raise RuntimeError("see_blocks after the pass planned its attention")
        lay, E = self.layout, self.layout.num_external
        kv_lo = torch.cat([lay.kv_lo[:E], start.to(lay.kv_lo)])
        self.layout = TreeLayout(lay.batch, kv_lo, lay.kv_hi, E, lay.kv_pos, lay.window, blocks=True)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  window: Optional[int] = None) -> torch.Tensor:
        if q.shape[0] != 1:
            raise ValueError("a tree row has batch size 1")
        if self.capture_kv:
            self.captured[layer] = (k, v)
        if self.external is not None and self.layout.num_external:
            k = torch.cat([self.external.k[layer], k], dim=2)
            v = torch.cat([self.external.v[layer], v], dim=2)
        return self.backend(q, k, v, self.plan_for(window))

