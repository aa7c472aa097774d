"""Test-only callbacks that inject a fault at a known point of training. A run loads them with
``+callbacks.NAME._target_=injectors.CLASS`` (this folder on ``PYTHONPATH`` for a subprocess).

Points of a step (``at``): ``before`` - at the start of the step, before any pass; ``during``
- in the forward pass of the step's first micro-batch; ``after`` - once the step's update is
applied. ``step`` counts data steps from 1 (the data stream's ``index + 1``); ``rank`` is the
global rank that gets the fault (None: every rank)."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from typing import Optional

import lightning.pytorch as pl
import torch


def _mine(trainer, rank: Optional[int]) -> bool:
    return rank is None or int(trainer.global_rank) == int(rank)


class SendSignal(pl.Callback):
    """Sends signal ``sig`` to this process at point ``at`` of data step ``step`` (on ``rank``),
    ``times`` times in a row (a second Ctrl-C)."""

    def __init__(self, step: int, at: str = "during", sig: str = "SIGUSR1", rank: Optional[int] = None,
                 times: int = 1) -> None:
        assert at in ("before", "during", "after"), at
        self.step, self.at, self.rank, self.times = int(step), at, rank, int(times)
        self.signum = signal.Signals[sig]
        self._hook = None

    def _send(self) -> None:
        for _ in range(self.times):
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch.index + 1 != self.step or not _mine(trainer, self.rank):
            return
        if self.at == "before":
            self._send()
        elif self.at == "during":
            def hook(module, args, out):
                self._hook.remove()
                self._send()

            self._hook = pl_module.model.tok_embeddings.register_forward_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch.index + 1 == self.step and self.at == "after" and _mine(trainer, self.rank):
            self._send()


class NonFinite(pl.Callback):
    """Makes data step ``step`` non-finite on ``rank``: ``loss`` - the embeddings of its first
    micro-batch are NaN in the forward pass (a non-finite loss); ``gradient`` - the loss stays
    finite, the gradient flowing back into the embeddings of the micro-batches that hold token
    ``token`` (default: of the first micro-batch, whenever the same input passes again) is NaN.
    ``every``: every data step from ``step`` on."""

    def __init__(self, step: int, kind: str = "loss", rank: Optional[int] = None, token: Optional[int] = None,
                 every: bool = False) -> None:
        assert kind in ("loss", "gradient"), kind
        self.step, self.kind, self.rank, self.token, self.every = int(step), kind, rank, token, bool(every)
        self._hook = None
        self._first = None

    def _now(self, trainer, batch) -> bool:
        n = batch.index + 1
        return (n >= self.step if self.every else n == self.step) and _mine(trainer, self.rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._now(trainer, batch):
            return
        self._first = None

        def hook(module, args, out):
            ids = args[0]
            if self._first is None:
                self._first = ids.clone()
            same = ids.shape == self._first.shape and bool(torch.equal(ids, self._first))
            hit = bool((ids == self.token).any()) if self.token is not None else same
            if not hit:
                return None
            if self.kind == "loss":
                return out * float("nan")
            out.register_hook(lambda g: g * float("nan"))
            return None

        self._hook = pl_module.model.tok_embeddings.register_forward_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class DropDataStep(pl.Callback):
    """The data stream without data step ``step``: step k of the run is the stream's step k for
    k < ``step`` and its step k + 1 after (the reference for a skipped step)."""

    def __init__(self, step: int) -> None:
        self.step = int(step)

    def setup(self, trainer, pl_module, stage) -> None:
        dm = trainer.datamodule
        original = dm.step
        drop = self.step - 1

        def step(index: int):
            return replace(original(index + (index >= drop)), index=index)

        dm.step = step


class HoldUntilSignal(pl.Callback):
    """At the start of data step ``step``: writes ``marker`` (the test then signals the run from
    outside) and waits until the run's ``Preemption`` callback has received the signal."""

    def __init__(self, step: int, marker: str, timeout_s: float = 120.0) -> None:
        self.step, self.marker, self.timeout_s = int(step), marker, float(timeout_s)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch.index + 1 != self.step:
            return
        import time

        watcher = next(c for c in trainer.callbacks if type(c).__name__ == "Preemption")
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
        end = time.monotonic() + self.timeout_s
        while watcher.received is None and time.monotonic() < end:
            time.sleep(0.05)


class SignalDuringWrite(pl.Callback):
    """Sends ``sig`` to this process in the middle of the checkpoint file written at the end of
    data step ``step``: half its bytes are on disk (fsync'ed), the rest follow if the process
    lives on (SIGTERM only sets the preemption flag; SIGKILL ends it there)."""

    def __init__(self, step: int, sig: str = "SIGKILL") -> None:
        self.step, self.signum = int(step), signal.Signals[sig]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch.index + 1 != self.step:
            return
        io_ = trainer.strategy.checkpoint_io
        original = io_.save_checkpoint

        def save_checkpoint(checkpoint, path, storage_options=None):
            import io as _io

            io_.save_checkpoint = original  # once
            buf = _io.BytesIO()
            torch.save(checkpoint, buf)
            data = buf.getvalue()
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                os.kill(os.getpid(), self.signum)
                f.write(data[len(data) // 2:])
                f.flush()
                os.fsync(f.fileno())

        io_.save_checkpoint = save_checkpoint


class KillAfterCommit(pl.Callback):
    """SIGKILL right after the checkpoint of global step ``step`` is renamed into place: before
    Lightning logs that step's metrics, unless they were logged before the checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = int(step)

    def setup(self, trainer, pl_module, stage) -> None:
        ckpt = next(c for c in trainer.checkpoint_callbacks if hasattr(c, "_commit"))
        original = ckpt._commit

        def commit(partial, filepath):
            original(partial, filepath)
            if trainer.global_step == self.step and "last" in os.path.basename(filepath):
                os.kill(os.getpid(), signal.SIGKILL)

        ckpt._commit = commit


class Pace(pl.Callback):
    """Slows a run down so that signals sent from outside at random moments land in every
    phase: each step ends ``step_s`` seconds later, and each checkpoint file is written in two
    halves ``write_s`` seconds apart (the soak test)."""

    def __init__(self, step_s: float = 0.2, write_s: float = 0.2) -> None:
        self.step_s, self.write_s = float(step_s), float(write_s)

    def on_train_start(self, trainer, pl_module) -> None:
        io_ = trainer.strategy.checkpoint_io
        if getattr(io_, "_paced", False):
            return
        pause = self.write_s

        def save_checkpoint(checkpoint, path, storage_options=None):
            import io as _io
            import time

            buf = _io.BytesIO()
            torch.save(checkpoint, buf)
            data = buf.getvalue()
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                time.sleep(pause)
                f.write(data[len(data) // 2:])
                f.flush()
                os.fsync(f.fileno())

        io_.save_checkpoint = save_checkpoint
        io_._paced = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        time.sleep(self.step_s)
