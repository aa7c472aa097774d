"""Tree-mode primitives: every tree token computed once.

``tree_hidden`` runs the decoder over one DFS-serialized row with ancestor-only
attention; ``sft_tree_loss`` reads each target token's log-prob from its parent's hidden
state and applies the folded weights of :mod:`treelit.tree.batch`; ``tree_token_logprobs``
gives objectives the log-probs (and entropies) of the targets. Objectives build their
losses from these; :func:`treelit.tree_loss` is the entry point.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from treelit.attention.base import AttentionBackend, resolve_backend
from treelit.loss.logprobs import token_logprobs, weighted_nll
from treelit.models.context import ExternalKV, TreeContext
from treelit.models.forward import decoder_hidden, in_forward, output_weight
from treelit.tree.batch import TreeBatch, global_normalizer
from treelit.tree.errors import TreeInputError
from treelit.tree.token_tree import TokenTree

__all__ = ["tree_hidden", "sft_tree_loss", "tree_token_logprobs", "prepare_batch"]


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def prepare_batch(model, batch: Union[TreeBatch, TokenTree]) -> TreeBatch:
    """Accept a tree or a batch, check it against the model, move it to the model's device."""
    if isinstance(batch, TokenTree):
        batch = batch.to_batch()
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a TreeBatch or TokenTree, got {type(batch).__name__}")
    batch.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
    if batch.images is not None and getattr(getattr(model, "module", model), "vision", None) is None:
        raise TreeInputError("the row has images and this model has no vision tower: load a vision checkpoint with "
                             "model=hf_auto model.vision=true")
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


def sft_tree_loss(model, batch, aggregation: str = "token-mean", attention="auto", *, normalizer=None,
                  chunk_rows=None) -> torch.Tensor:
    """The SFT loss of one tree row: the fused weighted NLL of every target with its folded
    weight (no router loss; see :func:`treelit.tree_loss`). ``normalizer``: the step's Z
    (default: this row's own)."""
    batch = prepare_batch(model, batch)
    W = batch.token_weights(aggregation)
    Z = global_normalizer([batch], aggregation) if normalizer is None else float(normalizer)

    def run(m):
        h, _ = tree_hidden(m, batch, attention)
        sel = batch.targets(batch.weight_field(aggregation))
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
    batch = prepare_batch(model, batch)
    if select is None:
        select = batch.targets()

    def run(m):
        h, _ = tree_hidden(m, batch, attention)
        return token_logprobs(
            h[batch.parent[select]], output_weight(m), batch.input_ids[select], chunk_rows=chunk_rows, with_entropy=with_entropy
        )

    logp, ent = in_forward(model, run)
    return select, logp, ent
