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
allocated when the step starts, so it is not available. The cost model is
linear in the tokens alive along a chain of partitions, ``peak = bytes_per_token *
chain_tokens``, where ``peak`` is what the step allocates above what was allocated when it
started (the resident state is counted once: out of the memory available, not again per
token). What a step allocates besides its activations is folded into that per-token cost:
the gradients' shards (freed after every update, ``zero_grad(set_to_none=True)``) and, in
the first step, the optimizer state (created by its first update): the cost of chains at
least as long as the ones measured is over-estimated, not under-estimated.
``bytes_per_token`` starts from ``initial_bytes_per_token`` and is calibrated on each rank from the peaks it observed in earlier steps (the largest ratio seen, with a safety
margin). Each rank's budget is ``available / (bytes_per_token * margin)``; the budget
used is the **minimum over ranks**, so every rank plans with the same budget and (under
FSDP2) runs aligned passes. Under context parallelism (C ranks share each pass) the
budget is per rank: a chain of partitions holds C x the budget, a path up to C x longer than
one rank holds; the chain tokens a rank measures against are its own share, a chain's / C.
A rank's queries also attend to the path keys it receives, and the backward pass holds one
layer's scores of those pairs, so under context parallelism the model is
``peak = bytes_per_token * chain_tokens + score_bytes * queries * received_keys``
(``score_bytes``: :func:`~treelit.partition.context_parallel.score_pair_bytes`, from the model's
heads and the device: 0 on CPU, whose attention kernels run blockwise; the pairs are the step's
largest pass on this rank). On one branch that fills a
chain the last rank's ``budget`` queries receive ``(C - 1) x budget`` keys (at most the longest
branch), so the budget solves ``bytes_per_token * b + score_bytes * b * min((C - 1) b, longest)
= available / margin``. On an out-of-memory error on any rank, every rank asks
:meth:`shrink` for a smaller budget and retries the update. The chosen budget and the
observed peak are logged.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import lightning.pytorch as pl
import torch

from treelit.partition.context_parallel import score_pair_bytes
from treelit.partition.plan import BudgetError
from treelit.utils.memory import LiveBytes

__all__ = ["MemoryPlanner", "MemoryBudgetError"]

log = logging.getLogger(__name__)


def _process_fraction(dev) -> float:
    """This process's cap on the device, as a fraction of its memory
    (``torch.cuda.set_per_process_memory_fraction``; 1 where torch cannot say)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get is None else float(get(dev))


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
        self.score_bytes = score_pair_bytes(getattr(pl_module, "model", None), pl_module.device) if C > 1 else 0.0
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

    def predicted_peak(self, chain_tokens: float, score_pairs: float = 0.0) -> float:
        """The model's peak of a rank whose chain share is ``chain_tokens`` and whose queries x
        received keys are ``score_pairs`` (no margin)."""
        return self.bytes_per_token * chain_tokens + self.score_bytes * score_pairs

    def tokens_for(self, avail: float, C: int = 1, longest: int = 0) -> int:
        """The largest budget ``b`` per rank whose predicted peak times the margin fits ``avail``:
        ``b`` queries receiving ``min((C - 1) b, longest)`` keys (none at C = 1)."""
        cap = avail / self.margin
        a, s = self.bytes_per_token, self.score_bytes * (C - 1)
        if s <= 0:
            return int(cap / a)
        b = (-a + math.sqrt(a * a + 4.0 * s * cap)) / (2.0 * s)  # a b + s b^2 = cap
        if (C - 1) * b > longest > 0:  # the path is at most the longest branch
            b = cap / (a + self.score_bytes * longest)
        return int(b)

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
        per = max(0.0, peak - self.score_bytes * pairs) / chain  # the scores' term apart
        self.bytes_per_token = max(self.bytes_per_token if keep else 0.0, per)
        row = {"step": trainer.global_step, "budget": pl_module.budget_tokens, "peak": peak, "chain_tokens": chain,
               "score_pairs": pairs}
        self.history.append(row)
        pl_module.log_dict({"planner/budget_tokens": float(row["budget"]), "planner/peak_bytes": peak,
                            "planner/bytes_per_token": self.bytes_per_token})

    def shrink(self, pl_module, micro_batches) -> int:
        """A smaller budget after an out-of-memory error (the cost model is raised to match)."""
        self.bytes_per_token /= self.shrink_factor
        self._shrunk = True
        if self._tracker is not None:
            self._tracker.peak = self._tracker.current
        return self.budget_for(pl_module, micro_batches)
