"""The loss entry points: ``tree_loss``, ``linear_loss``, ``linear_backward``.

Every loss runs objective -> loss primitives -> decoder -> attention backend: these entry
points pick the objective (``sft`` by default, any registered one by name), hand it the
batch (a tree, or per-branch :class:`~treelit.loss.branches.Branches`), and add what is
not the objective's own: the router load-balancing loss of mixture-of-experts models
(:mod:`treelit.loss.router`), collected over the objective's forward passes.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from treelit.attention.base import AttentionBackend
from treelit.loss.branches import Branches
from treelit.loss.linear import _group_loss, linear_micro_batches
from treelit.loss.router import moe_options, router_aux
from treelit.objectives.base import Objective, make_objective
# global_normalizer is treelit.global_normalizer from here: objective names resolve, the objectives are loaded
from treelit.tree.batch import TreeBatch, global_normalizer
from treelit.tree.token_tree import TokenTree

__all__ = ["tree_loss", "linear_loss", "linear_backward", "global_normalizer"]


def _objective(objective: Union[str, Objective], options) -> Objective:
    if isinstance(objective, Objective):
        if options:
            raise TypeError("objective options are given with an objective name, not with an objective instance")
        return objective
    return make_objective(objective, **options)


def _with_router_loss(model, router_normalizer, metrics, run) -> torch.Tensor:
    """``run()``'s loss (an objective's ``(loss, metrics)``) plus the router loss recorded while it
    ran, for mixture-of-experts models whose router loss is on; metrics into ``metrics``."""
    with router_aux(model, router_normalizer) as aux:
        loss, found = run()
        found = dict(found)
        if aux is not None:
            loss = loss + aux.loss()
            found.update(aux.metrics())
    if metrics is not None:
        metrics.update(found)
    return loss


def tree_loss(
    model,
    batch: Union[TreeBatch, TokenTree],
    aggregation: str = "token-mean",
    attention: Union[str, AttentionBackend, None] = "auto",
    *,
    normalizer: Optional[float] = None,
    chunk_rows: Optional[int] = None,
    objective: Union[str, Objective] = "sft",
    router_normalizer: Optional[float] = None,
    metrics: Optional[dict] = None,
    **objective_options: Any,
) -> torch.Tensor:
    """Exactly the per-branch training loss, computed on the tree.

    Args:
        model: a :class:`~treelit.models.decoder.TreeDecoder`, or a transformers model wrapped
            by :func:`treelit.load_hf_model`.
        batch: a :class:`TreeBatch` (one packed row) or a :class:`TokenTree`.
        aggregation: ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum`` or ``sum``.
        attention: backend name (``auto``, ``sdpa_dense``, ``segment``, ``flex``) or instance.
        normalizer: the step-global normaliser Z (see :func:`treelit.global_normalizer`); by
            default this row's own.
        chunk_rows: rows per log-prob chunk (bounds the logits memory).
        objective: ``sft`` (default), any registered objective name (``ppo``, ``grpo``, ``gspo``,
            ``dpo``, ...) with its options as keyword arguments, or an objective instance.
        router_normalizer: for mixture-of-experts models whose router loss is on, the step's
            router-loss normaliser (see :func:`treelit.loss.router.router_normalizer_contribution`;
            default: this batch's own), so that accumulated micro-batches equal one batch.
        metrics: a dict to receive the objective's metrics and ``router_aux_loss`` (the router
            load-balancing loss, before its coefficient) with the per-layer expert loads.

    A mixture-of-experts model whose router loss is on (``router_aux_loss_coef > 0``) adds
    ``router_aux_loss_coef x`` its load-balancing loss, exactly as per-branch training would.
    """
    obj = _objective(objective, objective_options)
    if isinstance(batch, TokenTree):
        batch = batch.to_batch()
    return _with_router_loss(model, router_normalizer, metrics, lambda: obj.tree_loss(
        model, batch, aggregation=aggregation, normalizer=normalizer, attention=attention, chunk_rows=chunk_rows))


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
    objective: Union[str, Objective] = "sft",
    advantages=None,
    old_logprobs=None,
    ref_logprobs=None,
    branch_fields=None,
    router_normalizer: Optional[float] = None,
    metrics: Optional[dict] = None,
    **objective_options: Any,
) -> torch.Tensor:
    """Per-branch (linearized) loss, differentiable: every branch its own causal sequence, no
    tree built. ``branches``: token-id lists (with ``loss_masks``, ``weights`` and the RL
    inputs ``advantages``, ``old_logprobs``, ``ref_logprobs``, ``branch_fields`` -
    ``pair``/``chosen`` for DPO - per branch), or a :class:`Branches`. Other arguments as for
    :func:`tree_loss`; a mixture-of-experts model's router loss is over all the branches."""
    obj = _objective(objective, objective_options)
    if not isinstance(branches, Branches):
        branches = Branches.build(branches, loss_masks, weights, advantages=advantages, old_logprobs=old_logprobs,
                                  ref_logprobs=ref_logprobs, branch_fields=branch_fields)
    return _with_router_loss(model, router_normalizer, metrics, lambda: obj.linear_loss(
        model, branches, aggregation=aggregation, normalizer=normalizer, chunk_rows=chunk_rows, max_tokens=max_tokens))


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
    """Per-branch SFT step as a trainer runs it: forward and backward per micro-batch of
    branches, accumulating ``.grad``. Returns the loss value. (A mixture-of-experts model
    whose router loss is on needs every branch's routing before any backward: one graph then.)"""
    if moe_options(model) is not None:
        loss = linear_loss(model, branches, loss_masks, weights, aggregation, normalizer=normalizer,
                           max_tokens=max_tokens, chunk_rows=chunk_rows)
        loss.backward()
        return float(loss.detach())
    lb = branches if isinstance(branches, Branches) else Branches.build(branches, loss_masks, weights)
    lb.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
    Z = lb.normalizer(aggregation) if normalizer is None else float(normalizer)
    coef = lb.coefficients(aggregation)
    coef = coef / Z if Z > 0 else coef * 0.0
    device = next(model.parameters()).device
    total = 0.0
    for idx in linear_micro_batches([len(t) for t in lb.tokens], max_tokens):
        part = _group_loss(model, lb, idx, coef, chunk_rows, device)
        part.backward()
        total += float(part.detach())
    return total
