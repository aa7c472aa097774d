"""``MemoryPlanner``: pick the partition budget before each step from the memory available.

Memory available, per rank: on CUDA the memory this process can still allocate, measured
before the step - the device's free memory (``torch.cuda.mem_get_info``) plus what torch's
caching allocator holds without using it (``memory_reserved - memory_allocated``: the
blocks an earlier step freed), at most what a cap set with
``torch.cuda.set_per_process_memory_fraction`` leaves above the memory allocated - times
``fraction``; on CPU a configured
``memory_limit_bytes`` (one number, or one per rank), the memory a step may use. Measured
after sharding: under FSDP2 a rank holds 1/world of the parameters and optimizer state,
under HSDP (``replicate_degree`` R) 1/(world/R), and that resident state is already
allocated when the step starts, so it is not available.

The cost model has a per-token term and the head's logits, ``peak = bytes_per_token *
chain_tokens + head_bytes * head_rows``, where ``peak`` is what the step allocates above what
was allocated when it started (the resident state is counted once: out of the memory
available, not again per token). The head (:mod:`treelit.loss.logprobs`) computes a pass's
log-probs in chunks of at most ``chunk_rows`` rows of logits, cut into equal chunks, so the
rows it holds are the targets of the rank's largest pass up to a chunk and the chunks' size
above it (``head_rows``: :func:`~treelit.loss.logprobs.even_chunk_rows`; the targets:
``PartitionStats.max_pass_targets``) - per token up to the chunk, then at most a constant.
``head_bytes`` (:func:`head_row_bytes`) is one row in the compute dtype (float32 for half
models) times the logits-sized buffers a pass holds at its peak, as measured on a step: one
for the fused SFT loss, two for log-probs with entropies, one and a row of the hidden
states' gradient for log-probs alone. ``chunk_rows`` is the run's: ``chunk_rows`` as set, or
:func:`~treelit.loss.logprobs.default_chunk_rows` (1/C of it under context parallelism,
:func:`~treelit.partition.context_parallel.cp_chunk_rows`). What a step allocates besides its
activations and the head is folded into the per-token cost: the gradients' shards (freed after
every update, ``zero_grad(set_to_none=True)``) and, in the first step, the optimizer state
(created by its first update): the cost of chains at least as long as the ones measured is
over-estimated, not under-estimated. ``bytes_per_token`` starts from
``initial_bytes_per_token`` and is calibrated on each rank from the peaks it observed in
earlier steps (:meth:`MemoryPlanner.calibrate`: the peak less the head's term, over the
chain; the largest value seen, with a safety margin). Each rank's budget is the largest ``b``
whose prediction, ``b`` tokens of a chain and ``b`` targets in a pass, times the margin fits
its memory; the prediction is not monotone in ``b`` (one target past a chunk halves the
rows), so :meth:`MemoryPlanner.tokens_for` searches each count of chunks on its own. The
budget used is the **minimum over ranks**, so every rank plans with the same budget and (under
FSDP2) runs aligned passes. Under context parallelism (C ranks share each pass) the
budget is per rank: a chain of partitions holds C x the budget, a path up to C x longer than
one rank holds; the chain tokens a rank measures against are its own share, a chain's / C,
and the targets its own share of a pass's. A rank's queries also attend to the path keys it
receives, and the backward pass holds one layer's scores of those pairs, so under context
parallelism the model adds ``score_bytes * queries * received_keys``
(``score_bytes``: :func:`~treelit.partition.context_parallel.score_pair_bytes`, from the model's
heads and the device: 0 on CPU, whose attention kernels run blockwise; the pairs are the step's
largest pass on this rank), calibrated apart like the head's term. On one branch that fills a
chain the last rank's ``budget`` queries receive ``(C - 1) x budget`` keys (at most the longest
branch), so the budget is the largest ``b`` with ``bytes_per_token * b + head_bytes *
head_rows(b) + score_bytes * b * min((C - 1) b, longest) <= available / margin``. On an
out-of-memory error on any rank, every rank asks :meth:`shrink` for a smaller budget and
retries the update. The chosen budget and the
observed peak are logged.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import lightning.pytorch as pl
import torch

from treelit.loss.logprobs import default_chunk_rows, even_chunk_rows
from treelit.models.forward import output_weight
from treelit.objectives.folding import fold_spec
from treelit.partition.context_parallel import cp_chunk_rows, score_pair_bytes
from treelit.partition.plan import BudgetError
from treelit.utils.memory import LiveBytes
from treelit.utils.numerics import compute_dtype

__all__ = ["MemoryPlanner", "MemoryBudgetError", "head_row_bytes", "head_chunk_rows"]

log = logging.getLogger(__name__)


def _process_fraction(dev) -> float:
    """This process's cap on the device, as a fraction of its memory
    (``torch.cuda.set_per_process_memory_fraction``; 1 where torch cannot say)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get is None else float(get(dev))


