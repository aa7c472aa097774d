"""``MemoryPlanner``: pick the partition budget before each step from the memory available.

Memory available: on CUDA the free device memory (``torch.cuda.mem_get_info``) times
``fraction``, *min-reduced across ranks* so every rank follows the same plan and issues
the same collectives; on CPU a configured ``memory_limit_bytes``. The cost model is
linear in the tokens alive along a chain of partitions, ``peak = bytes_per_token *
chain_tokens``; ``bytes_per_token`` starts from ``initial_bytes_per_token`` and is
calibrated from the peaks observed in earlier steps (the largest ratio seen, with a
safety margin). The chosen budget and the observed peak are logged. On an
out-of-memory error the module asks :meth:`shrink` for a smaller budget and retries.
"""

from __future__ import annotations

import logging
from typing import Optional

import lightning.pytorch as pl
import torch

from treelit.utils.memory import LiveBytes

__all__ = ["MemoryPlanner"]

log = logging.getLogger(__name__)


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

    # memory available ------------------------------------------------------------------------
    def available_bytes(self, pl_module) -> float:
        dev = pl_module.device
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            avail = float(free)
            if self.memory_limit_bytes is not None:
                avail = min(avail, float(self.memory_limit_bytes))
        else:
            if self.memory_limit_bytes is None:
                raise ValueError("MemoryPlanner on CPU needs callbacks.memory_planner.memory_limit_bytes")
            avail = float(self.memory_limit_bytes)
        avail *= self.fraction
        trainer = pl_module.trainer
        if trainer is not None and trainer.world_size > 1:  # every rank follows the same plan
            t = torch.tensor(avail, dtype=torch.float64, device=dev)
            avail = float(trainer.strategy.reduce(t, reduce_op="min"))
        return avail

    def budget_for(self, pl_module, micro_batches) -> int:
        longest = max(int(mb.position_ids.max()) + 1 for mb in micro_batches)
        budget = int(self.available_bytes(pl_module) / (self.bytes_per_token * self.margin))
        if budget < longest:
            raise RuntimeError(
                f"the memory available ({self.available_bytes(pl_module) / 2**20:.0f} MiB at about "
                f"{self.bytes_per_token * self.margin / 1024:.1f} KiB per token) holds {budget} tokens, "
                f"less than the longest branch ({longest} tokens)"
            )
        return budget

    # hooks ------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.budget_tokens = self.budget_for(pl_module, batch.micro_batches)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        elif self.measure_cpu:
            self._tracker = LiveBytes()
            self._tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            peak = float(torch.cuda.max_memory_allocated(pl_module.device))
        elif self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            peak = float(self._tracker.peak)
            self._tracker = None
        else:
            return
        stats = pl_module.last_partition_stats
        chain = max(1, stats.max_chain_tokens if stats is not None and stats.max_chain_tokens else 1)
        self.bytes_per_token = max(self.bytes_per_token if self.history else 0.0, peak / chain)
        row = {"step": trainer.global_step, "budget": pl_module.budget_tokens, "peak": peak, "chain_tokens": chain}
        self.history.append(row)
        pl_module.log_dict({"planner/budget_tokens": float(row["budget"]), "planner/peak_bytes": peak,
                            "planner/bytes_per_token": self.bytes_per_token})

    def shrink(self, pl_module, micro_batches) -> int:
        """A smaller budget after an out-of-memory error (the cost model is raised to match)."""
        self.bytes_per_token /= self.shrink_factor
        if self._tracker is not None:
            self._tracker.peak = self._tracker.current
        return self.budget_for(pl_module, micro_batches)
