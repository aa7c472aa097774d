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

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from treelit.attention.base import ATTENTION, resolve_backend
from treelit.loss.logprobs import default_chunk_rows, token_logprobs
from treelit.models.context import ExternalKV, TreeContext
from treelit.models.forward import decoder_hidden, in_forward, output_weight
from treelit.models.hf_kernels import TREE_KERNELS, WRAPPER_KERNELS
from treelit.models.moe import collecting
from treelit.objectives.folding import fold_spec, loss_from_logprobs, target_selection
from treelit.partition import p2p
from treelit.partition.parts import PassPart, PassSpec, RouterPass
from treelit.partition.passes import ShardedRows, empty_row
from treelit.ssm.layout import RecurrentLayout, external_layout
from treelit.tree.batch import TreeBatch

__all__ = ["TRAFFIC", "CPPlan", "cp_plan", "cp_ranges", "token_costs", "cp_micro_batch", "cp_passes", "cp_logprobs", "check_cp_model",
           "check_cp_backend", "check_cp_degree", "cp_split", "memory_ranges", "path_weight", "score_pair_bytes", "cp_chunk_rows", "has_recurrent_layers"]


_ATTENTION_KINDS = {"attention", "full_attention", "sliding_attention"}
_NATIVE_RECURRENT = {"gdn", "mamba2"}


def has_recurrent_layers(model) -> bool:
    """Whether ``model`` has layers other than attention: native recurrent layers (by their
    ``layer_types``) or a transformers hybrid's tree kernels."""
    kinds = set(getattr(getattr(model, "config", None), "layer_types", None) or [])
    return bool(kinds - _ATTENTION_KINDS) or any(hasattr(m, "_treelit_forward") for m in model.modules())


def check_cp_backend(attention: Any, option: str = "trainer.strategy.context_parallel_degree > 1",
                     why: str = "a range's ancestors held by other ranks") -> None:
    """Refuse an attention backend that does not take external keys (a rank's ancestors on
    other ranks are external keys of its range; a partition's ancestors are external keys of
    its pass), naming it. ``auto`` picks built-in backends, which all do."""
    if attention is None or attention == "auto":
        return
    backend = ATTENTION.get(attention) if isinstance(attention, str) else attention
    if not getattr(backend, "external_keys", True):
        raise ValueError(f"{option} with attention={getattr(backend, 'name', attention)}: "
                         f"this backend does not take external keys ({why}); "
                         f"use one that does ({', '.join(n for n in ATTENTION.names() if getattr(ATTENTION.get(n), 'external_keys', True))})")


def check_cp_model(model) -> None:
    """Refuse what context parallelism does not cover, naming it."""
    cfg = getattr(model, "config", None)
    kinds = set(getattr(cfg, "layer_types", None) or [])
    other = sorted(kinds - _ATTENTION_KINDS - _NATIVE_RECURRENT)
    if other:
        raise ValueError("trainer.strategy.context_parallel_degree > 1: context parallelism does not cover the "
                         f"layer types {', '.join(other)}; it covers attention, gdn and mamba2 layers "
                         "(use partitioning, partition=redundancy_free, for long paths of this model)")
    # the adapter's hybrid layers: their tree kernels read convolution contexts and initial states
    # through the context's hooks, as native layers do (hf_kernels); anything else is refused
    kernels = {k for m in model.modules() for k in getattr(m, "_treelit_kernels", ())}
    unrouted = sorted(kernels - set(TREE_KERNELS) - WRAPPER_KERNELS)
    if unrouted:
        raise ValueError("trainer.strategy.context_parallel_degree > 1: context parallelism does not cover the "
                         f"kernels {', '.join(unrouted)} of this transformers model's recurrent layers "
                         "(use partitioning, partition=redundancy_free, for long paths of this model)")


def _shape(model) -> Tuple[int, int, int, int]:
    """(hidden size D, attention layers, vocabulary V, trunk parameters per token)."""
    out_w = output_weight(model)
    V, D = int(out_w.shape[0]), int(out_w.shape[1])
    types = getattr(getattr(model, "config", None), "layer_types", None)
    layers = (sum(t in _ATTENTION_KINDS for t in types) if types else len(getattr(model, "layers", []))) or 1
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


def _kv_width(model) -> int:
    """K/V elements per token of one attention layer (2 x KV heads x head size); 0 when unknown."""
    cfg = getattr(model, "config", None)
    kv = getattr(cfg, "num_kv_heads", None) or getattr(cfg, "num_key_value_heads", None)
    heads = getattr(cfg, "num_heads", None) or getattr(cfg, "num_attention_heads", None)
    dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "embed_dim", None) or getattr(cfg, "hidden_size", 0)) // max(
        int(heads or 1), 1)
    return 2 * int(kv or 0) * int(dim or 0)


def path_weight(model) -> float:
    """The memory of one received path row (its K/V in every attention layer) in units of one
    token's activations (about twice the trunk's matrix width per token, measured on qwen2-style
    layers: 27k elements against 2 x 12.3k)."""
    if model is None:
        return 0.0
    D, layers, _, trunk = _shape(model)
    return float(_kv_width(model) * layers) / max(2.0 * trunk / D, 1.0)