def head_row_bytes(model, objective) -> float:
    """Bytes the head holds per row of logits at a pass's peak, in the compute dtype (float32 for
    half models): ``V`` elements for the fused SFT loss (one buffer, updated in place),
    ``2 V`` for log-probs with entropies (the logits and their probabilities), ``V + D`` for
    log-probs alone (one buffer, and a row of the hidden states' gradient in its backward). 0
    without a model or an objective."""
    if model is None or objective is None:
        return 0.0
    W = output_weight(model)
    V, D = int(W.shape[0]), int(W.shape[1])
    size = torch.empty((), dtype=compute_dtype(W)).element_size()
    try:
        spec = fold_spec(objective)
    except NotImplementedError:  # (an objective that cannot run partitioned: log-probs alone)
        return float(size * (V + D))
    if spec.fused_sft:
        return float(size * V)
    return float(size * (2 * V if spec.needs_entropy else V + D))


def head_chunk_rows(model, chunk_rows: Optional[int], C: int = 1) -> int:
    """Rows per logits chunk of the head as a run of C context-parallel ranks uses it
    (:func:`~treelit.partition.context_parallel.cp_chunk_rows`; one process:
    :func:`~treelit.loss.logprobs.default_chunk_rows` unless ``chunk_rows`` is set)."""
    if model is None:
        return 0
    rows = cp_chunk_rows(chunk_rows, model, C)
    w = output_weight(model)
    return int(rows) if rows else default_chunk_rows(int(w.shape[0]), device=w.device)


class MemoryBudgetError(BudgetError):
    """The memory available cannot hold one root-to-leaf path of the step (a user error: too
    little memory for the data, reported on one line)."""


