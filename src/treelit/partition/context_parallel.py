"""Context parallelism for trees: one tree row split over the C ranks of a group, exact.

A tree's DFS row is cut into C contiguous ranges, balanced by compute cost (see
:func:`token_costs`), and rank r runs the model on its range only. What crosses ranks:

* **Attention.** In a DFS row every ancestor of a token comes before it, and the keys a
  query of range ``[s, e)`` sees outside the range are exactly the ancestors of token ``s``
  (key ``j < s`` is visible to query ``q >= s`` iff ``q < subtree_end[j]``, i.e. ``j`` is an
  ancestor of ``s``). So rank r needs, per attention layer, the K/V of the root-to-``s`` path
  and nothing else: never a sibling subtree. Each owner sends each later rank exactly the
  path rows it holds (point-to-point, one message per pair and layer, K and V together); the
  backward sends their gradients back to the owner, which adds them into its own K/V's
  gradient (:class:`_PathKV`, an autograd function: the gradients flow as in one process).
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

Supported: attention-only models (native decoders and transformers families through the
adapter), every objective, every attention backend that takes external keys. Refused, with
one line: recurrent layers (their state would have to cross ranks in DFS order) and the
router load-balancing loss of mixture-of-experts models (its statistics are per pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from treelit.attention.base import resolve_backend
from treelit.loss.logprobs import token_logprobs
from treelit.models.context import ExternalKV, TreeContext
from treelit.models.forward import decoder_hidden, in_forward, output_weight
from treelit.objectives.folding import fold_spec, loss_from_logprobs, target_selection
from treelit.partition.passes import empty_row
from treelit.tree.batch import TreeBatch

__all__ = ["CPPlan", "cp_plan", "cp_ranges", "token_costs", "cp_micro_batch", "cp_logprobs", "check_cp_model",
           "check_cp_degree"]


def check_cp_model(model) -> None:
    """Refuse what context parallelism does not cover, naming it."""
    cfg = getattr(model, "config", None)
    kinds = set(getattr(cfg, "layer_types", None) or [])
    recurrent = sorted(kinds - {"attention", "full_attention", "sliding_attention"})
    if recurrent or any(hasattr(m, "_treelit_forward") for m in model.modules()):
        raise ValueError("trainer.strategy.context_parallel_degree > 1: this model has recurrent layers "
                         f"({', '.join(recurrent) or 'transformers hybrid layers'}); context parallelism covers "
                         "attention-only models (use partitioning for long paths of hybrid models)")
    moe = getattr(cfg, "moe", None) or {}
    if moe and float(moe.get("router_aux_loss_coef", 0.0) or 0.0) > 0:
        raise ValueError("trainer.strategy.context_parallel_degree > 1 with a router load-balancing loss "
                         f"(model.router_aux_loss_coef={moe.get('router_aux_loss_coef')}): set it to 0")


def _shape(model) -> Tuple[int, int, int, int]:
    """(hidden size D, attention layers, vocabulary V, trunk parameters per token)."""
    out_w = output_weight(model)
    V, D = int(out_w.shape[0]), int(out_w.shape[1])
    layers = len(getattr(model, "layers", [])) or 1
    trunk = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2) - 2 * V * D
    return D, layers, V, max(trunk, D * D)


def token_costs(batch: TreeBatch, model=None) -> np.ndarray:
    """Forward+backward cost of each tree token, in multiply-adds (a model's shape gives the
    units; without a model, a 1:1:1 mix): the trunk (its matrix parameters, once per token),
    attention (one query-key product and one value product per visible key and layer: the
    token's depth + 1 keys) and the head (V x D per target the token's hidden state predicts)."""
    pos = batch.position_ids.cpu().numpy().astype(np.float64)
    parent = batch.parent.cpu().numpy()
    targets = ((batch.target_count > 0) & (batch.parent >= 0)).cpu().numpy()
    head = np.zeros(batch.num_tokens)
    np.add.at(head, parent[targets], 1.0)
    if model is None:
        return 1.0 + (pos + 1.0) / max(pos.max() + 1.0, 1.0) + head
    D, layers, V, trunk = _shape(model)
    return float(trunk) + 2.0 * D * layers * (pos + 1.0) + float(V * D) * head


def cp_ranges(costs: np.ndarray, C: int) -> List[Tuple[int, int]]:
    """C contiguous ranges of equal cost (as far as whole tokens allow); with fewer tokens
    than C the last ranks get empty ranges."""
    N = len(costs)
    if N <= C:
        return [(min(r, N), min(r + 1, N)) for r in range(C)]
    cum = np.concatenate([[0.0], np.cumsum(costs)])
    cuts = [0]
    for r in range(1, C):
        target = cum[-1] * r / C
        i = int(np.searchsorted(cum, target))
        if i > 0 and abs(cum[i - 1] - target) <= abs(cum[min(i, N)] - target):
            i -= 1
        i = min(max(i, cuts[-1] + 1), N - (C - r))  # every range keeps at least one token
        cuts.append(i)
    cuts.append(N)
    return [(cuts[r], cuts[r + 1]) for r in range(C)]


@dataclass
class CPPlan:
    """Rank ``rank``'s part of one row under context parallelism (host-side, from the row's
    structure, identical on every rank)."""

    ranges: List[Tuple[int, int]]
    rank: int
    path: np.ndarray                  # full-row indices of the external keys (ancestors of the range's first token)
    recv: Dict[int, np.ndarray]       # src rank -> positions in ``path`` its rows fill
    send: Dict[int, np.ndarray]       # dst rank -> local rows of this rank it needs
    imbalance: float                  # max over ranks of cost / mean cost - 1

    @property
    def start(self) -> int:
        return self.ranges[self.rank][0]

    @property
    def end(self) -> int:
        return self.ranges[self.rank][1]

    @property
    def size(self) -> int:
        return self.end - self.start


def _ancestors(parent: np.ndarray, t: int) -> np.ndarray:
    out = []
    a = parent[t]
    while a >= 0:
        out.append(a)
        a = parent[a]
    return np.array(out[::-1], dtype=np.int64)


def _owner(ranges, j: int) -> int:
    for r, (s, e) in enumerate(ranges):
        if s <= j < e:
            return r
    raise AssertionError(j)


def cp_plan(batch: TreeBatch, C: int, rank: int, costs: Optional[np.ndarray] = None) -> CPPlan:
    costs = token_costs(batch) if costs is None else costs
    ranges = cp_ranges(costs, C)
    parent = batch.parent.cpu().numpy()
    paths = [(_ancestors(parent, s) if s < e else np.zeros(0, np.int64)) for s, e in ranges]
    own = paths[rank]
    recv: Dict[int, np.ndarray] = {}
    for src in range(C):
        pos = np.nonzero([_owner(ranges, int(j)) == src for j in own])[0] if len(own) else np.zeros(0, np.int64)
        if len(pos) and src != rank:
            recv[src] = pos
    send: Dict[int, np.ndarray] = {}
    s0 = ranges[rank][0]
    for dst in range(C):
        if dst == rank:
            continue
        mine = [int(j) - s0 for j in paths[dst] if _owner(ranges, int(j)) == rank]
        if mine:
            send[dst] = np.array(mine, dtype=np.int64)
    work = np.array([costs[s:e].sum() for s, e in ranges])
    imbalance = float(work.max() / work.mean() - 1.0) if work.mean() > 0 else 0.0
    return CPPlan(ranges, rank, own, recv, send, imbalance)


class _PathKV(torch.autograd.Function):
    """``[ext; own]`` keys and values of one attention layer: the path rows other ranks hold
    (received), then this rank's own. Backward: the received rows' gradients go back to their
    owners; what later ranks send back is added into the own rows' gradient."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, plan: CPPlan, group, tag: int) -> torch.Tensor:
        # kv: [1, H, n, Dk + Dv] (this rank's keys and values side by side)
        ctx.plan, ctx.group, ctx.tag = plan, group, tag
        E = len(plan.path)
        ext = kv.new_zeros(kv.shape[0], kv.shape[1], E, kv.shape[3])
        ops, bufs = [], {}
        for dst, rows in sorted(plan.send.items()):
            out = kv[:, :, torch.from_numpy(rows).to(kv.device)].contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, dst), group, tag))
        for src, pos in sorted(plan.recv.items()):
            bufs[src] = kv.new_empty(kv.shape[0], kv.shape[1], len(pos), kv.shape[3])
            ops.append(dist.P2POp(dist.irecv, bufs[src], _global(group, src), group, tag))
        _wait(ops)
        for src, pos in plan.recv.items():
            ext[:, :, torch.from_numpy(pos).to(kv.device)] = bufs[src]
        return torch.cat([ext, kv], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan, group = ctx.plan, ctx.group
        E = len(plan.path)
        g_ext, g_own = grad[:, :, :E], grad[:, :, E:].clone()
        ops, bufs = [], {}
        for src, pos in sorted(plan.recv.items()):
            out = g_ext[:, :, torch.from_numpy(pos).to(grad.device)].contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, src), group, ctx.tag + 1))
        for dst, rows in sorted(plan.send.items()):
            bufs[dst] = grad.new_empty(grad.shape[0], grad.shape[1], len(rows), grad.shape[3])
            ops.append(dist.P2POp(dist.irecv, bufs[dst], _global(group, dst), group, ctx.tag + 1))
        _wait(ops)
        for dst, rows in plan.send.items():
            g_own.index_add_(2, torch.from_numpy(rows).to(grad.device), bufs[dst])
        return g_own, None, None, None


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