def score_pair_bytes(model, device=None) -> float:
    """Bytes per (local query, received path key) pair of a rank's step under context
    parallelism: what the attention over the received path holds per pair beyond its K/V. On
    CPU none: the segment backend's CPU kernels run blockwise (measured: ``bench_cp_longest.py``
    predicts every rank within 6% without it). Elsewhere its math path materialises one
    layer's scores per query head in float32 at a time, four such tensors at once in the
    backward pass (scores, probabilities, their gradients): ``16 x heads``. A rank's peak then
    grows with its queries x its received keys, on a long branch with the branch length squared
    on the last ranks, which a per-token cost does not follow. 0 when the model's heads are
    unknown."""
    if model is None or device is None or torch.device(device).type == "cpu":
        return 0.0
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_heads", None) or getattr(cfg, "num_attention_heads", None) or 0
    return float(16 * int(heads))


def memory_ranges(batch: TreeBatch, C: int, weight: float) -> List[Tuple[int, int]]:
    """C contiguous ranges of about equal memory: a range ``[s, e)`` holds the activations of
    its ``e - s`` tokens and the received K/V of the ``a(s)`` ancestors of ``s`` within the row,
    ``(e - s) + weight x a(s)`` in units of one token's activations (see :func:`path_weight`).
    The smallest bound ``T`` whose greedy cover needs at most C ranges, by bisection."""
    N = batch.num_tokens
    if N <= C:
        return [(min(r, N), min(r + 1, N)) for r in range(C)]
    parent = batch.parent.cpu().numpy()
    anc = np.zeros(N)
    for i in range(N):  # (a DFS row: parents come first)
        if parent[i] >= 0:
            anc[i] = anc[parent[i]] + 1.0
    extra = weight * anc

    def cover(T: float) -> List[int]:
        cuts, s = [0], 0
        while s < N:
            s = min(N, s + max(1, int(T - extra[s])))
            cuts.append(s)
        return cuts

    lo, hi = N / C, N / C + float(extra.max()) + 1.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if len(cover(mid)) - 1 <= C:
            hi = mid
        else:
            lo = mid
    cuts = cover(hi)
    while len(cuts) - 1 < C:  # fewer ranges than ranks: halve the largest
        r = int(np.argmax(np.diff(cuts)))
        cuts.insert(r + 1, (cuts[r] + cuts[r + 1]) // 2)
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
    work: Optional[np.ndarray] = None  # each rank's cost

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


def cp_split(batch: TreeBatch, C: int, rank: int, model, costs: Optional[np.ndarray] = None) -> "CPPlan":
    """Rank ``rank``'s plan of ``batch`` for ``model``: by default ranges of equal memory
    (:func:`memory_ranges`; a rank's peak is what limits the longest branch), the imbalance
    measured in compute (:func:`token_costs`); with ``costs`` given, ranges of equal ``costs``."""
    if costs is not None:
        return cp_plan(batch, C, rank, costs)
    return cp_plan(batch, C, rank, token_costs(batch, model), memory_ranges(batch, C, path_weight(model)))


def cp_plan(batch: TreeBatch, C: int, rank: int, costs: Optional[np.ndarray] = None,
            ranges: Optional[List[Tuple[int, int]]] = None) -> CPPlan:
    """Rank ``rank``'s plan; ``ranges`` (default: of equal ``costs``) the split, ``costs`` (default
    :func:`token_costs` without a model) what ``imbalance`` measures."""
    costs = token_costs(batch) if costs is None else costs
    ranges = cp_ranges(costs, C) if ranges is None else ranges
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
    return CPPlan(ranges, rank, own, recv, send, imbalance, work)


@dataclass
class _Route:
    """Rows one rank receives from the others and sends them: ``path`` (full-row indices of
    the received rows, in order), ``recv`` (src rank -> positions in ``path`` it fills),
    ``send`` (dst rank -> this rank's rows it needs)."""

    path: np.ndarray
    recv: Dict[int, np.ndarray]
    send: Dict[int, np.ndarray]


class _PathRows(torch.autograd.Function):
    """``[ext; own]`` along ``dim``: the path rows other ranks hold (received), then this rank's
    own ``x`` (for attention, one layer's keys and values side by side; for a recurrent layer,
    its convolution inputs). Backward: the received rows' gradients go back to their owners;
    what later ranks send back is added into the own rows' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, route, group, tag: int, dim: int) -> torch.Tensor:
        ctx.route, ctx.group, ctx.tag, ctx.dim = route, group, tag, dim
        E = len(route.path)
        shape = list(x.shape)
        shape[dim] = E
        ext = x.new_zeros(shape)
        ops, bufs = [], {}
        for dst, rows in sorted(route.send.items()):
            out = x.index_select(dim, torch.from_numpy(rows).to(x.device)).contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, dst), group, tag))
        for src, pos in sorted(route.recv.items()):
            shape[dim] = len(pos)
            bufs[src] = x.new_empty(shape)
            ops.append(dist.P2POp(dist.irecv, bufs[src], _global(group, src), group, tag))
        _exchange(ops, "rows")
        for src, pos in route.recv.items():
            ext.index_copy_(dim, torch.from_numpy(pos).to(x.device), bufs[src])
        return torch.cat([ext, x], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        route, group, dim = ctx.route, ctx.group, ctx.dim
        E = len(route.path)
        g_ext = grad.narrow(dim, 0, E)
        g_own = grad.narrow(dim, E, grad.shape[dim] - E).clone()
        ops, bufs = [], {}
        for src, pos in sorted(route.recv.items()):
            out = g_ext.index_select(dim, torch.from_numpy(pos).to(grad.device)).contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, src), group, ctx.tag + 1))
        shape = list(g_own.shape)
        for dst, rows in sorted(route.send.items()):
            shape[dim] = len(rows)
            bufs[dst] = grad.new_empty(shape)
            ops.append(dist.P2POp(dist.irecv, bufs[dst], _global(group, dst), group, ctx.tag + 1))
        _exchange(ops, "rows")
        for dst, rows in route.send.items():
            g_own.index_add_(dim, torch.from_numpy(rows).to(grad.device), bufs[dst])
        return g_own, None, None, None, None


class _StateIn(torch.autograd.Function):
    """The initial states ``[slots, *shape]`` of a range's external slots, received from the
    earlier ranks that own the slots' parent tokens. Backward: their gradients go back to the
    owners. ``like`` (a tensor of the layer's graph, downstream of the layer's convolution
    exchange) gives dtype and device and orders the backward: this function's gradients leave
    before that exchange's backward runs."""

    @staticmethod
    def forward(ctx, like: torch.Tensor, route: _Route, group, tag: int, shape: Tuple[int, ...]) -> torch.Tensor:
        ctx.route, ctx.group, ctx.tag = route, group, tag
        init = like.new_zeros(len(route.path), *shape)
        ops, bufs = [], {}
        for src, pos in sorted(route.recv.items()):
            bufs[src] = like.new_empty(len(pos), *shape)
            ops.append(dist.P2POp(dist.irecv, bufs[src], _global(group, src), group, tag))
        _exchange(ops, "states")
        for src, pos in route.recv.items():
            init[torch.from_numpy(pos).to(like.device)] = bufs[src]
        return init

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        route, group = ctx.route, ctx.group
        ops = []
        for src, pos in sorted(route.recv.items()):
            out = grad[torch.from_numpy(pos).to(grad.device)].contiguous()
            ops.append(dist.P2POp(dist.isend, out, _global(group, src), group, ctx.tag + 1))
        _exchange(ops, "states")
        return None, None, None, None, None


class _StateOut(torch.autograd.Function):
    """The layer's scan output ``out`` unchanged, after sending the later ranks the captured
    states ``cap [captures, ...]`` they start from. Backward: their gradients, received from
    those ranks, are added into ``cap``'s (it runs once ``out``'s gradient is complete, before
    this rank's scan is back-propagated)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, cap: torch.Tensor, route: _Route, group, tag: int) -> torch.Tensor:
        ctx.route, ctx.group, ctx.tag = route, group, tag
        ctx.cap_shape, ctx.cap_dtype = cap.shape, cap.dtype
        ops = []
        for dst, rows in sorted(route.send.items()):
            sent = cap[torch.from_numpy(rows).to(cap.device)].contiguous()
            ops.append(dist.P2POp(dist.isend, sent, _global(group, dst), group, tag))
        _exchange(ops, "states")
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        route, group = ctx.route, ctx.group
        g_cap = grad.new_zeros(ctx.cap_shape, dtype=ctx.cap_dtype)
        ops, bufs = [], {}
        for dst, rows in sorted(route.send.items()):
            bufs[dst] = g_cap.new_empty(len(rows), *ctx.cap_shape[1:])
            ops.append(dist.P2POp(dist.irecv, bufs[dst], _global(group, dst), group, ctx.tag + 1))
        _exchange(ops, "states")
        for dst, rows in route.send.items():
            g_cap.index_add_(0, torch.from_numpy(rows).to(grad.device), bufs[dst])
        return grad, g_cap, None, None, None


@dataclass
class _Recurrent:
    """One rank's recurrent routing for one convolution kernel size."""

    layout: RecurrentLayout
    conv: _Route    # convolution inputs of outside ancestors (path tokens within K-1 of a range token)
    state: _Route   # path = the slots' parent tokens; send rows index ``layout.capture``


def _owners(ranges, idx: np.ndarray) -> np.ndarray:
    ends = np.array([e for _, e in ranges], dtype=np.int64)
    return np.searchsorted(ends, idx, side="right")


def _route(ranges, rank: int, wanted: List[np.ndarray], local: Optional[np.ndarray] = None) -> _Route:
    """The route of ``wanted[r]`` (sorted full-row indices each rank r receives); this rank
    sends its rows of them as local rows, or as positions in ``local`` (sorted local rows)."""
    own = wanted[rank]
    owner = _owners(ranges, own)
    recv = {int(src): np.flatnonzero(owner == src) for src in np.unique(owner)}
    s0 = ranges[rank][0]
    send: Dict[int, np.ndarray] = {}
    for dst, w in enumerate(wanted):
        if dst == rank or not len(w):
            continue
        rows = w[_owners(ranges, w) == rank] - s0
        if len(rows):
            send[dst] = rows if local is None else np.searchsorted(local, rows)
    return _Route(own, recv, send)


def _recurrent_route(batch: TreeBatch, ranges, rank: int, K: int, external_root: bool = False,
                     boundary: Optional[np.ndarray] = None) -> _Recurrent:
    """This rank's recurrent routing. ``external_root`` (a partitioned pass below another): the
    row's root continues the partition's outside path, from the pass's external state (one more
    slot, after the received ones) and its ``K-1`` external convolution inputs (context rows
    after the received ones). ``boundary``: row tokens whose state and convolution context the
    passes below need (captured too)."""
    parent = batch.parent.cpu().numpy()
    slots, conv_need, table, depth = [], [], None, None
    for r, (s, e) in enumerate(ranges):
        p = parent[s:e]
        slots.append(np.unique(p[(p >= 0) & (p < s)]))
        cols, ext_cols, cur = [], [], np.arange(s, e)
        ext = np.zeros(e - s, dtype=np.int64)  # > 0: that many steps beyond the row's root (external context)
        for _ in range(1, K):  # the j-th ancestor of each range token (-1: none or external)
            nxt = np.where(cur >= 0, parent[np.maximum(cur, 0)], -1)
            leaving = (cur >= 0) & (nxt < 0) & external_root
            ext = np.where(leaving, 1, np.where(ext > 0, ext + 1, 0))
            cur = nxt
            cols.append(cur)
            ext_cols.append(ext)
        anc = np.stack(cols, 1) if cols else np.zeros((e - s, 0), dtype=np.int64)
        conv_need.append(np.unique(anc[(anc >= 0) & (anc < s)]))
        if r == rank:
            table = anc
            depth = np.stack(ext_cols, 1) if ext_cols else np.zeros((e - s, 0), dtype=np.int64)
    s, e = ranges[rank]
    T, M = e - s, len(conv_need[rank])
    X = K - 1 if external_root else 0
    # the padded source of the convolution: [own tokens | outside ancestors (conv_need) | external context | zero]
    src = np.where(table >= s, table - s,
                   np.where(table >= 0, T + np.searchsorted(conv_need[rank], np.maximum(table, 0)),
                            np.where((depth > 0) & (depth <= X), T + M + X - depth, T + M + X)))
    p = parent[s:e]
    local_parent = np.where(p >= s, p - s, -1)
    n_slots = len(slots[rank])
    root_slot = np.where((p >= 0) & (p < s), np.searchsorted(slots[rank], np.maximum(p, 0)),
                         n_slots if external_root else -1)
    root_slot = np.where(p >= s, -1, root_slot)
    later = np.concatenate([slots[d] for d in range(len(ranges)) if d != rank] + [np.zeros(0, np.int64)])
    capture = later[_owners(ranges, later) == rank] - s
    if boundary is not None and len(boundary):
        b = np.asarray(boundary, dtype=np.int64)
        capture = np.concatenate([capture, b[(b >= s) & (b < e)] - s])
    capture = np.unique(capture).astype(np.int64)
    layout = external_layout(local_parent, root_slot, src[:, ::-1], M + X, K, capture, batch.device)
    return _Recurrent(layout, _route(ranges, rank, conv_need), _route(ranges, rank, slots, capture))


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


class Traffic:
    """Bytes this process received for context parallelism since the last :meth:`take`: the
    point-to-point messages (path K/V and convolution inputs, states, and their gradients in the
    backward) and, in partitioned passes, the all-reduced boundary states and each assembly of
    a pass's ancestor K/V (counted at their size)."""

    def __init__(self) -> None:
        self.received = 0
        self.forward = 0  # of which in forward passes (even message tags; the captures' all-reduce)

    def take(self) -> int:
        got, self.received, self.forward = self.received, 0, 0
        return got


TRAFFIC = Traffic()


def _exchange(ops, kind: str) -> None:
    """Post ``ops`` (point-to-point sends and receives), wait for the receives; the sends
    complete in the background (:mod:`treelit.partition.p2p`, ``kind`` names its wait times)."""
    got = [(op.tensor.numel() * op.tensor.element_size(), op.tag) for op in ops if op.op is dist.irecv]
    TRAFFIC.received += sum(n for n, _ in got)
    TRAFFIC.forward += sum(n for n, tag in got if tag % 2 == 0)
    p2p.post(ops, kind)  # (with no ops too: inside a backward it queues the drain of earlier sends)


_RECURRENT_TAGS = 1 << 24  # the recurrent exchanges' tags start above every attention layer's


class _CPContext(TreeContext):
    """The range's row with the path's K/V fetched per attention layer, and the recurrent
    layers' convolution contexts and slot states routed between ranks. Message tags:
    ``4 * layer`` for an attention layer's path rows; ``_RECURRENT_TAGS + 2 * i`` for the i-th
    distinct recurrent exchange of the pass (a layer's convolution inputs, or one of its
    states, by name: a layer may make several, and a transformers layer may share its index
    with an attention layer); each ``+ 1`` in the backward. Every rank with tokens runs the
    same layers in the same order, so the numbering agrees; a recomputation (activation
    checkpointing) finds the tags of the first pass."""

    def __init__(self, sub: TreeBatch, backend, external: Optional[ExternalKV], plan: Optional[CPPlan], group,
                 full: TreeBatch, pre: Optional[ExternalKV] = None, capture_kv: bool = False,
                 boundary: Optional[np.ndarray] = None):
        in_range = None
        if boundary is not None and plan is not None:
            in_range = boundary[(boundary >= plan.start) & (boundary < plan.end)] - plan.start
        super().__init__(sub, backend, external=external, capture_kv=capture_kv, capture_tokens=in_range)
        self.cp_plan, self.group, self.full = plan, group, full
        # a partitioned pass below another: its ancestors' K/V, and its root's state and convolution
        # context (the same on every rank); a rank whose range of the pass is empty keeps them
        # apart (``idle_pre``): it still takes part in assembling the ancestors' K/V
        self.pre = pre if plan is not None else None
        self.idle_pre = pre if plan is None else None
        self.external_root = pre is not None and bool(pre.state)
        self.boundary = boundary  # row tokens whose states the passes below start from (captured)
        self._recurrent: Dict[int, _Recurrent] = {}
        self._tags: Dict[Tuple[int, str], int] = {}

    def _tag(self, layer: int, key: str) -> int:
        return self._tags.setdefault((layer, key), _RECURRENT_TAGS + 2 * len(self._tags))

    def _route_for(self, K: int) -> _Recurrent:
        if K not in self._recurrent:
            self._recurrent[K] = _recurrent_route(self.full, self.cp_plan.ranges, self.cp_plan.rank, K,
                                                  self.external_root, self.boundary)
        return self._recurrent[K]

    @property
    def captured_rows(self) -> np.ndarray:
        """The range's rows whose states the layers return (``layout.capture``)."""
        return self._route_for(next(iter(self._recurrent), 1)).layout.capture

    def recurrent_layout(self, K: int, B: int = 1, L: int = 0, device=None):
        if self.cp_plan is None:
            return super().recurrent_layout(K, B, L, device)
        return self._route_for(K).layout

    def recurrent_conv_inputs(self, layer: int, K: int, inputs: Dict[str, torch.Tensor]):
        if self.cp_plan is None:
            return super().recurrent_conv_inputs(layer, K, inputs)
        route = self._route_for(K).conv
        names = list(inputs)
        widths = [inputs[n].shape[1] for n in names]
        tag = self._tag(layer, ",".join(names))
        both = _PathRows.apply(torch.cat([inputs[n] for n in names], dim=1), route, self.group, tag, 0)
        M = len(route.path)
        ext, own = both[:M].split(widths, dim=1), both[M:].split(widths, dim=1)
        ext = dict(zip(names, ext))
        if self.external_root:  # then the K-1 inputs before the pass's root (context rows after the received)
            outside = self.pre.state[layer]
            ext = {n: torch.cat([ext[n], outside[n].to(ext[n].dtype)]) for n in names}
        return dict(zip(names, own)), ext

    def recurrent_scan(self, layer: int, scan, state_shape, like: torch.Tensor, name: str = "state"):
        if self.cp_plan is None:
            return super().recurrent_scan(layer, scan, state_shape, like, name)
        route = self._route_for(next(iter(self._recurrent), 1)).state  # the same for every kernel size
        tag = self._tag(layer, name)
        init = _StateIn.apply(like, route, self.group, tag, tuple(state_shape)) if len(route.path) else None
        if self.external_root and self.cp_plan.start == 0:  # the pass's root: one more slot, its outside state
            outside = self.pre.state[layer][name][None]
            init = outside if init is None else torch.cat([init, outside.to(init.dtype)])
        out, cap = scan(init)
        if route.send:
            out = _StateOut.apply(out, cap, route, self.group, tag)
        return out, cap

    def attention(self, layer, q, k, v, window=None):
        if self.cp_plan is None:
            out = super().attention(layer, q, k, v, window)
            idle = self.idle_pre.k.get(layer) if self.idle_pre is not None else None
            if isinstance(idle, ShardedRows):  # an empty range: still a part of the ancestors' assembly
                out = out + _AncestorsIdle.apply(q, idle, self.group, *(sh.own for sh, _ in idle.parts))
            return out
        if q.shape[0] != 1:
            raise ValueError("a tree row has batch size 1")
        if self.capture_kv:  # (the rank's own rows, for the passes below)
            self.captured[layer] = (k, v)
        dk = k.shape[-1]
        # [path | own] keys and values: one copy each of what the attention keeps for its backward
        # (the exchange's joint tensor and the received rows are not held beyond this call)
        both = _PathRows.apply(torch.cat([k, v], dim=-1), self.cp_plan, self.group, 4 * layer, 2)
        k, v = both[..., :dk].contiguous(), both[..., dk:].contiguous()
        del both
        plan = self.plan_for(window)
        pre = self.pre.k[layer] if self.pre is not None else None
        if isinstance(pre, ShardedRows):  # the partition's ancestors (earlier passes), assembled in front
            # (not a closure over this context: the graph it would join keeps the context's captures)
            return _WithAncestors.apply(q, k, v, functools.partial(_attend, self.backend, plan), pre, self.group,
                                        *(sh.own for sh, _ in pre.parts))
        if pre is not None:
            k, v = torch.cat([pre, k], 2), torch.cat([self.pre.v[layer], v], 2)
        return self.backend(q, k, v, plan)


def _forward_range(model, batch: TreeBatch, plan: CPPlan, group, attention, chunk_rows, with_entropy: bool):
    """This rank's target tokens (full-row indices), their log-probs / entropies (with graph)
    and the range's hidden states."""
    dev = batch.device
    if plan.size == 0:  # fewer tokens than ranks: an empty pass (nothing sent or received)
        sub, external = empty_row(dev, batch), None
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
        ctx = _CPContext(sub, backend, external, plan if plan.size else None, group, batch)
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

    return _drained(lambda: in_forward(model, run))


def _drained(fn):
    """``fn()``, a forward pass whose sends are all waited on when it returns (and none of an
    earlier pass is still in flight when it starts: the passes reuse their tags), or abandoned
    (:func:`~treelit.partition.p2p.abandon`) when it raises."""
    p2p.drain()
    try:
        out = fn()
    except BaseException:
        p2p.abandon()
        raise
    p2p.drain()
    return out


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


def cp_chunk_rows(chunk_rows: Optional[int], model, C: int) -> Optional[int]:
    """Rows per logits chunk of the head under context parallelism: an explicit ``chunk_rows`` as
    given; by default 1/C of one process's (:func:`~treelit.loss.logprobs.default_chunk_rows`), so
    that the head's logits, a fixed size once a range has more targets than a chunk, shrink with
    the rest of a rank's activations."""
    if chunk_rows is not None or C <= 1:
        return chunk_rows
    w = output_weight(model)
    return max(1, default_chunk_rows(int(w.shape[0]), device=w.device) // C)


def check_cp_degree(degree: Any, world: int) -> int:
    """``trainer.strategy.context_parallel_degree`` checked against the world size."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"trainer.strategy.context_parallel_degree must be a positive integer (1: off), got {degree!r}")
    if world % degree:
        raise ValueError(f"trainer.strategy.context_parallel_degree={degree} does not divide the {world} processes "
                         "(trainer.devices x trainer.num_nodes)")
    return degree


# -- context parallelism within a partitioned pass (see :mod:`treelit.partition.engine`) -----------------
def cp_forward_pass(model, sub: TreeBatch, plan: CPPlan, group, attention, pre: Optional[ExternalKV] = None,
                    capture: bool = False, boundary: Optional[np.ndarray] = None, embedding_grad_accumulator=None):
    """This rank's range of the partition row ``sub`` through ``model`` (call inside the model's
    forward): ``(h [range, D], ctx)``. ``pre``: the K/V of the partition's ancestors (earlier
    passes), the same on every rank and visible to every query of the range, in front of the
    path rows fetched from the other ranks of this pass, and (recurrent layers) the state and
    convolution context the pass's root continues. ``capture``: keep the range's own K/V
    (``ctx.captured``) and the recurrent states and convolution contexts at the ``boundary``
    tokens it holds (the parents of child partitions' roots) for the passes below. A rank whose
    range is empty runs an empty row (its captured K/V give the shapes of what it contributes:
    nothing)."""
    dev = sub.device
    if plan.size == 0:  # (``pre`` stays: the ancestors' K/V are assembled with every rank of the group)
        row, external, live = empty_row(dev, sub), None, None
    else:
        live = plan
        row = sub if plan.size == sub.num_tokens else sub.subset(torch.arange(plan.start, plan.end, device=dev))
        path = torch.from_numpy(plan.path).to(dev)
        P = pre.num_tokens if pre is not None else 0
        E = len(plan.path) + P
        external = None
        if E:
            hi = torch.clamp(sub.subtree_end[path], max=plan.end) - plan.start
            if P:
                hi = torch.cat([torch.full((P,), plan.size, dtype=torch.long, device=dev), hi])
            pos = sub.position_ids[path]
            if P:
                pos = torch.cat([pre.pos.to(dev), pos])
            external = ExternalKV({}, {}, torch.zeros(E, dtype=torch.long, device=dev), hi, pos=pos)
    backend = resolve_backend(attention, dev, row)
    ctx = _CPContext(row, backend, external, live, group, sub, pre=pre, capture_kv=capture,
                     boundary=boundary if capture else None)
    ctx.embedding_grad_accumulator = embedding_grad_accumulator  # (no [V, D] gradient per pass)
    h = _drained(lambda: decoder_hidden(model, row.input_ids[None], row.position_ids[None], ctx)[0])
    return h, ctx


def cp_captures(ctx, plan: CPPlan, need: np.ndarray, group, grad: bool):
    """What a partition's pass hands the passes below, under context parallelism: per attention
    layer a :class:`KVShard` of the K/V of its rows ``need`` (the ancestors of its child
    partitions' roots): the rows of them in this rank's range (none: an empty shard). With
    ``grad``, the shards are leaves that require grad, and each rank's own rows (a tensor of its
    graph) are noted to relay their gradients into: see :func:`cp_relay`. Returns ``(kv,
    produced, leaves)``."""
    lo, hi = (plan.start, plan.end) if plan.size else (0, 0)
    at = np.flatnonzero((need >= lo) & (need < hi))
    produced: List[Any] = []
    leaves: List[torch.Tensor] = []
    kv: Dict[int, KVShard] = {}
    for layer in sorted(ctx.captured):
        k, v = ctx.captured[layer]
        dev = k.device
        # (only the rows wanted: not a copy of the range's K/V)
        rows = torch.from_numpy(need[at] - lo).to(dev)
        own = torch.cat([k.index_select(2, rows), v.index_select(2, rows)], dim=-1)
        leaf = own.detach()
        if grad:
            leaf.requires_grad_()
            produced.append((own if len(at) else None, None, None))  # (its gradient arrives summed)
            leaves.append(leaf)
        kv[layer] = KVShard(leaf, torch.from_numpy(at).to(dev), len(need), k.shape[-1])
    return kv, produced, leaves


@dataclass
class KVShard:
    """One attention layer's captures of a partitioned pass under context parallelism, as one
    rank holds them: ``own [1, Hkv, n_own, Dk + Dv]`` (keys and values side by side) are the
    rows ``at`` of the ``size`` rows the passes below read (:meth:`RowPlan.needed`) that lie in
    this rank's range. A pass below assembles them from every rank of the group in each attention
    layer as it runs, and again in its backward (:func:`_WithAncestors`), so that no rank holds
    the whole path above the pass beyond one layer at a time; the gradients of the rows come
    back summed over the group into each owner's ``own``."""

    own: torch.Tensor
    at: torch.Tensor
    size: int
    dk: int


def _zeros_of_captures(pre: ShardedRows) -> torch.Tensor:
    """Zeros ``[1, Hkv, rows, Dk + Dv]`` for every row of the ancestor partitions' captures, one
    partition after another (what the group's all-reduces fill or sum)."""
    first = pre.parts[0][0].own
    return first.new_zeros(*first.shape[:2], sum(sh.size for sh, _ in pre.parts), first.shape[-1])


def _ancestor_rows(pre: ShardedRows, group) -> torch.Tensor:
    """The ancestors' K/V ``[1, Hkv, E, Dk + Dv]`` of one attention layer, from the shards of
    every rank of ``group`` (one all-reduce of each ancestor partition's captured rows, each rank
    filling its own)."""
    whole = _zeros_of_captures(pre)
    off = 0
    for sh, _ in pre.parts:
        whole[:, :, off:off + sh.size].index_copy_(2, sh.at, sh.own.detach())
        off += sh.size
    dist.all_reduce(whole, group=group)
    n = whole.numel() * whole.element_size()
    TRAFFIC.received += n
    TRAFFIC.forward += n
    out, off = [], 0
    for sh, idx in pre.parts:
        out.append(whole[:, :, off:off + sh.size].index_select(2, idx))
        off += sh.size
    return out[0] if len(out) == 1 else torch.cat(out, 2)


def _ancestor_grads(gk: Optional[torch.Tensor], gv: Optional[torch.Tensor], pre: ShardedRows,
                    group) -> List[torch.Tensor]:
    """Each shard's gradient from the gradients ``gk [1, Hkv, E, Dk]``, ``gv [1, Hkv, E, Dv]`` of
    the assembled rows (None: zero) on every rank of ``group``: summed over the group, the rank's
    own rows."""
    dk = pre.parts[0][0].dk
    whole = _zeros_of_captures(pre)
    e = off = 0
    for sh, idx in pre.parts:
        for g, cols in ((gk, slice(0, dk)), (gv, slice(dk, None))):
            if g is not None:
                whole[:, :, off:off + sh.size, cols].index_add_(2, idx, g[:, :, e:e + len(idx)].to(whole.dtype))
        off += sh.size
        e += len(idx)
    dist.all_reduce(whole, group=group)
    TRAFFIC.received += whole.numel() * whole.element_size()
    out, off = [], 0
    for sh, _ in pre.parts:
        out.append(whole[:, :, off:off + sh.size].index_select(2, sh.at).to(sh.own.dtype))
        off += sh.size
    return out


def _attend(backend, plan, q, k, v):
    return backend(q, k, v, plan)


class _WithAncestors(torch.autograd.Function):
    """One attention layer of a partitioned pass under context parallelism:
    ``attend(q, [ancestors | k], [ancestors | v])`` with the ancestors' K/V (``pre``, earlier
    passes) assembled from the ranks' shards for the call and dropped after it. The backward
    assembles them again and recomputes the attention with its graph (one more attention forward
    per layer), and the ancestors' gradients go back to the shards' owners summed over the group.
    So a rank holds its share of the path above the pass, not all of it in every layer."""

    @staticmethod
    def forward(ctx, q, k, v, attend, pre: ShardedRows, group, *owns):
        ctx.attend, ctx.pre, ctx.group = attend, pre, group
        dk = pre.parts[0][0].dk
        with torch.no_grad():
            anc = _ancestor_rows(pre, group)
            out = attend(q, torch.cat([anc[..., :dk].to(k.dtype), k], 2), torch.cat([anc[..., dk:].to(v.dtype), v], 2))
        del anc
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        pre, group = ctx.pre, ctx.group
        dk = pre.parts[0][0].dk
        anc = _ancestor_rows(pre, group)
        # keys and values apart (a slice of the joint rows would have a joint-sized gradient per half)
        ak, av = (x.to(t.dtype).contiguous().requires_grad_() for x, t in ((anc[..., :dk], k), (anc[..., dk:], v)))
        del anc
        with torch.enable_grad():
            qd, kd, vd = (x.detach().requires_grad_(x.requires_grad) for x in (q, k, v))
            out = ctx.attend(qd, torch.cat([ak, kd], 2), torch.cat([av, vd], 2))
            wrt = [t for t in (qd, kd, vd, ak, av) if t.requires_grad]
            got = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True))
        gq, gk, gv, gak, gav = (next(got) if t.requires_grad else None for t in (qd, kd, vd, ak, av))
        del out, ak, av
        ctx.attend = ctx.pre = None  # (what the node refers to goes with its backward)
        return (gq, gk, gv, None, None, None, *_ancestor_grads(gak, gav, pre, group))


