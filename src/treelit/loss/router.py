"""The router load-balancing loss of mixture-of-experts models, exact on trees.

With per-token top-k indicators ``m_e(t)`` and router probabilities ``p_e(t)`` of each
MoE layer, the Switch-style balance loss over a set S of (branch, position) pairs is

    aux = E * sum_e f_e P_e,   f_e = mean over S and layers of m_e,   P_e = same of p_e

(transformers' ``load_balancing_loss_func``: counts and probabilities pooled over the
layers, padding masked). It is not a sum over tokens, so counting a shared token once
would change it. Two definitions, each equal on a tree to the per-branch computation:

* ``micro_batch``: S = every token of every branch of the micro-batch (the branches run
  as one padded batch). On a tree, token t stands for the c(t) branches through it:
  ``f_e = sum_t c(t) m_e(t) / C``, ``P_e`` likewise, ``C = layers * sum_t c(t)``.
* ``sequence``: each branch's own balance loss on its own tokens, averaged over branches
  (``f_{b,e}``, ``P_{b,e}`` are sums along the branch's path).

Under routing replay (``moe.routing=replay``) ``m_e(t)`` indicates the *replayed* experts of
token t (the recorded ones; the live top-k where none was recorded), and ``p_e(t)`` stays the
current router's softmax: the loss then balances the assignment the policy is trained on,
and its gradient still reaches the router through P.

The indicators carry no gradient, so given the counts F the loss is linear in the
probabilities: ``aux = sum_t sum_e G(t, e) sum_layers p_e(t)`` with a per-token weight G
(micro_batch: ``E F_e c(t) / C^2``; sequence: ``sum over branches b through t of
E F_{b,e} / (B (L n_b)^2)``). That is how it is computed here: F and G without gradient,
then one weighted sum of the probabilities, so no branch-sized copy of the router output
is ever formed, and a partitioned pass (or a context-parallel rank, its range's counts summed
over the group) can add its own tokens' share once the counts are known.

Usage: :func:`router_aux` opens a collection around a micro-batch's forward passes of
``model``; every pass's router logits (recorded by the MoE layers in the sequence
context) are gathered, and ``aux.loss()`` returns ``coef * aux / normalizer`` (the
normaliser makes accumulation exact: ``micro_batch`` averages over the step's
micro-batches, ``sequence`` over its branches).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from treelit.models.moe import collecting, is_collecting, router_dtype

__all__ = ["RouterAux", "RouterTerms", "router_aux", "moe_options", "router_normalizer_contribution", "token_weights"]


def _param_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def moe_options(model) -> Optional[Dict]:
    """The model's MoE options when its router loss is on (coefficient > 0), else None."""
    cfg = getattr(model, "config", None)
    moe = getattr(cfg, "moe", None)
    if not moe or float(moe.get("router_aux_loss_coef", 0.0)) <= 0:
        return None
    return moe


def router_normalizer_contribution(model, batch) -> float:
    """This micro-batch's share of the step's router-loss normaliser (summed over micro-batches
    and ranks): 1 per micro-batch with branches (``micro_batch``), its branches (``sequence``)."""
    moe = moe_options(model)
    if moe is None:
        return 0.0
    n = batch.num_branches
    if moe["router_aux_loss"] == "sequence":
        return float(n)
    return 1.0 if n > 0 else 0.0


@dataclass
class _Pass:
    probs: torch.Tensor  # [T, E]: router probabilities summed over the MoE layers (with grad)
    counts: torch.Tensor  # [T, E]: top-k indicators summed over the layers (float64, no grad)
    c: torch.Tensor  # [T]: branches each row stands for (micro_batch weight)
    tokens: torch.Tensor  # [F]: row of every (branch, token) pair ...
    branch: torch.Tensor  # [F]: ... and its branch (numbered within the collection)


