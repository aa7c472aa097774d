"""Non-finite updates: the check before each optimizer step and the one-line report that names
the step, what was not finite, and the micro-batches (and their trees) that made it so
(a mixin of :class:`~treelit.lightning.module.TreeLitModule`; ``on_nonfinite``).
"""

from __future__ import annotations

import logging
import math

import torch

from treelit.lightning.executors import Norms, UpdateStep
from treelit.lightning.faults import NonFiniteStep, hold_launched_ranks
from treelit.partition.engine import PartitionStats, PassState
from treelit.utils.distributed import Collectives

__all__ = ["NonFiniteChecks"]

log = logging.getLogger("treelit.lightning.module")


class NonFiniteChecks:
    """The module's non-finite checks (it provides ``_comm``, ``executor``, ``_zero_grad``,
    ``_trained_parameters``, ``_fsdp`` and the counters)."""

    # non-finite updates --------------------------------------------------------------------------
    def _drop_nonfinite(self, micro_batches, grad_norm: float) -> bool:
        """True when this update must not be applied: the loss of a micro-batch (on any rank) or
        the gradient norm is not finite. One all-reduce; every rank gets the same answer. The
        caller then clears the gradients and takes no optimizer or scheduler step (the optimizer
        state stays as it was). ``on_nonfinite=stop``, or a run of ``max_skipped_steps`` dropped
        updates, raises :class:`~treelit.lightning.faults.NonFiniteStep` with one line naming the
        step, the micro-batch and its trees; ``skip_step`` logs the dropped update and goes on."""
        mine = [(mb, v) for mb, v in self._micro_losses if not math.isfinite(v)]
        comm = self._comm()
        if not comm.max(float(bool(mine) or not math.isfinite(grad_norm))):
            return False
        report = self._nonfinite_report(micro_batches, mine, grad_norm, comm)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.on_nonfinite == "stop":
            hold_launched_ranks(self._trainer)
            raise NonFiniteStep(f"{report}; the update was not applied and nothing was saved (on_nonfinite=stop; "
                                "on_nonfinite=skip_step drops such updates and goes on)")
        if self.consecutive_skips >= self.max_skipped_steps:
            self._log_skipped_now()  # the step's own log never comes: the last dropped update counts too
            hold_launched_ranks(self._trainer)
            raise NonFiniteStep(f"{report}; {self.consecutive_skips} updates in a row were dropped "
                                f"(max_skipped_steps={self.max_skipped_steps}): stopping, nothing of them applied")
        if comm.rank == 0:
            log.warning("%s; the update was dropped (on_nonfinite=skip_step: %d in a row, %d in all)", report,
                        self.consecutive_skips, self.skipped_steps)
        return True

    def _log_skipped_now(self) -> None:
        """``train/skipped_steps`` straight to the loggers (rank 0), at this step's index."""
        if self._trainer is None or not self.trainer.is_global_zero:
            return
        for lg in self.trainer.loggers:
            lg.log_metrics({"train/skipped_steps": float(self.skipped_steps)}, step=max(self.global_step - 1, 0))
            lg.save()

    def _nonfinite_report(self, micro_batches, mine, grad_norm: float, comm: Collectives) -> str:
        """One line, the same on every rank: the step, what was not finite, and each micro-batch
        that made it so with its trees (``id (file:line)``), on every rank. When every loss is
        finite but the gradient norm is not, each micro-batch's gradient is computed again on its
        own to find those whose gradient is not finite (every rank runs the same passes)."""
        what = [] if math.isfinite(grad_norm) else [f"gradient norm {grad_norm}"]
        if comm.max(float(bool(mine))):
            what.insert(0, "loss")
            parts = [self._describe(mb, f"loss {v}", comm) for mb, v in mine]
        else:
            parts = [self._describe(mb, "its gradient alone is not finite", comm)
                     for mb in self._nonfinite_gradients(micro_batches, comm)]
        text = "; ".join(parts)
        every = comm.gather_lists(list(text.encode("utf-8"))) if comm.distributed else [list(text.encode("utf-8"))]
        found = "; ".join(p for p in (bytes(b).decode("utf-8", "replace") for b in every) if p)
        data = getattr(self, "_data_step", None)
        step = f"step {self.global_step + 1}"
        if data is not None and data != self.global_step:
            step += f" (data step {data + 1})"
        return f"{step}: non-finite {' and '.join(what)} - " + (found or "no single micro-batch reproduces it alone")

    def _describe(self, mb, why: str, comm: Collectives) -> str:
        pos, count, trees = self._where.get(id(mb), (None, None, None))
        where = f"micro-batch {pos + 1} of {count}" if pos is not None else "a micro-batch"
        if comm.distributed:
            where += f" on rank {comm.rank}"
        if trees is None:
            return f"{where} ({why})"
        if not trees:
            return f"{where} ({why}): an empty pass"
        return f"{where} ({why}): tree{'s' if len(trees) != 1 else ''} {', '.join(trees)}"

    def _nonfinite_gradients(self, micro_batches, comm: Collectives) -> list:
        """The micro-batches whose gradient, computed on its own, is not finite (the gradients
        are cleared before and after). Under FSDP2 a gradient is the ranks' sum: a micro-batch
        position found there names that position on every rank."""
        norms = getattr(self, "_normalizers", None) or Norms(1.0)
        found = []
        if not self.executor.recomputes_alone():
            return found
        for mb in micro_batches:
            self._zero_grad()
            self.executor.run(mb, UpdateStep(norms, self.budget_tokens, PassState(PartitionStats(), comm)))
            bad = any(not bool(torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all())
                      for g in (p.grad for p in self._trained_parameters()) if g is not None)
            if (comm.max(float(bad)) if self._fsdp() else bad):
                found.append(mb)
        self._zero_grad()
        return found