class MemoryPlanner(pl.Callback):
    """Args:
        memory_limit_bytes: memory a step may use on CPU (required there); on CUDA an
            optional cap on top of the free memory.
        fraction: share of the available memory the plan may fill.
        initial_bytes_per_token: cost model before any step was measured.
        margin: multiplier on the calibrated bytes per token.
        shrink_factor: budget multiplier after an out-of-memory error.
        measure_cpu: track peak tensor memory on CPU (a dispatch mode; slows small models).
    """

    def __init__(
        self,
        memory_limit_bytes: Optional[int] = None,
        fraction: float = 0.9,
        initial_bytes_per_token: float = 1 << 20,
        margin: float = 1.1,
        shrink_factor: float = 0.5,
        measure_cpu: bool = True,
    ) -> None:
        self.memory_limit_bytes = memory_limit_bytes
        self.fraction = float(fraction)
        self.bytes_per_token = float(initial_bytes_per_token)
        self.margin = float(margin)
        self.shrink_factor = float(shrink_factor)
        self.measure_cpu = measure_cpu
        self.history: list = []
        self._tracker: Optional[LiveBytes] = None
        self._shrunk = False
        self._resident = 0.0  # bytes allocated on the device when the step started (CUDA)
        self.score_bytes = 0.0  # bytes per (query, received key) pair under context parallelism
        self.head_bytes = 0.0  # bytes per row of the head's logits (:func:`head_row_bytes`)
        self.chunk_rows = 0  # rows per logits chunk of the head (0: not chunked)

    # memory available ------------------------------------------------------------------------
    def _limit(self, pl_module) -> Optional[float]:
        lim = self.memory_limit_bytes
        if lim is None:
            return None
        if isinstance(lim, (list, tuple)) or hasattr(lim, "__getitem__") and not isinstance(lim, (int, float, str)):
            rank = pl_module._comm().rank
            lims = list(lim)
            if len(lims) <= rank:
                raise ValueError(f"callbacks.memory_planner.memory_limit_bytes lists {len(lims)} limits; rank {rank} has none")
            return float(lims[rank])
        return float(lim)

    def available_bytes(self, pl_module) -> float:
        """This rank's memory for a step (not reduced over ranks)."""
        dev = pl_module.device
        limit = self._limit(pl_module)
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            allocated = torch.cuda.memory_allocated(dev)
            avail = float(free + torch.cuda.memory_reserved(dev) - allocated)  # the cache is reusable by this process
            cap = _process_fraction(dev)
            if cap < 1.0:  # torch.cuda.set_per_process_memory_fraction: the allocator stops at cap x total
                avail = min(avail, cap * total - allocated)
            avail = avail if limit is None else min(avail, limit)
        else:
            if limit is None:
                raise ValueError("MemoryPlanner on CPU needs callbacks.memory_planner.memory_limit_bytes")
            avail = limit
        return avail * self.fraction

    def budget_for(self, pl_module, micro_batches) -> int:
        """The step's budget: the minimum over ranks of each rank's own (a collective)."""
        comm = pl_module._comm()
        longest = max(int(mb.position_ids.max()) + 1 for mb in micro_batches)
        avail = self.available_bytes(pl_module)
        C = pl_module._cp_degree() if hasattr(pl_module, "_cp_degree") else 1
        self.set_model_terms(getattr(pl_module, "model", None), getattr(pl_module, "objective", None),
                             getattr(pl_module, "chunk_rows", None), C, pl_module.device)
        longest = int(comm.max(longest))
        budget = int(comm.min(self.tokens_for(avail, C, longest)))
        if budget * C < longest:
            per = f" per rank x {C} context-parallel ranks" if C > 1 else ""
            raise MemoryBudgetError(
                f"callbacks.memory_planner: the memory available holds {budget} tokens{per} per chain of partitions "
                f"(the smallest over ranks; this rank: {avail / 2**20:.0f} MiB at about {self.bytes_per_token * self.margin / 1024:.1f} KiB per "
                f"token), less than the longest branch ({longest} tokens)"
            )
        return budget

    def set_model_terms(self, model, objective, chunk_rows: Optional[int], C: int, device) -> None:
        """The terms the model and the run fix: ``score_bytes`` (context parallelism off CPU),
        ``head_bytes`` and the head's ``chunk_rows`` (as the run of C ranks uses them)."""
        self.score_bytes = score_pair_bytes(model, device) if C > 1 else 0.0
        self.head_bytes = head_row_bytes(model, objective)
        self.chunk_rows = head_chunk_rows(model, chunk_rows, C) if self.head_bytes else 0

    def head_rows(self, targets: int) -> int:
        """Rows of the head's logits buffer for a pass of ``targets`` targets: all of them up to
        a chunk, then the chunks' (equal) size (:func:`~treelit.loss.logprobs.even_chunk_rows`)."""
        targets = int(targets)
        if targets <= 0:
            return 0
        return even_chunk_rows(targets, self.chunk_rows) if self.chunk_rows else targets

    def predicted_peak(self, chain_tokens: float, score_pairs: float = 0.0, targets: int = 0) -> float:
        """The model's peak of a rank whose chain share is ``chain_tokens``, whose queries x
        received keys are ``score_pairs`` and whose largest pass has ``targets`` targets (no margin)."""
        return (self.bytes_per_token * chain_tokens + self.score_bytes * score_pairs
                + self.head_bytes * self.head_rows(targets))

    def calibrate(self, peak: float, chain_tokens: float, score_pairs: float = 0.0, targets: int = 0) -> float:
        """The bytes per token a measured ``peak`` gives: the scores' and the head's terms apart,
        over the rank's share of the chain."""
        rest = peak - self.score_bytes * score_pairs - self.head_bytes * self.head_rows(targets)
        return max(0.0, rest) / max(1.0, float(chain_tokens))

    def tokens_for(self, avail: float, C: int = 1, longest: int = 0) -> int:
        """The largest budget ``b`` per rank whose predicted peak times the margin fits ``avail``:
        ``b`` queries receiving ``min((C - 1) b, longest)`` keys (none at C = 1), and ``b`` targets
        in its largest pass. The head's rows grow with ``b`` up to a chunk and then stay within
        one (:meth:`head_rows`: not monotone, ``c + 1`` targets make two chunks of about ``c / 2``);
        for a given count of chunks they grow with ``b``, so each range of ``k`` chunks is searched
        on its own, from the largest down."""
        cap = avail / self.margin
        a, sc = self.bytes_per_token, self.score_bytes

        def rest(b: int) -> float:  # the prediction without the head's term
            keys = (C - 1) * b if longest <= 0 else min((C - 1) * b, longest)
            return a * b + sc * b * keys

        s = sc * (C - 1)
        if s <= 0:
            hi = int(cap / a)
        else:
            hi = (-a + math.sqrt(a * a + 4.0 * s * cap)) / (2.0 * s)  # a b + s b^2 = cap
            if (C - 1) * hi > longest > 0:  # the path is at most the longest branch
                hi = cap / (a + sc * longest)
            hi = int(hi)
        while hi > 0 and rest(hi) > cap:  # (rounding)
            hi -= 1
        if self.head_bytes <= 0 or hi <= 0:
            return max(0, hi)

        def fits(b: int) -> bool:
            return rest(b) + self.head_bytes * self.head_rows(b) <= cap

        c = self.chunk_rows or hi
        for k in range(-(-hi // c), 0, -1):  # k chunks: b in ((k - 1) c, k c], rows ceil(b / k)
            lo, top = (k - 1) * c + 1, min(k * c, hi)
            if not fits(lo):
                continue
            while lo < top:  # the largest b of this range that fits
                mid = (lo + top + 1) // 2
                lo, top = (mid, top) if fits(mid) else (lo, mid - 1)
            return lo
        return 0

    # hooks ------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.budget_tokens = self.budget_for(pl_module, batch.micro_batches)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._resident = float(torch.cuda.memory_allocated(pl_module.device))
        elif self.measure_cpu:
            self._tracker = LiveBytes()
            self._tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            peak = max(0.0, float(torch.cuda.max_memory_allocated(pl_module.device)) - self._resident)
        elif self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            peak = float(self._tracker.peak)
            self._tracker = None
        else:
            return
        stats = pl_module.last_partition_stats
        chain = max(1, stats.max_chain_tokens if stats is not None and stats.max_chain_tokens else 1)
        # the initial guess gives way to the first measurement, unless an out-of-memory error raised it
        keep = self.history or self._shrunk
        pairs = stats.cp_score_pairs if stats is not None and self.score_bytes else 0
        targets = getattr(stats, "max_pass_targets", 0) if stats is not None and self.head_bytes else 0
        per = self.calibrate(peak, chain, pairs, targets)  # the scores' and the head's terms apart
        self.bytes_per_token = max(self.bytes_per_token if keep else 0.0, per)
        row = {"step": trainer.global_step, "budget": pl_module.budget_tokens, "peak": peak, "chain_tokens": chain,
               "score_pairs": pairs, "head_rows": self.head_rows(targets)}
        self.history.append(row)
        pl_module.log_dict({"planner/budget_tokens": float(row["budget"]), "planner/peak_bytes": peak,
                            "planner/bytes_per_token": self.bytes_per_token, "planner/head_bytes": self.head_bytes})

    def shrink(self, pl_module, micro_batches) -> int:
        """A smaller budget after an out-of-memory error (the cost model is raised to match)."""
        self.bytes_per_token /= self.shrink_factor
        self._shrunk = True
        if self._tracker is not None:
            self._tracker.peak = self._tracker.current
        return self.budget_for(pl_module, micro_batches)