def token_weights(passes: List[_Pass], definition: str, E: int, L: int, B: int) -> List[torch.Tensor]:
    """The per-token weights G ``[T, E]`` of each pass (no gradient) from the routing counts of
    all of them (see the module docstring); ``B`` branches in all, ``L`` MoE layers."""
    if definition == "micro_batch":
        F = sum((p.counts * p.c[:, None]).sum(0) for p in passes)
        C = L * float(sum(p.c.sum() for p in passes))
        return [(E * F[None, :] * p.c[:, None] / (C * C)) for p in passes]
    # sequence: each branch's counts along its own tokens, then G(t) = sum over branches through t
    dev = passes[0].counts.device
    F = torch.zeros(B, E, dtype=torch.float64, device=dev)
    n = torch.zeros(B, dtype=torch.float64, device=dev)
    for p in passes:
        F.index_add_(0, p.branch, p.counts[p.tokens])
        n.index_add_(0, p.branch, torch.ones(p.branch.shape, dtype=torch.float64, device=dev))
    w = F * (E / ((L * n).clamp(min=1) ** 2 * max(B, 1)))[:, None]  # [B, E]
    return [torch.zeros_like(p.counts).index_add_(0, p.tokens, w[p.branch]) for p in passes]


def _routing(ctx, top_k: int, rows=None):
    """(probabilities [T, E] summed over the recorded MoE layers (with gradient), top-k
    indicators [T, E] summed likewise (float64), per-layer indicators [layers, T, E] summed
    over tokens are left to the caller) for the recorded router logits of ``ctx``."""
    ids = sorted(ctx.router_logits)
    probs = counts = None
    per_layer = []
    replayed = getattr(ctx, "router_experts", {})
    for k in ids:
        x = ctx.router_logits[k]
        p = torch.softmax(x.to(router_dtype(x.dtype)), dim=-1)
        if rows is not None:
            p = p.index_select(0, rows)
        _, idx = torch.topk(p.detach(), top_k, dim=-1)
        if k in replayed:  # routing replay: the indicators of the experts the tokens were sent to
            r = replayed[k].to(idx.device)
            r = r if rows is None else r.index_select(0, rows)
            idx = torch.where(r[:, :1] >= 0, r, idx)
        m = torch.zeros(p.shape, dtype=torch.float64, device=p.device).scatter_(1, idx, 1.0)
        per_layer.append(m)
        probs = p if probs is None else probs + p
        counts = m if counts is None else counts + m
    return ids, probs, counts, per_layer


