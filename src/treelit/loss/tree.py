"""Tree-mode forward and loss: every tree token computed once.

``tree_hidden`` runs the decoder over one DFS-serialized row with ancestor-only
attention; ``tree_loss`` reads each target token's log-prob from its parent's
hidden state and applies the folded weights of :mod:`treelit.tree.batch`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from treelit.attention.base import AttentionBackend, resolve_backend
from treelit.loss.logprobs import weighted_nll
from treelit.models.context import ExternalKV, TreeContext
from treelit.models.decoder import decoder_hidden, in_forward, output_weight
from treelit.tree.batch import TreeBatch, global_normalizer
from treelit.tree.token_tree import TokenTree

__all__ = ["tree_hidden", "tree_loss", "prepare_batch"]


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def prepare_batch(model, batch: Union[TreeBatch, TokenTree]) -> TreeBatch:
    """Accept a tree or a batch, check it against the model, move it to the model's device."""
    if isinstance(batch, TokenTree):
        batch = batch.to_batch()
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a TreeBatch or TokenTree, got {type(batch).__name__}")
    batch.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
    device = _model_device(model)
    return batch if batch.device == device else batch.to(device)


def tree_hidden(
    model,
    batch: TreeBatch,
    attention: Union[str, AttentionBackend, None] = "auto",
    *,
    external: Optional[ExternalKV] = None,
    capture_kv: bool = False,
    capture_tokens=None,
    embedding_grad_accumulator=None,
):
    """Final hidden states ``[N, D]`` of the row and the :class:`TreeContext` used.

    ``capture_kv`` keeps each attention layer's K/V, ``capture_tokens`` (row indices) makes
    recurrent layers return their state and convolution context right after those tokens
    (in ``ctx.captured`` / ``ctx.recurrent_out``)."""
    backend = resolve_backend(attention, batch.device, batch)
    ctx = TreeContext(batch, backend, external=external, capture_kv=capture_kv, capture_tokens=capture_tokens)
    ctx.embedding_grad_accumulator = embedding_grad_accumulator
    h = decoder_hidden(model, batch.input_ids[None], batch.position_ids[None], ctx)[0]
    return h, ctx


def tree_loss(
    model,
    batch: Union[TreeBatch, TokenTree],
    aggregation: str = "token-mean",
    attention: Union[str, AttentionBackend, None] = "auto",
    *,
    normalizer: Optional[float] = None,
    chunk_rows: Optional[int] = None,
    objective: str = "sft",
    router_normalizer: Optional[float] = None,
    metrics: Optional[dict] = None,
    **objective_options,
) -> torch.Tensor:
    """Exactly the per-branch training loss, computed on the tree.

    Args:
        model: a :class:`~treelit.models.decoder.TreeDecoder` (or compatible torchtune decoder).
        batch: a :class:`TreeBatch` (one packed row) or a :class:`TokenTree`.
        aggregation: ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum`` or ``sum``.
        attention: backend name (``auto``, ``sdpa_dense``, ``segment``, ``flex``) or instance.
        normalizer: the step-global normaliser Z (see :func:`treelit.global_normalizer`); by
            default this row's own.
        chunk_rows: rows per log-prob chunk (bounds the logits memory).
        objective: ``sft`` (default) or any registered objective (``ppo``, ``grpo``, ``gspo``,
            ``dpo``, ...) with its options as keyword arguments.
        router_normalizer: for mixture-of-experts models whose router loss is on, the step's
            router-loss normaliser (see :func:`treelit.loss.router.router_normalizer_contribution`;
            default: this batch's own), so that accumulated micro-batches equal one batch.
        metrics: a dict to receive the objective's metrics and ``router_aux_loss`` (the router
            load-balancing loss, before its coefficient) with the per-layer expert loads.

    A mixture-of-experts model whose router loss is on (``router_aux_loss_coef > 0``) adds
    ``router_aux_loss_coef x`` its load-balancing loss, exactly as per-branch training would.
    """
    from treelit.loss.router import router_aux

    with router_aux(model, router_normalizer) as aux:
        loss, found = _objective_tree_loss(model, batch, aggregation, attention, normalizer, chunk_rows, objective,
                                           objective_options)
        if aux is not None:
            loss = loss + aux.loss()
            found.update(aux.metrics())
    if metrics is not None:
        metrics.update(found)
    return loss


def _objective_tree_loss(model, batch, aggregation, attention, normalizer, chunk_rows, objective, options):
    if objective != "sft" or options:
        from treelit.objectives import make_objective

        obj = make_objective(objective, **options)
        loss, m = obj.tree_loss(model, batch if isinstance(batch, TreeBatch) else batch.to_batch(),
                                aggregation=aggregation, normalizer=normalizer, attention=attention, chunk_rows=chunk_rows)
        return loss, dict(m)
    return sft_tree_loss(model, batch, aggregation, attention, normalizer=normalizer, chunk_rows=chunk_rows), {}


def sft_tree_loss(model, batch, aggregation: str = "token-mean", attention="auto", *, normalizer=None,
                  chunk_rows=None) -> torch.Tensor:
    """The SFT loss of one tree row (no router loss; see :func:`tree_loss`)."""
    batch = prepare_batch(model, batch)
    W = batch.token_weights(aggregation)
    Z = global_normalizer([batch], aggregation) if normalizer is None else float(normalizer)

    def run(m):
        h, _ = tree_hidden(m, batch, attention)
        sel = torch.nonzero((W != 0) & (batch.parent >= 0)).squeeze(1)
        coef = W[sel] / Z if Z > 0 else torch.zeros_like(W[sel])
        return weighted_nll(h[batch.parent[sel]], output_weight(m), batch.input_ids[sel], coef.to(h.dtype), chunk_rows=chunk_rows)

    return in_forward(model, run)


def tree_token_logprobs(
    model,
    batch: TreeBatch,
    attention: Union[str, AttentionBackend, None] = "auto",
    *,
    select: Optional[torch.Tensor] = None,
    with_entropy: bool = False,
    chunk_rows: Optional[int] = None,
):
    """Log-probs (and entropies) of tree tokens ``select`` (default: every token that is a
    target in some branch), each read from its parent's hidden state.

    Returns ``(select [M], logp [M], entropy [M] or None)``.
    """
    from treelit.loss.logprobs import token_logprobs

    batch = prepare_batch(model, batch)
    if select is None:
        select = torch.nonzero((batch.target_count > 0) & (batch.parent >= 0)).squeeze(1)

    def run(m):
        h, _ = tree_hidden(m, batch, attention)
        return token_logprobs(
            h[batch.parent[select]], output_weight(m), batch.input_ids[select], chunk_rows=chunk_rows, with_entropy=with_entropy
        )

    logp, ent = in_forward(model, run)
    return select, logp, ent