class _AncestorsIdle(torch.autograd.Function):
    """A rank whose range of a partitioned pass is empty: its part of :class:`_WithAncestors`'s
    assemblies, forward and backward (its shards' rows may be read by the other ranks, and their
    gradients come back to it). Returns a zero that ``q`` (the layer's graph) carries."""

    @staticmethod
    def forward(ctx, q, pre: ShardedRows, group, *owns):
        ctx.pre, ctx.group = pre, group
        _ancestor_rows(pre, group)
        return q.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        pre, ctx.pre = ctx.pre, None
        _ancestor_rows(pre, ctx.group)  # (the others' recomputation)
        return (None, None, None, *_ancestor_grads(None, None, pre, ctx.group))


def _assembled(own: Optional[torch.Tensor], at: torch.Tensor, shape, like: torch.Tensor, dim: int, group, grad: bool,
               produced: List[Any], leaves: List[torch.Tensor]) -> torch.Tensor:
    """The ``shape`` tensor whose rows ``at`` (along ``dim``) each rank of ``group`` fills with its
    ``own`` (None: no rows), summed over the group; with ``grad`` a leaf that requires grad,
    noted with ``(own, dim, at)`` for :func:`cp_relay` (a rank holds its own rows, not a copy of
    the whole with zeros elsewhere)."""
    whole = like.new_zeros(shape)
    if own is not None:
        whole.index_copy_(dim, at, own.detach().to(whole.dtype))
    dist.all_reduce(whole, group=group)
    TRAFFIC.received += whole.numel() * whole.element_size()
    TRAFFIC.forward += whole.numel() * whole.element_size()
    if grad:
        whole.requires_grad_()
        produced.append((own, dim, at))
        leaves.append(whole)
    return whole


