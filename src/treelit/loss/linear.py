"""The linearized baseline: every branch is its own causal sequence.

This is what per-branch training computes, written without any tree code: branches
are sorted by length and run in right-padded micro-batches through the same model
(causal SDPA, positions ``0..L-1``) and the same log-prob head. Token ``t`` of a
branch is predicted from position ``t-1`` and counts iff its loss mask is set.
It is the reference for exactness tests and the baseline for speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from treelit.loss.logprobs import weighted_nll
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden, in_forward, output_weight
from treelit.tree.batch import check_aggregation
from treelit.tree.token_tree import TreeInputError, _as_mask_array, _as_token_array

__all__ = ["LinearBranches", "linear_loss", "linear_backward", "linear_micro_batches"]


@dataclass
class LinearBranches:
    """Validated branches with their targets counted: ``n[b]`` trainable targets per branch."""

    tokens: List[np.ndarray]
    masks: List[np.ndarray]  # target mask (first position cleared)
    weights: np.ndarray
    n: np.ndarray

    @classmethod
    def build(cls, branches, loss_masks=None, weights=None) -> "LinearBranches":
        if len(branches) == 0:
            raise TreeInputError("need at least one branch")
        toks = [_as_token_array(b, i, "") for i, b in enumerate(branches)]
        if loss_masks is None:
            masks = [np.ones(len(t), dtype=bool) for t in toks]
        else:
            if len(loss_masks) != len(toks):
                raise TreeInputError(f"got {len(loss_masks)} loss masks for {len(toks)} branches")
            masks = [
                np.ones(len(t), dtype=bool) if m is None else _as_mask_array(m, len(t), i, "").copy()
                for i, (t, m) in enumerate(zip(toks, loss_masks))
            ]
        for m in masks:
            m[0] = False  # nothing predicts a branch's first token
        w = np.ones(len(toks)) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape[0] != len(toks):
            raise TreeInputError(f"got {w.shape[0]} weights for {len(toks)} branches")
        if not np.all(np.isfinite(w) & (w >= 0)):
            b = int(np.flatnonzero(~(np.isfinite(w) & (w >= 0)))[0])
            raise TreeInputError(f"branch {b}: weight {float(w[b])!r} must be finite and >= 0")
        n = np.array([m.sum() for m in masks], dtype=np.float64)
        return cls(toks, masks, w, n)

    def coefficients(self, aggregation: str) -> np.ndarray:
        """Per-branch coefficient c_b multiplying each of its token losses (before 1/Z)."""
        check_aggregation(aggregation)
        if aggregation == "seq-mean-token-mean":
            return self.weights * np.divide(1.0, self.n, out=np.zeros_like(self.n), where=self.n > 0)
        return self.weights.copy()

    def normalizer(self, aggregation: str) -> float:
        check_aggregation(aggregation)
        if aggregation == "token-mean":
            return float(self.n.sum())
        if aggregation == "sum":
            return 1.0
        return float((self.n > 0).sum())

    def validate_for_model(self, vocab_size: int, max_seq_len: Optional[int]) -> None:
        for b, t in enumerate(self.tokens):
            if t.max() >= vocab_size:
                pos = int(np.argmax(t >= vocab_size))
                raise TreeInputError(
                    f"token id {int(t[pos])} at position {pos} of branch {b} is outside the model's "
                    f"vocabulary (size {vocab_size})"
                )
            if max_seq_len is not None and len(t) > max_seq_len:
                raise TreeInputError(f"branch {b} has {len(t)} tokens, more than the model's max_seq_len {max_seq_len}")


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

    def run(m):
        h = decoder_hidden(m, ids, pos, CausalContext(lengths))
        rows, cols = torch.nonzero(tmask, as_tuple=True)
        return weighted_nll(h[rows, cols - 1], output_weight(m), ids[rows, cols], c[rows, cols].to(h.dtype), chunk_rows=chunk_rows)

    return in_forward(model, run)


def _prepare(model, branches, loss_masks, weights, aggregation, normalizer):
    """Validate, and return the branches with their coefficients c_b / Z."""
    lb = branches if isinstance(branches, LinearBranches) else LinearBranches.build(branches, loss_masks, weights)
    lb.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
    Z = lb.normalizer(aggregation) if normalizer is None else float(normalizer)
    coef = lb.coefficients(aggregation)
    return lb, (coef / Z if Z > 0 else np.zeros_like(coef))


def linear_loss(
    model,
    branches,
    loss_masks=None,
    weights=None,
    aggregation: str = "token-mean",
    *,
    normalizer: Optional[float] = None,
    max_tokens: int = 8192,
    chunk_rows: Optional[int] = None,
    objective: str = "sft",
    advantages=None,
    old_logprobs=None,
    ref_logprobs=None,
    branch_fields=None,
    router_normalizer: Optional[float] = None,
    metrics: Optional[dict] = None,
    **objective_options,
) -> torch.Tensor:
    """Per-branch (linearized) loss; differentiable. ``normalizer`` overrides Z (global over a step).

    ``objective`` (with its options) selects an RL objective; the per-branch RL inputs are
    ``advantages``, ``old_logprobs``, ``ref_logprobs`` and ``branch_fields`` (``pair``/``chosen``
    for DPO), as for :meth:`TokenTree.from_branches`. A mixture-of-experts model whose router
    loss is on adds it over all the branches (``router_normalizer``, ``metrics``: as for
    :func:`treelit.tree_loss`).
    """
    from treelit.loss.router import router_aux

    with router_aux(model, router_normalizer) as aux:
        loss = _linear_objective_loss(model, branches, loss_masks, weights, aggregation, normalizer, max_tokens,
                                      chunk_rows, objective, advantages, old_logprobs, ref_logprobs, branch_fields,
                                      objective_options)
        if aux is not None:
            loss = loss + aux.loss()
            if metrics is not None:
                metrics.update(aux.metrics())
    return loss


def _linear_objective_loss(model, branches, loss_masks, weights, aggregation, normalizer, max_tokens, chunk_rows,
                           objective, advantages, old_logprobs, ref_logprobs, branch_fields, objective_options):
    if objective != "sft" or objective_options:
        from treelit.objectives import make_objective
        from treelit.tree.token_tree import TokenTree

        tree = TokenTree.from_branches(branches, loss_masks, weights, advantages=advantages, old_logprobs=old_logprobs,
                                       ref_logprobs=ref_logprobs, branch_fields=branch_fields)
        obj = make_objective(objective, **objective_options)
        return obj.linear_loss(model, tree.to_batch(), aggregation=aggregation, normalizer=normalizer, chunk_rows=chunk_rows)[0]
    lb, coef = _prepare(model, branches, loss_masks, weights, aggregation, normalizer)
    device = next(model.parameters()).device
    total = None
    for idx in linear_micro_batches([len(t) for t in lb.tokens], max_tokens):
        part = _group_loss(model, lb, idx, coef, chunk_rows, device)
        total = part if total is None else total + part
    return total


def linear_backward(
    model,
    branches,
    loss_masks=None,
    weights=None,
    aggregation: str = "token-mean",
    *,
    normalizer: Optional[float] = None,
    max_tokens: int = 8192,
    chunk_rows: Optional[int] = None,
) -> float:
    """Per-branch training step as a trainer runs it: forward and backward per micro-batch,
    accumulating ``.grad``. Returns the loss value. (A mixture-of-experts model whose router
    loss is on needs every branch's routing before any backward: one graph then.)"""
    from treelit.loss.router import moe_options

    if moe_options(model) is not None:
        loss = linear_loss(model, branches, loss_masks, weights, aggregation, normalizer=normalizer,
                           max_tokens=max_tokens, chunk_rows=chunk_rows)
        loss.backward()
        return float(loss.detach())
    lb, coef = _prepare(model, branches, loss_masks, weights, aggregation, normalizer)
    device = next(model.parameters()).device
    total = 0.0
    for idx in linear_micro_batches([len(t) for t in lb.tokens], max_tokens):
        part = _group_loss(model, lb, idx, coef, chunk_rows, device)
        part.backward()
        total += float(part.detach())
    return total


def branches_from_batch(batch):
    """The branches of a :class:`~treelit.tree.batch.TreeBatch` as (token arrays, masks, weights)."""
    ptr = batch.branch_ptr.cpu().numpy()
    toks = batch.input_ids.cpu().numpy()[batch.branch_tokens.cpu().numpy()]
    mask = batch.branch_mask.cpu().numpy()
    branches = [toks[ptr[b] : ptr[b + 1]] for b in range(len(ptr) - 1)]
    masks = [mask[ptr[b] : ptr[b + 1]] for b in range(len(ptr) - 1)]
    return branches, masks, batch.branch_weight.cpu().numpy()


def linear_branch_logprobs(model, branches, *, with_entropy: bool = False, max_tokens: int = 8192, chunk_rows=None):
    """Per branch (run as its own causal sequence), the log-prob of each token from position 1
    on, and optionally the entropy of each predicting distribution: lists of ``[L_b - 1]``."""
    from treelit.loss.logprobs import token_logprobs

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

        def run(m):
            h = decoder_hidden(m, ids, pos, CausalContext(lengths))
            return [
                token_logprobs(h[r, : len(toks[i]) - 1], output_weight(m), ids[r, 1 : len(toks[i])],
                               chunk_rows=chunk_rows, with_entropy=with_entropy)
                for r, i in enumerate(idx)
            ]

        for (lp, en), i in zip(in_forward(model, run), idx):
            logps[i], ents[i] = lp, en
    return logps, ents
