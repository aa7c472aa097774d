"""Context parallelism for trees: one tree row split over the C ranks of a group, exact.

A tree's DFS row is cut into C contiguous ranges of about equal memory (its tokens'
activations plus the path K/V it receives, :func:`memory_ranges`; the compute cost of
:func:`token_costs` gives ``imbalance``), and rank r runs the model on its range only. What
crosses ranks:

* **Attention.** In a DFS row every ancestor of a token comes before it, and the keys a
  query of range ``[s, e)`` sees outside the range are exactly the ancestors of token ``s``
  (key ``j < s`` is visible to query ``q >= s`` iff ``q < subtree_end[j]``, i.e. ``j`` is an
  ancestor of ``s``). So rank r needs, per attention layer, the K/V of the root-to-``s`` path
  and nothing else: never a sibling subtree. Each owner sends each later rank exactly the
  path rows it holds (point-to-point, one message per pair and layer, K and V together); the
  backward sends their gradients back to the owner, which adds them into its own K/V's
  gradient (:class:`_PathRows`, an autograd function: the gradients flow as in one process).
  The received rows are the external keys of the rank's row (:class:`~treelit.models.context.ExternalKV`):
  visible to every query of the range up to the end of their subtree, with their depths as
  positions (sliding windows), un-expanded (GQA).
* **Log-probs.** A target token's log-prob is computed by the rank that holds its parent's
  hidden state. Every rank's target log-probs (no gradient) are summed into one ``[N]``
  vector on every rank; the objective's loss and its gradient with respect to each log-prob
  are computed from that vector (any objective: sequence-level ones such as GSPO and DPO
  included, as in :mod:`treelit.partition.engine`); each rank then back-propagates
  ``sum(dL/dlogp * logp)`` over its own targets. The parameter gradients of the ranks sum
  to the one-process gradient (the caller sums them over the group: FSDP2 does).

* **Recurrent layers** (native Gated DeltaNet and Mamba2 layers; through the transformers
  adapter, the tree kernels of its hybrid families: Gated DeltaNet, Kimi Delta Attention, Mamba2
  and short convolutions, :mod:`treelit.models.hf_kernels`). Both read their convolution contexts
  and initial states through the context's hooks (``recurrent_conv_inputs``, ``recurrent_scan``),
  which this module's context overrides. A token of ``[s, e)`` whose
  parent lies outside the range has that parent on the root-to-``s`` path, so the range's
  roots continue that one path at several points: one external *slot* per distinct parent,
  each with its own initial state (seg_parent ``-2 - slot``, see
  :func:`~treelit.ssm.layout.external_layout`). Per recurrent layer:

  - the short convolutions' inputs of the path tokens within ``K-1`` ancestors of a range
    token travel like attention's K/V (:class:`_PathRows`: owners send, gradients return);
  - the states after the slots' parent tokens travel in rank order: rank r receives its
    slots' states from the earlier ranks that own the parents (:class:`_StateIn`), runs its
    scan, then sends the later ranks the states they need (:class:`_StateOut`, each owner's
    segments cut after those tokens so their states are segment ends). In the backward the
    order reverses: the last rank returns its initial states' gradients first, and each
    owner adds them to its sent states' gradients before back-propagating its own scan.

  Every rank runs every layer, so the messages of a layer match up; a rank waits only for
  earlier ranks in the forward and later ranks in the backward, never in a cycle. It waits for
  what it receives, not for what it sends: every send (states, path rows, their gradients) is
  left in flight and waited on at the end of the pass (:mod:`treelit.partition.p2p`), so a rank
  runs its next layers while the ranks after it take its states (waiting for each send where it
  was posted, ``p2p.BLOCKING``, tied the ranks to one another: every layer's exchange in
  lock-step). Each
  convolution exchange and each state of a layer has its own message tag (a transformers layer
  may run several, or share its index with an attention layer: Falcon-H1).

* **Router load-balancing loss** (mixture-of-experts models, :mod:`treelit.loss.router`). It is
  ``sum over tokens of G * probs`` with a weight G (no gradient) computed from every token's
  routing counts. Each rank records its range's counts, the counts and expert loads are summed
  over the group (the ranges are disjoint: the sum is the row's), and each rank adds its own
  tokens' ``G * probs`` to what it back-propagates; the loss value and metrics are the row's on
  every rank.

* **Partitioned passes** (:func:`cp_forward_pass`, used by :mod:`treelit.partition.engine`):
  each pass of a partition plan is split the same way; the pass's ancestor K/V (rows of
  earlier passes) sit in front of the path rows and are visible to the whole range. Each rank
  keeps only its own rows of them (:func:`cp_captures`, :class:`KVShard`); every attention
  layer of a pass below assembles them from the group as it runs and again in its backward
  (:class:`_WithAncestors`), and their gradients come back summed over the group into each
  owner's graph (:func:`cp_relay`). Recurrent layers: the pass's root continues its partition's
  outside state (one more slot, after the received ones) and convolution context (context rows
  after the received ones); the states and contexts at the pass's boundary tokens are
  assembled once, the same on every rank, their gradients summed over the group
  (:func:`cp_state_captures`). A router loss takes every rank's routing
  counts in a no-gradient pass first and sums them over the group.

Supported: PPO's critic, shared or separate (through :mod:`treelit.partition.engine`, which folds
each rank's pairs' value loss); native decoders with attention, Gated DeltaNet and Mamba2 layers; transformers
families through the adapter, attention-only and hybrid (Qwen3.5 / Qwen3-Next / OLMo-hybrid
Gated DeltaNet, Kimi-Linear KDA, Nemotron-H / Bamba / Granite-4 / Falcon-H1 Mamba2, LFM2 short
convolutions); every objective; the router loss; every attention backend that takes external
keys; partitioned passes (native and adapter layers alike). The recurrent exchange has run with
the torch scans (``ssm=torch``) and with fla's kernels under Triton's interpreter (native
layers, Qwen3.5 and Kimi-Linear through the adapter). Refused, with one line: native layer types other than attention, gdn and mamba2,
and an adapter layer calling a kernel that does not read its boundary inputs through the hooks
(none today).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from treelit.models.moe import collecting
from treelit.objectives.folding import fold_spec, loss_from_logprobs, target_selection
from treelit.partition import p2p
from treelit.partition.parts import PassPart, PassSpec, RouterPass
from treelit.tree.batch import TreeBatch

# every name of the plan, the exchanges and the passes stays reachable here (tests patch some of them)
from treelit.partition.cp_context import (cp_captures, cp_forward_pass, cp_relay, cp_state_captures, _CPContext,
                                          _drained, _forward_range)
from treelit.partition.cp_exchange import (_ancestor_grads, _ancestor_rows, _AncestorsIdle, _assembled, _attend,
                                           _exchange, _global, KVShard, _owners, _PathRows, _Recurrent,
                                           _recurrent_route, _RECURRENT_TAGS, _route, _Route, _StateIn, _StateOut,
                                           TRAFFIC, Traffic, _WithAncestors, _zeros_of_captures)
from treelit.partition.cp_plan import (_ancestors, _ATTENTION_KINDS, check_cp_backend, check_cp_degree, check_cp_model,
                                       cp_chunk_rows, cp_plan, cp_ranges, cp_split, CPPlan, has_recurrent_layers,
                                       _kv_width, memory_ranges, _NATIVE_RECURRENT, _owner, path_weight,
                                       score_pair_bytes, _shape, token_costs)  # noqa: F401

# (the plan, the exchanges and the passes live in cp_plan, cp_exchange and cp_context; their names stay here)
__all__ = ["TRAFFIC", "Traffic", "KVShard", "CPPlan", "cp_plan", "cp_ranges", "token_costs", "cp_micro_batch",
           "cp_passes", "cp_logprobs", "check_cp_model", "check_cp_backend", "check_cp_degree", "cp_split",
           "memory_ranges", "path_weight", "score_pair_bytes", "cp_chunk_rows", "has_recurrent_layers",
           "cp_forward_pass", "cp_captures", "cp_state_captures", "cp_relay", "_CPContext", "_StateIn", "_StateOut",
           "_drained"]


def _full(values: torch.Tensor, tokens: torch.Tensor, N: int, group) -> torch.Tensor:
    """Every rank's values at its tokens, as one ``[N]`` float64 vector on every rank."""
    out = torch.zeros(N, dtype=torch.float64, device=values.device)
    out[tokens] = values.detach().double()
    dist.all_reduce(out, group=group)
    return out