def _wait(ops) -> None:
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


class _CPContext(TreeContext):
    """The range's row with the path's K/V fetched per attention layer."""

    def __init__(self, sub: TreeBatch, backend, external: Optional[ExternalKV], plan: Optional[CPPlan], group):
        super().__init__(sub, backend, external=external)
        self.cp_plan, self.group = plan, group

    def attention(self, layer, q, k, v, window=None):
        if self.cp_plan is not None:
            dk = k.shape[-1]
            both = _PathKV.apply(torch.cat([k, v], dim=-1), self.cp_plan, self.group, 2 * layer)
            E = len(self.cp_plan.path)
            if E:
                self.external.k[layer] = both[:, :, :E, :dk]
                self.external.v[layer] = both[:, :, :E, dk:]
            k, v = both[:, :, E:, :dk], both[:, :, E:, dk:]
        return super().attention(layer, q, k, v, window)


def _forward_range(model, batch: TreeBatch, plan: CPPlan, group, attention, chunk_rows, with_entropy: bool):
    """This rank's target tokens (full-row indices), their log-probs / entropies (with graph)
    and the range's hidden states."""
    dev = batch.device
    if plan.size == 0:  # fewer tokens than ranks: an empty pass (nothing sent or received)
        sub, external = empty_row(dev), None
        tokens = torch.zeros(0, dtype=torch.long, device=dev)
    else:
        tokens = torch.arange(plan.start, plan.end, device=dev)
        sub = batch if plan.size == batch.num_tokens else batch.subset(tokens)
        E = len(plan.path)
        external = None
        if E:
            path = torch.from_numpy(plan.path).to(dev)
            hi = torch.clamp(batch.subtree_end[path], max=plan.end) - plan.start
            external = ExternalKV({}, {}, torch.zeros(E, dtype=torch.long, device=dev), hi,
                                  pos=batch.position_ids[path])
    backend = resolve_backend(attention, dev, sub)

    def run(m):
        ctx = _CPContext(sub, backend, external, plan if plan.size else None, group)
        h = decoder_hidden(m, sub.input_ids[None], sub.position_ids[None], ctx)[0]
        if plan.size == 0:
            return tokens, h[:0, 0], None, h
        sel = target_selection(batch)
        par = batch.parent[sel]
        mine = sel[(par >= plan.start) & (par < plan.end)]
        rows = batch.parent[mine] - plan.start
        logp, ent = token_logprobs(h[rows], output_weight(m), batch.input_ids[mine], chunk_rows=chunk_rows,
                                   with_entropy=with_entropy)
        return mine, logp, ent, h

    return in_forward(model, run)


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
    plan = cp_plan(batch, C, rank, costs)
    with torch.no_grad():
        tok, logp, _, _ = _forward_range(model, batch, plan, group, attention, chunk_rows, False)
        full = _full(logp, tok, batch.num_tokens, group)
    out = torch.full_like(full, float("nan"))
    sel = target_selection(batch)
    out[sel] = full[sel]
    return out


