"""Where recurrent layers take their state and convolution context from.

A recurrent layer over a DFS-serialized tree must not carry state from one sibling's
subtree into the next. Two facts make it exact:

* the state entering a segment is its **parent segment's state after the parent's
  last token** (a root segment starts from zero, or from an externally supplied state
  when its ancestors live in another partition);
* a short causal convolution of kernel K reads a token's **last K-1 ancestors** on its
  root path (possibly across several short segments, possibly into an external
  context), never its DFS neighbours.

:class:`RecurrentLayout` precomputes both for a row: an ancestor table for the
convolution and the segments grouped by depth level, so a scan can run all segments
of a level in parallel, level after level. Independent causal rows (the linearized
baseline) are the special case of one root segment per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from treelit.tree.batch import segment_levels, segments_from_parents
from treelit.utils.dispatch import upload

__all__ = ["RecurrentLayout", "tree_layout", "causal_layout", "external_layout", "root_state"]


@dataclass
class RecurrentLayout:
    """Flattened tokens ``0..T-1``.

    ``conv_src [T, K-1]``: for token t and lag j = 1..K-1 (column ``K-1-j``), the index of its
    j-th ancestor in the *padded source* ``[tokens (T) | external context (K-1) | zero row]``:
    an in-row ancestor ``< T``; ``T + K-1-e`` for the e-th ancestor beyond the row's root
    (external context row, oldest first); ``T + K - 1`` (the zero row) when none exists.
    With ``context_rows`` set (:func:`external_layout`), the context has that many rows
    instead of ``K-1`` and the zero row is ``T + context_rows``.
    ``seg_start, seg_len, seg_parent`` (long, host numpy): segments; ``seg_parent`` is -1 for
    a root starting from zero, -2 for a root whose state comes from outside, and ``-2 - i``
    for a root continuing external slot ``i`` (several external states, ``[slots, ...]``).
    ``levels``: segment ids grouped by depth (roots first).
    ``capture``: tokens whose state after them must be returned (partition boundaries).
    """

    T: int
    K: int
    conv_src: torch.Tensor
    seg_start: np.ndarray
    seg_len: np.ndarray
    seg_parent: np.ndarray
    levels: List[np.ndarray]
    capture: np.ndarray
    context_rows: Optional[int] = None

    @property
    def zero_row(self) -> int:
        return self.T + (self.K - 1 if self.context_rows is None else self.context_rows)


def root_state(p: int, init_state: Optional[torch.Tensor], zero: torch.Tensor) -> torch.Tensor:
    """The state a root segment with ``seg_parent`` ``p < 0`` starts from: ``zero`` for -1 (or
    without ``init_state``); ``init_state`` itself for -2 when it has the state's shape; its slot
    ``-2 - p`` when it is ``[slots, *state]``."""
    if p == -1 or init_state is None:
        return zero
    if init_state.dim() > zero.dim():
        return init_state[-2 - p]
    return init_state


def _ancestor_table(parent: np.ndarray, root_external: np.ndarray, K: int) -> np.ndarray:
    """[T, K-1] padded-source index of lags K-1..1 (oldest first)."""
    T = len(parent)
    src = np.empty((T, max(K - 1, 0)), dtype=np.int64)
    cur = np.arange(T)
    ext_depth = np.zeros(T, dtype=np.int64)  # > 0: already e steps into the external context
    zero = T + K - 1
    for j in range(1, K):
        nxt = np.where(cur >= 0, parent[np.maximum(cur, 0)], -1)
        # stepping out of the row from a root with an external parent
        leaving = (cur >= 0) & (nxt < 0) & root_external[np.maximum(cur, 0)]
        ext_depth = np.where(leaving, 1, np.where(ext_depth > 0, ext_depth + 1, 0))
        cur = np.where(cur >= 0, nxt, -1)
        idx = np.where(cur >= 0, cur, np.where((ext_depth > 0) & (ext_depth <= K - 1), T + K - 1 - ext_depth, zero))
        src[:, K - 1 - j] = idx
    return src


def tree_layout(batch, K: int, external: bool = False, capture: Optional[np.ndarray] = None) -> RecurrentLayout:
    """Layout of a tree row; with ``external`` the row's roots continue an outside path.
    Segments are cut after every ``capture`` token so that its state is a segment's final one."""
    parent = batch.host("parent")  # the row's host copies: planning never reads the device
    if capture is not None and len(capture):
        seg_start, seg_len, seg_parent = segments_from_parents(parent, np.asarray(capture, dtype=np.int64))
    else:
        seg_start = batch.host("seg_start")
        seg_len = batch.host("seg_len")
        seg_parent = batch.host("seg_parent").copy()
    root_ext = np.zeros(len(parent), dtype=bool)
    if external:
        root_ext[parent < 0] = True
        seg_parent[seg_parent < 0] = -2
    src = _ancestor_table(parent, root_ext, K)
    return RecurrentLayout(
        T=len(parent),
        K=K,
        conv_src=upload(src, batch.device),
        seg_start=seg_start,
        seg_len=seg_len,
        seg_parent=seg_parent,
        levels=segment_levels(seg_parent),
        capture=np.zeros(0, dtype=np.int64) if capture is None else np.asarray(capture, dtype=np.int64),
    )


def causal_layout(B: int, L: int, lengths: Optional[torch.Tensor], K: int, device) -> RecurrentLayout:
    """Layout of ``B`` right-padded causal rows of length ``L`` (flattened row-major)."""
    lens = np.full(B, L, dtype=np.int64) if lengths is None else lengths.cpu().numpy().astype(np.int64)
    T = B * L
    pos = np.arange(T) % L
    parent = np.where(pos > 0, np.arange(T) - 1, -1)
    src = _ancestor_table(parent, np.zeros(T, dtype=bool), K)
    seg_start = np.arange(B, dtype=np.int64) * L
    return RecurrentLayout(
        T=T,
        K=K,
        conv_src=torch.from_numpy(src).to(device),
        seg_start=seg_start,
        seg_len=np.maximum(lens, 1),
        seg_parent=np.full(B, -1, dtype=np.int64),
        levels=[np.arange(B)],
        capture=np.zeros(0, dtype=np.int64),
    )


def external_layout(parent: np.ndarray, root_slot: np.ndarray, conv_src: np.ndarray, context_rows: int, K: int,
                    capture: np.ndarray, device) -> RecurrentLayout:
    """Layout of a row whose roots continue outside paths at several points (context
    parallelism: a contiguous range of a DFS row). ``parent [T]``: in-row parents (-1 for a
    root); ``root_slot [T]``: for a root, the external state slot it continues (-1: starts from
    zero); ``conv_src [T, K-1]``: the caller's ancestor table into the padded source
    ``[tokens (T) | context (context_rows) | zero row]``. Segments are cut after every
    ``capture`` token."""
    capture = np.asarray(capture, dtype=np.int64)
    seg_start, seg_len, seg_parent = segments_from_parents(parent, capture)
    roots = seg_parent < 0
    slot = root_slot[seg_start[roots]]
    seg_parent[roots] = np.where(slot >= 0, -2 - slot, -1)
    return RecurrentLayout(
        T=len(parent),
        K=K,
        conv_src=torch.from_numpy(np.ascontiguousarray(conv_src, dtype=np.int64)).to(device),
        seg_start=seg_start,
        seg_len=seg_len,
        seg_parent=seg_parent,
        levels=segment_levels(seg_parent),
        capture=capture,
        context_rows=int(context_rows),
    )