@dataclass
class RouterAux:
    """Router logits of a micro-batch's forward passes, and the loss they give."""

    model: object
    definition: str
    coef: float
    top_k: int
    num_experts: int
    normalizer: Optional[float] = None
    passes: List[_Pass] = field(default_factory=list)
    layers: int = 0
    layer_ids: List[int] = field(default_factory=list)
    _branches: int = 0
    layer_load: Optional[torch.Tensor] = None  # [layers, E] assignments, branch-weighted (metrics)

    # collection -------------------------------------------------------------------------
    def _stack(self, ctx, rows: Optional[torch.Tensor], c: torch.Tensor):
        """Probabilities and top-k indicators of the recorded layers, summed over the layers, at
        ``rows`` (None: all); per-layer loads (weighted by ``c``) go to the metrics."""
        self.layer_ids, probs, counts, per_layer = _routing(ctx, self.top_k, rows)
        self.layers = len(self.layer_ids)
        load = torch.stack([(m * c[:, None]).sum(0) for m in per_layer])
        self.layer_load = load if self.layer_load is None else self.layer_load + load
        return probs, counts

    def add_tree(self, ctx, batch) -> None:
        """A tree row: token t stands for the branches through it."""
        if getattr(ctx, "external", None) is not None:
            raise NotImplementedError("the router load-balancing loss is not computed on partitioned passes")
        c = torch.bincount(batch.branch_tokens, minlength=batch.num_tokens).to(torch.float64)
        probs, counts = self._stack(ctx, None, c)
        ptr = batch.branch_ptr
        branch = torch.repeat_interleave(torch.arange(batch.num_branches, device=ptr.device), ptr[1:] - ptr[:-1])
        self._add(_Pass(probs, counts, c, batch.branch_tokens, branch + self._branches), batch.num_branches)

    def add_causal(self, ctx, lengths: Optional[torch.Tensor]) -> None:
        """Right-padded causal rows, one branch each (padding masked out)."""
        T = next(iter(ctx.router_logits.values())).shape[0]
        B = lengths.shape[0] if lengths is not None else 1
        L = T // B
        dev = next(iter(ctx.router_logits.values())).device
        if lengths is None:
            lengths = torch.full((B,), L, device=dev)
        real = (torch.arange(L, device=dev)[None, :] < lengths.to(dev)[:, None]).reshape(-1)
        rows = torch.nonzero(real).squeeze(1)
        c = torch.ones(rows.shape[0], dtype=torch.float64, device=dev)
        probs, counts = self._stack(ctx, rows, c)
        branch = torch.arange(B, device=dev).repeat_interleave(L)[rows]
        local = torch.arange(rows.shape[0], device=dev)
        self._add(_Pass(probs, counts, c, local, branch + self._branches), B)

    def _add(self, p: _Pass, branches: int) -> None:
        self.passes.append(p)
        self._branches += branches

    # the loss ------------------------------------------------------------------------------
    def weights(self) -> List[torch.Tensor]:
        """G per pass ``[T, E]`` (no gradient): the loss is ``sum over passes of (G * probs).sum()``."""
        return token_weights(self.passes, self.definition, self.num_experts, max(self.layers, 1), self._branches)

    def aux(self) -> torch.Tensor:
        """The balance loss (``micro_batch``: of the collected branches; ``sequence``: the mean
        over them of each branch's own)."""
        if not self.passes:
            return torch.zeros(())
        G = self.weights()
        total = sum((g.to(p.probs.dtype) * p.probs).sum() for g, p in zip(G, self.passes))
        return total.to(self.passes[0].probs.dtype if self.model is None else _param_dtype(self.model))

    def loss(self) -> torch.Tensor:
        """``coef * aux``, divided by the step normaliser relative to this micro-batch's own."""
        if not self.passes:
            return torch.zeros(())
        own = 1.0 if self.definition == "micro_batch" else float(self._branches)
        scale = 1.0 if self.normalizer is None else own / float(self.normalizer)
        return self.coef * scale * self.aux()

    def metrics(self) -> Dict[str, float]:
        """``router_aux_loss`` (the balance loss, before the coefficient) and, per MoE layer, the
        busiest expert's share of the assignments over the mean share (1 = balanced)."""
        if self.layer_load is None:
            return {}
        return _metrics(float(self.aux().detach()), self.layer_ids, self.layer_load)


    def record(self, ctx) -> None:
        """Called by the decoder after each forward pass of the model (see models.moe)."""
        if ctx.kind == "tree":
            self.add_tree(ctx, ctx.batch)
        else:
            self.add_causal(ctx, ctx.lengths)


def _metrics(aux: float, layer_ids: List[int], layer_load: torch.Tensor) -> Dict[str, float]:
    out = {"router_aux_loss": aux}
    share = layer_load / layer_load.sum(-1, keepdim=True).clamp(min=1e-30)
    ratio = share.max(-1).values / share.mean(-1)
    for i, r in zip(layer_ids, ratio.tolist()):
        out[f"moe/layer{i}_load_max_over_mean"] = r
    out["moe/load_max_over_mean"] = float(ratio.max())
    return out


