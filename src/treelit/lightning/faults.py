"""Faults a long run meets and how it ends: non-finite steps and preemption.

**Non-finite steps** (:class:`NonFiniteStep`): :class:`~treelit.lightning.module.TreeLitModule`
checks every update before its optimizer step - the loss of each micro-batch (made of the
policy's log-probs of the trained tokens) and the gradient norm - and the ranks agree on the
outcome through one all-reduce. ``on_nonfinite=stop`` ends the run with one line naming the
step, the micro-batch and its trees (``id (file:line)``); ``on_nonfinite=skip_step`` drops the
update and goes on, until ``max_skipped_steps`` consecutive updates were dropped.

**Preemption** (:class:`Preemption`): SIGTERM, or SLURM's warning signal SIGUSR1
(``#SBATCH --signal=USR1@90``), only sets a flag. At the end of each step the ranks agree on
it (one all-reduce: a signal that reached one rank stops them all), finish that step, write
its checkpoint through the run's checkpoint callback (``<output_dir>/checkpoints`` when there
is none) and exit with :data:`PREEMPTED_EXIT_CODE`; ``resume_from=auto`` continues from it.
Ctrl-C (SIGINT) does the same and exits with :data:`INTERRUPTED_EXIT_CODE` (130, the shell's
code for it), so the step it interrupted is not lost; a second Ctrl-C stops at once, without
saving. Python's own SIGINT handler raises ``KeyboardInterrupt`` wherever the step is, and
Lightning answers it with "attempting graceful shutdown" and exit 1, no checkpoint: ours
replaces it while training runs.
Lightning's own handlers for these signals are replaced while training runs: its SIGTERM
handler issues a collective inside the handler and exits without a checkpoint, and its SLURM
handler writes a checkpoint in the middle of a step; here the behaviour is the same in and out
of SLURM.

Under Lightning's own launcher (``trainer=ddp_cpu`` / ``fsdp2_cpu`` on one machine) rank 0
watches the processes it started and kills them all as soon as one exits with a code other than
0; once the ranks agree on one of these stops, rank 0 stops that watch
(:func:`hold_launched_ranks`) and waits for them (:func:`wait_for_launched_ranks`), so every
process reports and exits with its code.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from treelit.lightning.checkpoint_files import write_and_commit_manifest
from treelit.lightning.step_log import log_step_now
from treelit.utils.distributed import Collectives

__all__ = ["INTERRUPTED_EXIT_CODE", "NonFiniteStep", "PREEMPTED_EXIT_CODE", "Preempted", "Preemption", "exit_code_of",
           "hold_launched_ranks", "wait_for_launched_ranks"]

log = logging.getLogger(__name__)

# EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry"
PREEMPTED_EXIT_CODE = 75
# 128 + SIGINT: what a shell reports for a program that Ctrl-C stopped
INTERRUPTED_EXIT_CODE = 130


def hold_launched_ranks(trainer: Optional[pl.Trainer]) -> None:
    """Rank 0 of Lightning's own launcher: stop its watch over the processes it started (which
    kills every process when one exits with a code other than 0), so that after a stop the
    ranks agreed on each finishes its report. Call on every rank at the agreed point."""
    procs = getattr(getattr(getattr(trainer, "strategy", None), "launcher", None), "procs", None)
    if not procs:
        return
    for t in threading.enumerate():
        if getattr(t, "_main_pid", None) == os.getpid() and isinstance(getattr(t, "_child_processes", None), list):
            t._child_processes = []  # its next check finds nothing to watch, and it ends


def wait_for_launched_ranks(trainer: Optional[pl.Trainer], timeout_s: float = 300.0) -> None:
    """Rank 0 of Lightning's own launcher: wait for the processes it started to exit."""
    for proc in getattr(getattr(getattr(trainer, "strategy", None), "launcher", None), "procs", None) or []:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("rank process %d did not exit within %gs of the stop", proc.pid, timeout_s)


