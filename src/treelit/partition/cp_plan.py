"""Context parallelism's plan (:mod:`treelit.partition.context_parallel`): which layers it
covers, each token's cost and memory, the C ranges of a row and each rank's path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from treelit.attention.base import ATTENTION
from treelit.loss.logprobs import default_chunk_rows
from treelit.models.forward import output_weight
from treelit.models.hf_kernels import TREE_KERNELS, WRAPPER_KERNELS
from treelit.tree.batch import TreeBatch


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