def cp_logprobs(model, batch: TreeBatch, group, *, attention: Any = "auto", chunk_rows=None,
                costs: Optional[np.ndarray] = None) -> torch.Tensor:
    """No-gradient log-probs ``[N]`` of every target token (NaN elsewhere) under context
    parallelism (e.g. the reference model's)."""
    C, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = cp_split(batch, C, rank, model, costs)
    chunk_rows = cp_chunk_rows(chunk_rows, model, C)
    with torch.no_grad():
        tok, logp, _, _ = _forward_range(model, batch, plan, group, attention, chunk_rows, False)
        full = _full(logp, tok, batch.num_tokens, group)
    out = torch.full_like(full, float("nan"))
    sel = target_selection(batch)
    out[sel] = full[sel]
    return out


class _LastPass:
    """A router-loss collector (:func:`~treelit.models.moe.collecting`) that keeps the context
    of the forward pass, whose MoE layers recorded their router logits in it."""

    ctx = None

    def record(self, ctx) -> None:
        self.ctx = ctx


def cp_micro_batch(model, objective, batch: TreeBatch, group, *, aggregation: str, normalizer: float,
                   attention: Any = "auto", chunk_rows: Optional[int] = None,
                   costs: Optional[np.ndarray] = None,
                   router_normalizer: Optional[float] = None) -> Tuple[float, Dict[str, float], CPPlan]:
    """Forward and backward ``batch`` split over the ranks of ``group`` (accumulating ``.grad``:
    the ranks' gradients sum to the one-process gradient). Returns the loss (every rank the
    same), the objective's metrics and this rank's plan. A mixture-of-experts model whose router
    loss is on adds it (``router_normalizer``: its step normaliser, see :mod:`treelit.loss.router`;
    the ranges' routing counts are summed over the group, each rank adds its own tokens' share).
    The keyword face of :func:`cp_passes`."""
    spec = PassSpec(aggregation, normalizer, None, attention, chunk_rows, group)
    return cp_passes(model, objective, batch, spec, [RouterPass(router_normalizer)], costs)


