"""Per-branch sums of per-token values, computed on the tree.

Sequence-level objectives need, per branch b, ``S_b = sum_t m_{b,t} x_t`` over the
branch's target tokens (its sequence log-prob, its log-ratio sum). Along a
root-to-leaf path, prefix sums ``P[i] = x[i] + P[parent[i]]`` give any run of
consecutive path tokens as a difference ``P[v] - P[parent(u)]``, so each branch's sum
is a handful of differences: one per maximal run of targets on its path (usually one:
its response). Cost O(tree tokens + runs) on the device, differentiable; the run
decomposition is host bookkeeping, computed once per batch.

``P`` is built segment by segment: a cumulative sum inside each segment plus the
prefix of its parent segment's last token, one vectorised pass per segment depth.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from treelit.tree.batch import segment_levels
from treelit.utils.dispatch import upload, upload_all

__all__ = ["path_prefix_sums", "branch_target_sums", "branch_runs"]


def _segment_levels(batch, device) -> List[torch.Tensor]:
    """The row's segments by depth below the roots, on ``device``: planned on the host from the
    row's host copies, uploaded in one copy, cached on the row."""
    cached = getattr(batch, "_seg_levels", None)
    if cached is not None and cached[0] == str(device):
        return cached[1]
    views = upload_all(segment_levels(batch.host("seg_parent"))[1:], device)
    batch._seg_levels = (str(device), views)
    return views


def path_prefix_sums(batch, x: torch.Tensor) -> torch.Tensor:
    """``P[i] = sum of x over the ancestors-or-self of token i`` (``x [N]``)."""
    cs = torch.cumsum(x, 0)
    start, length = batch.seg_start, batch.seg_len
    before = torch.where(start > 0, cs[(start - 1).clamp(min=0)], torch.zeros_like(cs[:1]).expand(start.shape[0]))
    seg_of = torch.repeat_interleave(torch.arange(len(start), device=x.device), length, output_size=x.shape[0])  # no sync
    local = cs - before[seg_of]  # sum from the segment start
    seg_end_local = local[start + length - 1]
    offset = torch.zeros(len(start), dtype=x.dtype, device=x.device)
    parent = batch.seg_parent
    for lv in _segment_levels(batch, x.device):
        p = parent[lv]
        offset = offset.index_put((lv,), offset[p] + seg_end_local[p])
    return local + offset[seg_of]


def branch_runs(batch) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of target tokens on each branch path: ``(branch, first token, last token)``."""
    cached = getattr(batch, "_branch_runs", None)
    if cached is not None:
        return cached
    ptr = batch.host("branch_ptr")
    toks = batch.host("branch_tokens")
    mask = batch.host("branch_mask").copy()
    mask[ptr[:-1]] = False  # a branch's first token is never a target
    branch_of = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
    prev = np.concatenate([[False], mask[:-1]]) & (np.concatenate([[-1], branch_of[:-1]]) == branch_of)
    nxt = np.concatenate([mask[1:], [False]]) & (np.concatenate([branch_of[1:], [-1]]) == branch_of)
    starts = np.flatnonzero(mask & ~prev)
    ends = np.flatnonzero(mask & ~nxt)
    runs = (branch_of[starts], toks[starts], toks[ends])
    batch._branch_runs = runs
    return runs


def branch_target_sums(batch, x: torch.Tensor) -> torch.Tensor:
    """``S_b = sum over branch b's target tokens of x`` for every branch (``[B]``)."""
    P = path_prefix_sums(batch, x)
    cached = getattr(batch, "_runs_on", None)  # the runs' one upload, kept on the row per device
    if cached is None or cached[0] != str(x.device):
        cached = (str(x.device), upload(np.stack(branch_runs(batch)), x.device))
        batch._runs_on = cached
    b, first, last = cached[1]
    par = batch.parent[first]
    before = torch.where(par >= 0, P[par.clamp(min=0)], torch.zeros_like(P[first]))
    out = torch.zeros(batch.num_branches, dtype=x.dtype, device=x.device)
    return out.index_add(0, b, P[last] - before)