def cp_state_captures(ctx, plan: CPPlan, boundary: np.ndarray, group, grad: bool):
    """The recurrent layers' part of :func:`cp_captures`: per layer and name, the states and
    convolution contexts ``[len(boundary), ...]`` at a pass's ``boundary`` tokens (the parents
    of its child partitions' roots, sorted), each from the rank that holds the token, the same on
    every rank. The ranks agree first on the names, shapes and dtypes (a rank whose range holds
    no captured token, or no token at all, has none of its own). Returns ``(states, produced,
    leaves)``."""
    states: Dict[int, Dict[str, torch.Tensor]] = {}
    produced: List[Any] = []
    leaves: List[torch.Tensor] = []
    own = {(layer, n): (tuple(t.shape[1:]), t.dtype) for layer, named in ctx.recurrent_out.items()
           for n, t in named.items() if t is not None} if plan.size else {}
    every: List[Any] = [None] * len(plan.ranges)
    dist.all_gather_object(every, own, group=group)
    meta = {k: v for m in every for k, v in m.items()}
    lo, hi = (plan.start, plan.end) if plan.size else (0, 0)
    at = np.flatnonzero((boundary >= lo) & (boundary < hi))
    rows = np.searchsorted(ctx.captured_rows, boundary[at] - lo) if len(at) else at
    dev = ctx.batch.device
    like = torch.zeros((), device=dev)
    for layer, n in sorted(meta):
        shape, dtype = meta[(layer, n)]
        mine = None
        if len(at):
            t = ctx.recurrent_out[layer][n]
            mine = t[torch.from_numpy(rows).to(dev)].to(dtype)
        states.setdefault(layer, {})[n] = _assembled(mine, torch.from_numpy(at).to(dev), (len(boundary), *shape),
                                                     like.to(dtype), 0, group, grad, produced, leaves)
    return states, produced, leaves


def cp_relay(produced: List[Any], leaves: List[torch.Tensor], group) -> Tuple[list, list]:
    """``(tensors, grads)`` to back-propagate for a partition's captures under context
    parallelism: each leaf's gradient summed over the group (every rank of the group calls this
    for the same pass, in the same order), its rows into the rank's own contribution
    (``produced``: ``(own rows or None, dim, their positions)`` per leaf; a K/V shard's,
    ``(own rows or None, None, None)``, already summed when the passes below ran)."""
    tensors, grads = [], []
    for (t, dim, at), leaf in zip(produced, leaves):
        g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        leaf.grad = None
        if dim is None:  # a K/V shard: its gradient came back summed over the group (``_WithAncestors``)
            if t is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g.to(t.dtype))
            continue
        g = g.contiguous()
        dist.all_reduce(g, group=group)
        TRAFFIC.received += g.numel() * g.element_size()
        if t is not None and t.requires_grad:
            tensors.append(t)
            grads.append(g.index_select(dim, at).to(t.dtype))
    return tensors, grads
