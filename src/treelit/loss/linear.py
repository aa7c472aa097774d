"""The linearized baseline's primitives: every branch is its own causal sequence.

This is what per-branch training computes, written without any tree code: branches
(:class:`~treelit.loss.branches.Branches`) are sorted by length and run in right-padded
micro-batches through the same model (causal SDPA, positions ``0..L-1``) and the same
log-prob head. Token ``t`` of a branch is predicted from position ``t-1`` and counts iff
its loss mask is set. Objectives build their per-branch losses from these; it is the
reference for exactness tests and the baseline for speed.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from treelit.loss.branches import Branches
from treelit.loss.logprobs import token_logprobs, weighted_nll
from treelit.models.context import CausalContext
from treelit.models.forward import decoder_hidden, in_forward, output_weight

__all__ = ["Branches", "LinearBranches", "sft_linear_loss", "linear_micro_batches", "linear_branch_logprobs",
           "row_images"]


LinearBranches = Branches  # the per-branch inputs (see :mod:`treelit.loss.branches`)


def row_images(images, idx: List[int]) -> Optional[list]:
    """The images of the rows ``idx`` of a padded micro-batch (None: none of them shows any)."""
    if images is None:
        return None
    rows = [images[i] for i in idx]
    return rows if any(r is not None for r in rows) else None


def linear_micro_batches(lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Group branch indices, sorted by length, so that rows x longest <= max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: List[List[int]] = []
    cur: List[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def _group_loss(model, lb: LinearBranches, idx: List[int], coef: np.ndarray, chunk_rows, device) -> torch.Tensor:
    """Sum over the group's targets of c_b * -log p (coefficients already divided by Z)."""
    L = max(len(lb.tokens[i]) for i in idx)
    ids = torch.zeros(len(idx), L, dtype=torch.long)
    tmask = torch.zeros(len(idx), L, dtype=torch.bool)
    c = torch.zeros(len(idx), L, dtype=torch.float64)
    for r, i in enumerate(idx):
        n = len(lb.tokens[i])
        ids[r, :n] = torch.from_numpy(lb.tokens[i])
        tmask[r, :n] = torch.from_numpy(lb.masks[i])
        c[r, :n] = float(coef[i])
    ids, tmask, c = ids.to(device), tmask.to(device), c.to(device)
    pos = torch.arange(L, device=device).expand(len(idx), L)
    lengths = torch.tensor([len(lb.tokens[i]) for i in idx], device=device)
    routing = padded_routing(lb.routing, idx, L, device)
    images = row_images(lb.images, idx)

    def run(m):
        h = decoder_hidden(m, ids, pos, CausalContext(lengths, routing, images))
        rows, cols = torch.nonzero(tmask, as_tuple=True)
        return weighted_nll(h[rows, cols - 1], output_weight(m), ids[rows, cols], c[rows, cols].to(h.dtype), chunk_rows=chunk_rows)

    return in_forward(model, run)


def sft_linear_loss(model, branches: Branches, aggregation: str = "token-mean", *, normalizer: Optional[float] = None,
                    max_tokens: int = 8192, chunk_rows: Optional[int] = None) -> torch.Tensor:
    """The SFT loss of ``branches``, each its own causal sequence (no router loss; see
    :func:`treelit.linear_loss`). ``normalizer``: the step's Z (default: these branches' own)."""
    branches.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
    Z = branches.normalizer(aggregation) if normalizer is None else float(normalizer)
    coef = branches.coefficients(aggregation)
    coef = coef / Z if Z > 0 else np.zeros_like(coef)
    device = next(model.parameters()).device
    total = None
    for idx in linear_micro_batches([len(t) for t in branches.tokens], max_tokens):
        part = _group_loss(model, branches, idx, coef, chunk_rows, device)
        total = part if total is None else total + part
    return total


def padded_routing(routing, idx: List[int], L: int, device) -> Optional[torch.Tensor]:
    """``[rows, L, layers, k]`` recorded routing of branches ``idx`` (right-padded with -1), or None."""
    if routing is None:
        return None
    shape = routing[idx[0]].shape[1:]
    out = torch.full((len(idx), L, *shape), -1, dtype=torch.long)
    for r, i in enumerate(idx):
        out[r, : len(routing[i])] = torch.from_numpy(routing[i])
    return out.to(device)


def linear_branch_logprobs(model, branches, *, with_entropy: bool = False, max_tokens: int = 8192, chunk_rows=None,
                           routing=None, images=None):
    """Per branch (run as its own causal sequence), the log-prob of each token from position 1
    on, and optionally the entropy of each predicting distribution: lists of ``[L_b - 1]``.
    ``routing``: per-branch recorded MoE routing (``Branches.routing``) for routing replay;
    ``images``: per-branch images (``Branches.images``) for a vision model."""
    toks = [np.asarray(b, dtype=np.int64) for b in branches]
    device = next(model.parameters()).device
    logps: List[torch.Tensor] = [None] * len(toks)  # type: ignore[list-item]
    ents: List[Optional[torch.Tensor]] = [None] * len(toks)
    for idx in linear_micro_batches([len(t) for t in toks], max_tokens):
        L = max(len(toks[i]) for i in idx)
        ids = torch.zeros(len(idx), L, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(toks[i])] = torch.from_numpy(toks[i])
        ids = ids.to(device)
        pos = torch.arange(L, device=device).expand(len(idx), L)
        lengths = torch.tensor([len(toks[i]) for i in idx], device=device)
        rows = padded_routing(routing, idx, L, device)
        shown = row_images(images, idx)

        def run(m, rows=rows, shown=shown):
            h = decoder_hidden(m, ids, pos, CausalContext(lengths, rows, shown))
            return [
                token_logprobs(h[r, : len(toks[i]) - 1], output_weight(m), ids[r, 1 : len(toks[i])],
                               chunk_rows=chunk_rows, with_entropy=with_entropy)
                for r, i in enumerate(idx)
            ]

        for (lp, en), i in zip(in_forward(model, run), idx):
            logps[i], ents[i] = lp, en
    return logps, ents