def cp_micro_batch(model, objective, batch: TreeBatch, group, *, aggregation: str, normalizer: float,
                   attention: Any = "auto", chunk_rows: Optional[int] = None,
                   costs: Optional[np.ndarray] = None) -> Tuple[float, Dict[str, float], CPPlan]:
    """Forward and backward ``batch`` split over the ranks of ``group`` (accumulating ``.grad``:
    the ranks' gradients sum to the one-process gradient). Returns the loss (every rank the
    same), the objective's metrics and this rank's plan."""
    check_cp_model(model)
    C, rank = dist.get_world_size(group), dist.get_rank(group)
    if costs is None:
        costs = token_costs(batch, model)
    plan = cp_plan(batch, C, rank, costs)
    spec = fold_spec(objective)
    ref = None
    if spec.reference_model:
        with objective.as_reference(model) as reference:
            ref = cp_logprobs(reference, batch, group, attention=attention, chunk_rows=chunk_rows, costs=costs)
    tok, logp, ent, h = _forward_range(model, batch, plan, group, attention, chunk_rows, spec.needs_entropy)
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
    # every rank back-propagates through every layer (the path K/V gradients it owes the
    # other ranks travel in that backward), whether or not it holds targets
    (surrogate + 0.0 * h.sum()).backward()
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, plan


def check_cp_degree(degree: Any, world: int) -> int:
    """``trainer.strategy.context_parallel_degree`` checked against the world size."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"trainer.strategy.context_parallel_degree must be a positive integer (1: off), got {degree!r}")
    if world % degree:
        raise ValueError(f"trainer.strategy.context_parallel_degree={degree} does not divide the {world} processes "
                         "(trainer.devices x trainer.num_nodes)")
    return degree