class RouterTerms:
    """The router loss of one tree row run as several passes (partitions).

    Every pass adds ``coef * (G * probs).sum()`` over its own tokens. G needs the routing of
    every token of the row, so a row cut into several passes first records the routing
    counts of each pass in a no-gradient pass (:meth:`add_counts`); a row run as one pass
    takes them from that pass itself."""

    def __init__(self, model, batch, normalizer: Optional[float] = None) -> None:
        moe = moe_options(model)
        self.coef, self.definition = float(moe["router_aux_loss_coef"]), moe["router_aux_loss"]
        self.E, self.top_k = int(moe["num_experts"]), int(moe["top_k"])
        self.batch = batch
        own = 1.0 if self.definition == "micro_batch" else float(batch.num_branches)
        self.scale = 1.0 if normalizer is None else own / float(normalizer)
        self.counts = torch.zeros(batch.num_tokens, self.E, dtype=torch.float64, device=batch.device)
        self.layer_ids: List[int] = []
        self.layer_load: Optional[torch.Tensor] = None
        self._G: Optional[torch.Tensor] = None
        self.value = 0.0  # the balance loss accumulated over the passes (before coef and scale)

    @staticmethod
    def enabled(model) -> bool:
        return moe_options(model) is not None

    def add_counts(self, ctx, tokens: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        """Routing of a pass over row tokens ``tokens`` (no gradient needed), read from the pass's
        rows ``rows`` (None: all of them)."""
        c = torch.bincount(self.batch.branch_tokens, minlength=self.batch.num_tokens).to(torch.float64)[tokens]
        self.layer_ids, _, counts, per_layer = _routing(ctx, self.top_k, rows)
        self.counts[tokens] = counts
        load = torch.stack([(m * c[:, None]).sum(0) for m in per_layer])
        self.layer_load = load if self.layer_load is None else self.layer_load + load

    def _weights(self) -> torch.Tensor:
        if self._G is None:
            b = self.batch
            ptr = b.branch_ptr
            branch = torch.repeat_interleave(torch.arange(b.num_branches, device=ptr.device), ptr[1:] - ptr[:-1])
            c = torch.bincount(b.branch_tokens, minlength=b.num_tokens).to(torch.float64)
            row = _Pass(torch.empty(0), self.counts, c, b.branch_tokens, branch)
            self._G = token_weights([row], self.definition, self.E, max(len(self.layer_ids), 1), b.num_branches)[0]
        return self._G

    def pass_loss(self, ctx, tokens: torch.Tensor, whole_row: bool = False,
                  rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``coef * scale * (G * probs).sum()`` over the pass's tokens (a tensor with gradient).
        ``whole_row``: the pass is the entire row, so its own routing gives the counts.
        ``rows``: the pass's rows that hold ``tokens`` (None: all of them)."""
        if whole_row:
            self.add_counts(ctx, tokens, rows)
        _, probs, _, _ = _routing(ctx, self.top_k, rows)
        term = (self._weights()[tokens].to(probs.dtype) * probs).sum()
        self.value += float(term.detach())
        return (self.coef * self.scale) * term

    def split_row_loss(self, ctx, tokens: torch.Tensor, group) -> torch.Tensor:
        """Context parallelism: the row is split over the ranks of ``group``, this rank's pass
        ``ctx`` holding the contiguous range ``tokens`` of it (possibly none: the pass's rows
        then stand for no token of the row). The ranges' routing counts are summed over the
        group (the ranges are disjoint, so the sum is the whole row's), then this rank's share
        ``coef * scale * (G * probs).sum()`` over its own tokens is returned (a tensor with
        gradient: the ranks' gradients sum to the one-process gradient). :attr:`value` and
        :meth:`metrics` are then the whole row's on every rank."""
        rows = None if tokens.numel() else tokens  # an empty range: none of the pass's rows
        self.add_counts(ctx, tokens, rows)
        dist.all_reduce(self.counts, group=group)
        dist.all_reduce(self.layer_load, group=group)
        term = self.pass_loss(ctx, tokens, rows=rows)
        value = torch.tensor([self.value], dtype=torch.float64, device=self.counts.device)
        dist.all_reduce(value, group=group)
        self.value = float(value[0])
        return term

    def metrics(self) -> Dict[str, float]:
        if self.layer_load is None:
            return {}
        return _metrics(self.value, self.layer_ids, self.layer_load)


@contextlib.contextmanager
def router_aux(model, normalizer: Optional[float] = None):
    """Collect the router logits of ``model``'s forward passes (with gradient) inside the block.

    Yields a :class:`RouterAux`, or None when the model has no router loss switched on or a
    collection for it is already open (the outermost one adds the loss, once)."""
    moe = moe_options(model)
    if moe is None or is_collecting(model):
        yield None
        return
    aux = RouterAux(model, moe["router_aux_loss"], float(moe["router_aux_loss_coef"]), int(moe["top_k"]),
                    int(moe["num_experts"]), normalizer)
    with collecting(model, aux):
        yield aux