def cp_passes(model, objective, batch: TreeBatch, spec, parts: Sequence[PassPart] = (),
              costs: Optional[np.ndarray] = None) -> Tuple[float, Dict[str, float], CPPlan]:
    """:func:`cp_micro_batch` with a ``PassSpec`` (its budget unused: one pass per row) and the
    pass parts to fold (:mod:`treelit.partition.parts`; each that binds adds its
    :meth:`~treelit.partition.parts.PassPart.on_split_row` term, value and metrics)."""
    check_cp_model(model)
    group, aggregation, normalizer, attention = spec.cp_group, spec.aggregation, spec.normalizer, spec.attention
    C, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk_rows = cp_chunk_rows(spec.chunk_rows, model, C)
    plan = cp_split(batch, C, rank, model, costs)
    fold = fold_spec(objective)
    ref = None
    if fold.reference_model:
        with objective.as_reference(model) as reference:
            ref = cp_logprobs(reference, batch, group, attention=attention, chunk_rows=chunk_rows, costs=costs)
    with collecting(model, _LastPass()) as last:  # the pass's router logits (MoE layers)
        tok, logp, ent, h = _forward_range(model, batch, plan, group, attention, chunk_rows, fold.needs_entropy)
    N = batch.num_tokens
    sel = target_selection(batch)
    full_lp = _full(logp, tok, N, group)
    full_en = _full(ent, tok, N, group) if ent is not None else None
    dtype = logp.dtype
    leaf_lp = full_lp[sel].to(dtype).requires_grad_()
    leaf_en = full_en[sel].to(dtype).requires_grad_() if full_en is not None else None
    with torch.enable_grad():
        loss, metrics = loss_from_logprobs(objective, batch, sel, leaf_lp, leaf_en, aggregation=aggregation,
                                           normalizer=normalizer, ref=ref)
        inputs = [leaf_lp] + ([leaf_en] if leaf_en is not None else [])
        g = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else [None] * len(inputs)
    g_lp = torch.zeros(N, dtype=torch.float64, device=batch.device)
    if g[0] is not None:
        g_lp[sel] = g[0].double()
    surrogate = (g_lp[tok].to(logp.dtype) * logp).sum()
    if leaf_en is not None and g[1] is not None:
        g_en = torch.zeros(N, dtype=torch.float64, device=batch.device)
        g_en[sel] = g[1].double()
        surrogate = surrogate + (g_en[tok].to(ent.dtype) * ent).sum()
    value = float(loss.detach())
    row = _Row(model, batch, sel)
    own = torch.arange(plan.start, plan.end, device=batch.device)
    for part in parts:  # + this rank's tokens' share of each part's term (e.g. the router loss)
        if not part.bind(row):
            continue
        surrogate = surrogate + part.on_split_row(last.ctx, own, group)
        value += part.value()
        metrics = {**metrics, **part.metrics()}
    # every rank back-propagates through every layer (the path K/V gradients it owes the
    # other ranks travel in that backward), whether or not it holds targets
    # (the sends this backward leaves in flight are waited on at its end: p2p's final callback)
    try:
        (surrogate + 0.0 * h.sum()).backward()
    except BaseException:
        p2p.abandon()
        raise
    return value, {k: float(v) for k, v in metrics.items()}, plan


@dataclass
class _Row:
    """What a pass part binds to in :func:`cp_passes`: the model, the batch and its targets."""

    model: Any
    batch: TreeBatch
    sel: torch.Tensor