class NonFiniteStep(RuntimeError):
    """A non-finite loss or gradient norm with ``on_nonfinite=stop`` (or a run of
    ``max_skipped_steps`` skipped updates): the message is the one line that reports it, the
    same on every rank. Nothing of the step was applied."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Preempted(SIGTERMException):
    """The run stopped on a preemption signal after writing its checkpoint (a ``SystemExit``
    with :data:`PREEMPTED_EXIT_CODE`; an MLflow run ends ``KILLED``)."""

    def __init__(self, message: str, exit_code: int = PREEMPTED_EXIT_CODE) -> None:
        super().__init__(exit_code)
        self.message = message
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


def exit_code_of(exc: BaseException) -> Optional[int]:
    """The exit code a fault this module reports asks for (None: not one of them); 1 for another
    stop every rank agreed on and reports with the same line (``agreed`` set: a checkpoint, an
    export or a required publish that could not be written)."""
    if isinstance(exc, (NonFiniteStep, Preempted)):
        return getattr(exc, "exit_code", None)
    return 1 if getattr(exc, "agreed", False) else None


def _signal_number(name: Any) -> int:
    if isinstance(name, int):
        return int(name)
    text = str(name).upper()
    sig = getattr(signal, text if text.startswith("SIG") else f"SIG{text}", None)
    if not isinstance(sig, signal.Signals):
        raise ValueError(f"callbacks.preemption.signals: unknown signal {name!r} (e.g. SIGTERM, SIGUSR1)")
    return int(sig)


class Preemption(pl.Callback):
    """Stop at the next step boundary on ``signals``, every rank together, with a checkpoint.

    Args:
        signals: the signals that preempt the run (names such as ``SIGTERM``, ``SIGUSR1``).
        exit_code: the exit code after the checkpoint is written.

    See the module's text. ``received`` holds the signal this process got (None: none).
    """

    def __init__(self, signals: Sequence[Any] = ("SIGTERM", "SIGUSR1", "SIGINT"),
                 exit_code: int = PREEMPTED_EXIT_CODE) -> None:
        self.signals = [_signal_number(s) for s in signals]
        self.exit_code = int(exit_code)
        self.received: Optional[int] = None
        self._interrupts = 0
        self._trainer: Optional[pl.Trainer] = None
        self._before: Dict[int, Any] = {}
        self._installed = False

    def exit_code_for(self, signum: int) -> int:
        """Ctrl-C (SIGINT): :data:`INTERRUPTED_EXIT_CODE`; the other signals: ``exit_code``."""
        return INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else self.exit_code

    # the handlers ------------------------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:  # only a flag: the step loop acts on it
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:  # the second Ctrl-C: no more waiting for the step's end
                raise Preempted(self._at_once_line(), INTERRUPTED_EXIT_CODE)
            self._say(f"Ctrl-C: finishing step {self._step() + 1}, then saving it and stopping "
                      "(Ctrl-C again stops at once, without saving)")
        if self.received is None:
            self.received = int(signum)

    def _step(self) -> int:
        return int(getattr(self._trainer, "global_step", 0) or 0)

    def _at_once_line(self) -> str:
        return (f"interrupted by a second Ctrl-C (SIGINT) in step {self._step() + 1}: stopped at once, without "
                f"saving it; exit code {INTERRUPTED_EXIT_CODE}: run again with resume_from=auto (the same "
                "output_dir) to continue from the newest checkpoint")

    def _say(self, line: str) -> None:
        """One line on stdout from inside the signal handler: a plain ``write(2)`` (Python's
        buffered streams may be in the middle of a write the signal interrupted); rank 0 only."""
        if self._trainer is not None and not self._trainer.is_global_zero:
            return
        try:
            os.write(1, f"\n{line}\n".encode())
        except OSError:
            pass

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the handlers from before Lightning's (Lightning installs its own right before training)
        if threading.current_thread() is threading.main_thread():
            self._before = {s: signal.getsignal(s) for s in self.signals}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only
        self.received = None
        self._interrupts = 0
        self._trainer = trainer
        for s in self.signals:
            self._before.setdefault(s, signal.getsignal(s))
            signal.signal(s, self._handler)
        self._installed = True

    def _restore(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        for s, h in self._before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._installed = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    # the step boundary --------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        signum = int(self._agree(trainer, pl_module, self.received or 0))
        if not signum:
            return
        if trainer.max_steps and 0 < trainer.max_steps <= trainer.global_step:
            return  # the last step is done: the run ends as usual (export, summary)
        name = signal.Signals(signum).name
        log_step_now(trainer)  # this step's metrics before its checkpoint (step_log.py)
        saved = self.save(trainer)
        where = f"saved {saved}" if saved else "nothing new to save"
        code = self.exit_code_for(signum)
        what = "interrupted by Ctrl-C (SIGINT)" if signum == signal.SIGINT else f"preempted by {name}"
        msg = (f"{what}: stopped after step {trainer.global_step} on every rank and {where}; "
               f"exit code {code}: run again with resume_from=auto (the same output_dir) to continue")
        hold_launched_ranks(trainer)
        raise Preempted(msg, code)

    @staticmethod
    def _agree(trainer: pl.Trainer, pl_module: pl.LightningModule, value: float) -> float:
        """The largest value over the ranks (every rank calls it at the same point)."""
        return Collectives(trainer.world_size, pl_module.device).max(float(value))

    def save(self, trainer: pl.Trainer) -> Optional[str]:
        """Write the checkpoint of the step just finished (every rank: a sharded checkpoint is a
        collective): through the run's checkpoint callback (its file name, ``last.ckpt``, its
        write-then-rename), else to ``<default_root_dir>/checkpoints/step-NNNNNN.ckpt``. None when
        that callback wrote this step already (a step whose update was skipped)."""
        ckpt = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
        if ckpt is None:
            return self._save_plain(trainer)
        if ckpt._last_global_step_saved == trainer.global_step:
            return None
        candidates = ckpt._monitor_candidates(trainer)
        saved = None
        if ckpt.save_top_k != 0:
            ckpt._save_topk_checkpoint(trainer, candidates)
            if ckpt._last_global_step_saved == trainer.global_step:
                saved = ckpt._last_checkpoint_saved
        ckpt._save_last_checkpoint(trainer, candidates)
        if ckpt._last_global_step_saved != trainer.global_step:  # save_top_k=0 and no save_last
            return self._save_plain(trainer, ckpt.dirpath)
        return saved or ckpt._last_checkpoint_saved

    @staticmethod
    def _save_plain(trainer: pl.Trainer, dirpath: Optional[str] = None) -> str:
        directory = Path(dirpath or Path(trainer.default_root_dir) / "checkpoints")
        path = directory / f"step-{trainer.global_step:06d}.ckpt"
        partial = f"{path}.partial"
        if trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier("Preemption.mkdir")
        trainer.save_checkpoint(partial)
        if trainer.is_global_zero and os.path.exists(partial):
            write_and_commit_manifest(partial, str(path))  # its manifest lands with it
        trainer.strategy.barrier("Preemption.rename")
        return str(path)
