"""Callbacks: a progress bar over optimizer steps, checkpoints, step-metric logging and the
Hugging Face export."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from weakref import proxy

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

from treelit.lightning.checkpoint_files import commit
from treelit.lightning.faults import hold_launched_ranks
from treelit.lightning.mlflow_logger import log_artifact_checked
from treelit.lightning.step_log import log_step_now
from treelit.loss.tree import tree_token_logprobs
from treelit.models.hf import NATIVE_MODEL_TYPE, full_state_dict, save_hf_checkpoint
from treelit.models.lora import adapter_state_dict, lora_of, merged_state_dict, save_adapter
from treelit.objectives.paths import branch_target_sums
from treelit.partition.engine import policy_logprobs
from treelit.utils.integrity import (FULL, MANIFEST_SUFFIX, WriteFailed, disk_full, fmt_bytes, fsync_path,
                                     remove_path, write_manifest)

log = logging.getLogger(__name__)


class TreeProgressBar(TQDMProgressBar):
    """TQDM bar over optimizer steps: the data stream is endless, so the total is
    ``max_steps`` and the position ``trainer.global_step`` (right after a resume too, and
    with several optimizer updates per step batch); shows loss, tree tokens/s and effective
    (flat) tokens/s.

    When standard output is not a terminal (a file, a pipe, a job log) the bar's redrawn
    frames would fill the log; plain lines replace them: the first step, then one line every
    ``log_every_s`` seconds, and the last step, e.g.
    ``step 40/300: loss 5.812, tree_tok/s 2,954, flat_tok/s 11,610 (20s, about 2m10s left)``.
    ``plain``: ``None`` decides from the terminal, ``True``/``False`` forces lines/the bar.
    Under the bar the same lines go to ``train.log`` only (``extra={"file_only": True}``: the
    console handler leaves them out), so the run's log holds its steps either way.

    The time left is estimated from the steps after this run's first: the first step pays for
    compilation, the allocator's warm-up and the first batches' reading, and a 39 s run was once
    told "about 4m52s left" after it. The first step's line gives no estimate.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False,
                 plain: Optional[bool] = None, log_every_s: float = 20.0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.plain = plain
        self.log_every_s = float(log_every_s)
        self._lines = False  # printing plain lines instead of the bar
        self._start: Optional[Tuple[float, int]] = None  # (time, global step) when training started
        self._last_line: Optional[Tuple[float, int]] = None  # (time, step) of the last line printed
        self._first_end: Optional[Tuple[float, int]] = None  # (time, global step) when this run's first step ended

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # disables the bar on ranks other than 0
        plain = not _is_terminal(sys.stdout) if self.plain is None else bool(self.plain)
        if self.is_enabled and plain:
            self._lines = True
            self.disable()  # Lightning's bars are created disabled: they write nothing

    def _over_steps(self, trainer: pl.Trainer) -> None:
        bar = self.train_progress_bar
        if bar is None or not trainer.max_steps or trainer.max_steps <= 0:
            return
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step
        bar.set_description("steps")
        bar.refresh()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._over_steps(trainer)  # a resumed run starts mid-epoch: no on_train_epoch_start
        self._start, self._last_line, self._first_end = (time.monotonic(), int(trainer.global_step)), None, None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._over_steps(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        if self._first_end is None:
            self._first_end = (now, int(trainer.global_step))
        if self._lines or self._logs_steps(trainer):
            last = trainer.max_steps and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
            if self._last_line is None or last or now - self._last_line[0] >= self.log_every_s:
                self._print_line(trainer, pl_module, now)
            if self._lines:
                return
        bar = self.train_progress_bar
        n = trainer.global_step
        if bar is not None and self.is_enabled and (n % self.refresh_rate == 0 or n == bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if ((self._lines or self._logs_steps(trainer)) and self._last_line is not None
                and self._last_line[1] != trainer.global_step):
            self._print_line(trainer, pl_module, time.monotonic())  # stopped before max_steps

    def _logs_steps(self, trainer: pl.Trainer) -> bool:
        """Under the bar: the step lines still go to the log file (rank 0 only, as the bar)."""
        return self.is_enabled and bool(getattr(trainer, "is_global_zero", True))

    def _print_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, now: float) -> None:
        n, total = int(trainer.global_step), trainer.max_steps
        self._last_line = (now, n)
        head = f"step {n}/{total}" if total and total > 0 else f"step {n}"
        metrics = ", ".join(f"{k} {_number(v)}" for k, v in self.get_metrics(trainer, pl_module).items())
        t0, _ = self._start or (now, 0)
        tail = _duration(now - t0)
        t1, n1 = self._first_end or (now, n)
        if total and total > 0 and n > n1 and n < total:  # the rate of the steps after the first
            tail += f", about {_duration((now - t1) / (n - n1) * (total - n))} left"
        extra = None if self._lines else {"file_only": True}  # under the bar: train.log only
        log.info("%s%s (%s)", head, f": {metrics}" if metrics else "", tail, extra=extra)

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _number(v: Any) -> str:
    """A metric for a plain progress line: ``5.812``, ``2,954``, ``-2.2e-09``."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if x != x or abs(x) == float("inf"):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.4g}"


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class TreeCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for treelit's manual optimization.

    treelit runs a step's optimizer update(s) inside ``training_step``, so a checkpoint
    written at the end of step k holds the weights and optimizer state *after* update k
    together with the data position and loop counters of step k: resuming from it continues
    exactly as the uninterrupted run would (tested bit for bit, also after ``kill -9``).
    Lightning warns about manual optimization because for other modules the post-update
    state may be unintended; here it is the intended state, so that warning is not shown.
    Each file is written as ``<name>.partial`` beside its final name, fsync'ed, then renamed
    over it, its manifest renamed into place first: a run killed while writing leaves the
    previous checkpoint (``last.ckpt`` included) intact, and the next start finishes or removes
    what the kill left (:mod:`treelit.lightning.checkpoint_files`). A name is reused, never
    versioned: a resumed run that redoes a step writes ``step-N.ckpt`` and ``last.ckpt`` again
    (no ``last-v1.ckpt``), so ``last.ckpt`` is always the newest step written. A single-file
    checkpoint is streamed by ``torch.save`` straight into that file (:class:`TreeCheckpointIO`; Lightning's own writer holds a second copy of the whole
    checkpoint in memory and stages it in the system temporary directory, then *moves* it,
    which is a copy, not an atomic rename, when that directory is on another filesystem). A
    resumed run writes to its ``output_dir``: the folder it resumed from (``output_dir=`` that
    run's folder) or a new one.

    Every checkpoint gets a manifest (:mod:`treelit.utils.integrity`): the size and SHA-256
    of each file, in ``<name>.manifest.json`` beside a single file, in
    ``treelit-manifest.json`` inside a sharded folder; ``resume_from`` checks it before
    anything is loaded. A write that fails (a full disk, a quota, the file-size limit, or
    anything else) on any rank is agreed by every rank: the partial files are removed, the
    previous checkpoint stays as it was, and training stops with one line naming the path and
    the bytes the checkpoint needed (:class:`~treelit.utils.integrity.WriteFailed`).

    Before each write it checks that the checkpoints this run wrote earlier are still there:
    Lightning would recreate a deleted directory and write only the new file, so a folder
    removed mid-run would silently lose every earlier checkpoint. The loss is logged as a
    warning naming the directory and the files.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_version_counter", False)  # the same step is the same state: overwrite it
        super().__init__(*args, **kwargs)
        self._written: dict = {}  # the files this run wrote and still expects (an ordered set)

    def _monitor_candidates(self, trainer: "pl.Trainer") -> dict:
        # The module logs a metric named ``step`` (the optimizer step's MLflow axis, global_step - 1);
        # file names count steps done, as ``resume_from`` and the README name them: global_step.
        out = super()._monitor_candidates(trainer)
        out["step"] = torch.tensor(trainer.global_step)
        return out

    def _check_written(self, filepath: str) -> None:
        gone = [p for p in self._written if not os.path.exists(p)]
        if not gone:
            return
        for p in gone:
            del self._written[p]
        where = os.path.dirname(os.path.abspath(gone[0]))
        names = ", ".join(os.path.basename(p) for p in gone)
        if not os.path.isdir(where):
            log.warning("checkpoint directory %s was deleted during the run: the earlier checkpoints (%s) are lost; "
                        "writing %s into a new one", where, names, os.path.basename(filepath))
        else:
            log.warning("checkpoints deleted from %s during the run (not by this run): %s are lost; writing %s",
                        where, names, os.path.basename(filepath))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        strategy = trainer.strategy
        if type(getattr(strategy, "_checkpoint_io", None) or TorchCheckpointIO()) is TorchCheckpointIO:
            strategy.checkpoint_io = TreeCheckpointIO()  # Lightning's default writer only, not a user's plugin

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if trainer.is_global_zero:
            self._check_written(filepath)
        partial = f"{filepath}.partial"
        manifest = f"{filepath}{MANIFEST_SUFFIX}"
        error, report = self._write(trainer, partial, filepath)
        reports = _all_ranks(trainer, report)  # every rank learns whether any rank failed, and why
        failed = next((r for r in reports if r["why"]), None)
        if failed is not None:
            if trainer.is_global_zero:
                remove_path(partial)
                remove_path(f"{manifest}.partial")
            trainer.strategy.barrier("TreeCheckpoint.failed")
            if error is not None and failed["code"] is None and failed["rank"] == trainer.global_rank:
                raise error  # not for want of space: this rank's own error, as it was raised
            needed = sum(r["needed"] or 0 for r in reports) if failed["sharded"] else failed["needed"]
            raise _agreed(trainer, WriteFailed(self._failure_line(trainer, filepath, failed, needed),
                                               failed["code"] or 0, filepath, needed))
        if trainer.is_global_zero and os.path.exists(partial):
            self._commit(partial, filepath)
            self._written[filepath] = None
        trainer.strategy.barrier("TreeCheckpoint.rename")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _write(self, trainer: pl.Trainer, partial: str, filepath: str) -> Tuple[Optional[BaseException], dict]:
        """Write the checkpoint under ``partial``, and its manifest (rank 0). Returns this rank's
        exception (None) and its report: the rank that failed, the ``errno`` of a write that
        failed for want of space, why (None: written), the bytes this rank's part needs."""
        sharded = bool(getattr(trainer.strategy, "_save_distributed_checkpoint", False)) and trainer.world_size > 1
        report: Dict[str, Any] = {"rank": int(trainer.global_rank), "code": None, "why": None, "needed": None,
                                  "sharded": sharded}
        checkpoint = None
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
            report["needed"] = _tensor_bytes(checkpoint)  # this rank's part (before the strategy takes the tensors)
            trainer.strategy.save_checkpoint(checkpoint, partial)
            if trainer.is_global_zero and os.path.exists(partial):
                # everything that takes space is written before the ranks agree; the commit only renames
                write_manifest(partial, name=os.path.basename(filepath), where=f"{filepath}{MANIFEST_SUFFIX}.partial")
            return None, report
        except (Exception, _checkpoint_exception()) as exc:  # torch's CheckpointException is a BaseException
            code = disk_full(exc)
            if code is not None and checkpoint is not None and not sharded and trainer.is_global_zero:
                report["needed"] = _serialized_bytes(checkpoint, report["needed"])  # one file: its exact size
            failures = getattr(exc, "failures", None)  # torch's distributed checkpoint: the ranks that failed
            if isinstance(failures, dict) and failures:
                report["rank"] = min(failures)
            report.update(code=code, why=FULL[code] if code is not None else _first_line(exc))
            return exc, report

    @staticmethod
    def _commit(partial: str, filepath: str) -> None:
        """Renames only, the manifest first (:mod:`treelit.lightning.checkpoint_files`)."""
        commit(partial, filepath)

    def _failure_line(self, trainer: pl.Trainer, filepath: str, failed: dict, needed: Optional[int]) -> str:
        """One line: the checkpoint, why, the rank, the bytes it needed, what is left to resume from."""
        where = f" (rank {failed['rank']} of {trainer.world_size})" if trainer.world_size > 1 else ""
        size = ""
        if failed["code"] is not None:
            size = (f"; it needs about {fmt_bytes(needed)} (the shards of every rank)" if failed["sharded"]
                    else f"; it needs {fmt_bytes(needed)}")
        previous = self._last_checkpoint_saved
        if previous and os.path.exists(previous):
            same = previous == filepath
            kept = (f"the previous {'one' if same else 'checkpoint ' + previous} (step {self._last_global_step_saved}) "
                    f"is {'as it was' if same else 'complete'}: resume_from={previous} continues from it once there "
                    "is room")
        else:
            kept = "this run has no earlier checkpoint"
        return (f"checkpoint {filepath} not written at step {trainer.global_step}: {failed['why']}{where}{size}; "
                f"its partial files were removed; {kept}")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        log_step_now(trainer)  # the step's metrics before the checkpoint that holds the step (step_log.py)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, *args, **kwargs)

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self._written.pop(filepath, None)
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            remove_path(f"{filepath}{MANIFEST_SUFFIX}")

    def load_state_dict(self, state_dict: Any) -> None:
        # a resumed run writes its checkpoints to its output_dir, which may be a new folder
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed from")
            super().load_state_dict(state_dict)


class TreeCheckpointIO(TorchCheckpointIO):
    """Lightning's single-file checkpoint writer, with ``torch.save`` streaming into the file
    itself (then fsync): no second copy of the checkpoint in memory, no staging elsewhere. The
    file is always a new one (a name already there is unlinked first, not truncated)."""

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("TreeCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # a new file, never one opened in place: a name left as a hard link to another checkpoint
        # (``resume_from=auto`` links ``last.ckpt.partial`` to ``step-N.ckpt``) would truncate that one
        path.unlink(missing_ok=True)
        with open(path, "xb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())


class _Counter:
    """A file that only counts what is written to it."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.n += n
        return n

    def flush(self) -> None:
        pass


def _serialized_bytes(checkpoint: Any, fallback: Optional[int]) -> Optional[int]:
    """The exact size of ``torch.save(checkpoint)``, without writing it anywhere."""
    counter = _Counter()
    try:
        torch.save(checkpoint, counter)
    except Exception:  # pragma: no cover - the estimate from the tensors then
        return fallback
    return counter.n


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` held by this process (a DTensor's local shard)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return int(local.numel() * local.element_size())
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _checkpoint_exception() -> type:
    try:
        from torch.distributed.checkpoint.api import CheckpointException  # heavy (~1 s): only once a write failed
    except ImportError:  # pragma: no cover
        return Exception
    return CheckpointException


def _agreed(trainer: pl.Trainer, exc: BaseException) -> BaseException:
    """``exc``, which every rank raises with the same line: in a run of several processes rank 0
    reports it, the others only log it, and each exits with status 1
    (:func:`treelit.lightning.faults.exit_code_of`)."""
    if int(getattr(trainer, "world_size", 1)) > 1:
        exc.agreed = True
        hold_launched_ranks(trainer)
    return exc


def _all_ranks(trainer: pl.Trainer, obj: Any) -> List[Any]:
    """``obj`` of every rank, in rank order (a collective every rank joins; ``[obj]`` alone)."""
    if int(getattr(trainer, "world_size", 1)) <= 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class StepMetrics(pl.Callback):
    """Logs the metrics of the first and of the last optimizer step whatever
    ``trainer.log_every_n_steps`` says (so a 3-step run still logs its loss, and every run
    logs where it started and ended), and keeps ``(global_step, loss)`` of this run's first
    and latest step (``first``, ``last``) for the end-of-run summary.

    For RL it also keeps, in ``rl_first`` / ``rl_last``, what an RL user reads of those two
    steps: the mean reward of the step's branches (``reward_mean``, from the data: in a
    multi-process run, this process's branches), and the objective's ``clip_frac``,
    ``approx_kl`` (against the rollout policy), ``kl_ref`` (against the reference) and GSPO's
    ``seq_ratio_mean`` when it logs them."""

    RL_KEYS = ("clip_frac", "approx_kl", "kl_ref", "behavior/kl", "critic/explained_variance", "critic/value_loss",
               "critic/values_mean", "critic/returns_mean", "critic/clip_fraction", "seq_ratio_mean")

    def __init__(self) -> None:
        self.first: Optional[Tuple[int, float]] = None
        self.last: Optional[Tuple[int, float]] = None
        self.rl_first: dict = {}
        self.rl_last: dict = {}
        self._every: Optional[int] = None
        self._first_batch = True

    def _restore(self, trainer: pl.Trainer) -> None:
        if self._every is not None:
            trainer.log_every_n_steps = self._every
            self._every = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_batch = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._restore(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.last = (int(trainer.global_step), float(loss))
            self.first = self.first or self.last
        rl = self._rl_metrics(trainer, batch)
        if rl:
            self.rl_last = {"step": int(trainer.global_step), **rl}
            self.rl_first = self.rl_first or self.rl_last
        last = bool(trainer.max_steps and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps)
        if (self._first_batch or last) and trainer.log_every_n_steps != 1:
            # Lightning decides right after this hook, from this attribute, whether to log
            self._every = trainer.log_every_n_steps
            trainer.log_every_n_steps = 1
        self._first_batch = False

    def _rl_metrics(self, trainer: pl.Trainer, batch: Any) -> dict:
        out = {}
        rewards = [float(r) for mb in getattr(batch, "micro_batches", ())
                   for r in (getattr(mb, "branch_fields", {}) or {}).get("reward") or () if r is not None]
        if rewards:
            out["reward_mean"] = sum(rewards) / len(rewards)
        metrics = trainer.callback_metrics  # this step's values, logged by training_step
        out.update({k: float(metrics[k]) for k in self.RL_KEYS if k in metrics})
        return out if set(out) & set(self.RL_KEYS) else {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore(trainer)


class HFExport(pl.Callback):
    """Write the model as a Hugging Face checkpoint at the end of training (and log it to
    MLflow). A model no Hugging Face format holds (a hybrid mixing Mamba2 with other layers)
    is written in treelit's own format instead (``native`` is then true), and said so.

    A model with LoRA adapters is written as a PEFT adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base, dirpath)`` loads it
    onto the base checkpoint); with ``merge`` the merged full weights go to ``merged_dirpath``
    as well, as a plain checkpoint.

    Each folder is written under a hidden temporary name beside ``dirpath``, fsync'ed and
    renamed into place: an export that fails (a full disk, the file-size limit) leaves an
    earlier export of that folder as it was, its partial files are removed, and the run stops
    with one line naming the folder and the bytes it needed (every rank stops). The MLflow
    copies are made afterwards; one that fails is a warning (the export is on disk)."""

    def __init__(self, dirpath: str, log_to_mlflow: bool = True, merge: bool = False,
                 merged_dirpath: Optional[str] = None) -> None:
        self.dirpath = dirpath
        self.log_to_mlflow = log_to_mlflow
        self.merge = bool(merge)
        self.merged_dirpath = merged_dirpath or str(Path(dirpath).with_name(Path(dirpath).name + "_merged"))
        self.saved: Optional[Path] = None
        self.merged: Optional[Path] = None
        self.native = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sd = full_state_dict(pl_module.model)  # a collective under FSDP2: every rank gathers
        written: list = []
        failure: Optional[Tuple[int, str]] = None
        error: Optional[BaseException] = None
        if trainer.is_global_zero:
            try:
                written = self._export(pl_module.model, sd)
            except Exception as exc:
                error = exc
                failure = (0 if isinstance(exc, WriteFailed) else 1, str(exc))
        failure = trainer.strategy.broadcast(failure, 0)  # every rank stops when rank 0 could not write
        if error is not None:
            raise _agreed(trainer, error) if isinstance(error, WriteFailed) else error
        if failure is not None:
            raise _agreed(trainer, WriteFailed(failure[1]) if failure[0] == 0 else
                          RuntimeError(f"the export failed on rank 0: {failure[1]}"))
        if self.log_to_mlflow and trainer.is_global_zero:
            for lg in trainer.loggers:
                if isinstance(lg, MLFlowLogger):
                    for path, name in written:
                        log_artifact_checked(lg.experiment, lg.run_id, path, name)

    def _export(self, model: Any, sd: Dict[str, torch.Tensor]) -> list:
        written = []
        if lora_of(model) is not None:
            base = getattr(getattr(model, "hf", None), "name_or_path", None) or None
            self.saved = _atomic_dir(self.dirpath, lambda tmp: save_adapter(model, tmp, sd, base_model=base),
                                     "export", _tensor_bytes(adapter_state_dict(model, sd)))
            log.info("wrote the LoRA adapter to %s (PEFT's format: PeftModel.from_pretrained(base, DIR))", self.saved)
            written.append((self.saved, "hf_checkpoint"))
            if self.merge:
                merged = merged_state_dict(model, sd)
                self.merged = self._write_full(model, self.merged_dirpath, merged)
                written.append((self.merged, "hf_checkpoint_merged"))
        else:
            self.saved = self._write_full(model, self.dirpath, sd)
            written.append((self.saved, "hf_checkpoint"))
        return written

    def _write_full(self, model, dirpath, sd) -> Path:
        saved = _atomic_dir(dirpath, lambda tmp: save_hf_checkpoint(model, tmp, state_dict=sd, native_fallback=True),
                            "export", _tensor_bytes(sd))
        self.native = json.loads((saved / "config.json").read_text()).get("model_type") == NATIVE_MODEL_TYPE
        if self.native:
            log.info("wrote the model to %s in treelit's own checkpoint format, not a Hugging Face checkpoint "
                     "(no Hugging Face model holds this layer mix): treelit.load_hf_checkpoint and "
                     "model.hf_checkpoint=DIR read it, transformers does not", saved)
        else:
            log.info("wrote Hugging Face checkpoint to %s", saved)
        return saved


def _atomic_dir(dirpath: Any, write: Any, what: str, needed: Optional[int]) -> Path:
    """``write(tmp)`` into a hidden folder beside ``dirpath``, fsync it, rename it to ``dirpath``
    (an earlier folder of that name is replaced only then). A write that fails for want of
    space removes the folder and raises :class:`WriteFailed` naming ``dirpath`` and ``needed``."""
    final = Path(dirpath)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    remove_path(tmp)
    try:
        write(tmp)
        for dirpath_, _, files in os.walk(tmp):
            for name in files:
                fsync_path(os.path.join(dirpath_, name))
            fsync_path(dirpath_)
    except Exception as exc:
        code = disk_full(exc)
        remove_path(tmp)
        if code is None:
            raise
        kept = (f"the earlier {final} is as it was" if final.exists() else f"nothing was left at {final}")
        raise WriteFailed(f"{what} {final} not written: {FULL[code]}; it needs about {fmt_bytes(needed)}; its "
                          f"partial files were removed and {kept}",
                          code, final, needed) from None
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    remove_path(old)
    fsync_path(final.parent)
    return final


class RewardMargin(pl.Callback):
    """Tracks how the policy's probability of high-reward branches moves against low-reward ones.

    Every ``every_n_steps`` optimizer steps it computes, on the first ``max_trees`` training
    trees, each branch's mean log-prob per target token (tree mode, no gradient, partitioned
    when training is; on every rank, since under FSDP2 every pass is a collective) and logs the
    means over branches with reward above/below ``threshold`` and their difference
    (``reward/logp_high``, ``reward/logp_low``, ``reward/margin``). At the end it saves a PNG
    plot to ``plot_path`` and logs it to MLflow.
    """

    def __init__(self, plot_path: str, every_n_steps: int = 5, max_trees: int = 16, threshold: float = 0.5) -> None:
        self.plot_path = plot_path
        self.every = int(every_n_steps)
        self.max_trees = int(max_trees)
        self.threshold = float(threshold)
        self.history: list = []

    def _measure(self, trainer, pl_module) -> None:
        rows = self._rows(trainer)
        if not rows:
            return
        high, low = [], []
        was_training = pl_module.model.training
        pl_module.model.eval()
        with torch.no_grad():
            for row in rows:
                rewards = row.branch_fields.get("reward")
                if rewards is None:
                    continue
                batch = row.to(pl_module.device)
                if getattr(pl_module, "partition", "none") != "none":  # as large as training's trees: partitioned
                    x = torch.nan_to_num(policy_logprobs(pl_module.model, batch, budget_tokens=pl_module.budget_tokens,
                                                         attention=pl_module.attention, comm=pl_module._comm()))
                else:
                    sel, logp, _ = tree_token_logprobs(pl_module.model, batch, pl_module.attention)
                    x = torch.zeros(batch.num_tokens, dtype=torch.float64, device=batch.device).index_put((sel,), logp.double())
                sums = branch_target_sums(batch, x).cpu().numpy()
                n = np.array([m[1:].sum() for m in np.split(batch.branch_mask.cpu().numpy(), batch.branch_ptr.cpu().numpy()[1:-1])])
                for s, k, r in zip(sums, n, rewards):
                    if k and r is not None:
                        (high if r > self.threshold else low).append(s / k)
        pl_module.model.train(was_training)
        if not high or not low:
            return
        row = {"step": trainer.global_step, "logp_high": float(np.mean(high)), "logp_low": float(np.mean(low))}
        row["margin"] = row["logp_high"] - row["logp_low"]
        self.history.append(row)
        for k, v in row.items():
            if k != "step":
                trainer.callback_metrics[f"reward/{k}"] = torch.tensor(v)
        for lg in trainer.loggers:
            lg.log_metrics({f"reward/{k}": v for k, v in row.items() if k != "step"}, step=trainer.global_step)

    def _rows(self, trainer):
        """The rows measured every time: the data module's first trees when it holds them in
        memory; with a streamed source, the rows of the first step batch (kept on the CPU)."""
        trees = getattr(trainer.datamodule, "trees", None)
        if trees:
            return [t.tree.to_batch() for t in trees[: self.max_trees]]
        return getattr(self, "_held", None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if getattr(self, "_held", None) is None and not getattr(trainer.datamodule, "trees", None):
            self._held = [mb.to("cpu") for mb in batch.micro_batches if mb.num_targets][: self.max_trees]
            self._measure(trainer, pl_module)  # the first measurement, before the first update

    def on_train_start(self, trainer, pl_module) -> None:
        self._measure(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every and trainer.global_step % self.every == 0:
            self._measure(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.history:
            return
        if self.history[-1]["step"] != trainer.global_step:
            self._measure(trainer, pl_module)  # every rank: under FSDP2 the model's passes are collectives
        if not trainer.is_global_zero:
            return
        import matplotlib  # heavy (~1 s CPU): only when the plot is drawn

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # heavy: as above, after choosing the Agg backend

        steps = [h["step"] for h in self.history]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot(steps, [h["logp_high"] for h in self.history], label="reward 1 branches")
        ax.plot(steps, [h["logp_low"] for h in self.history], label="reward 0 branches")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean log-prob per target token")
        ax2 = ax.twinx()
        ax2.plot(steps, [h["margin"] for h in self.history], "k--", label="margin")
        ax2.set_ylabel("margin (high - low)")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        ax.set_title("policy probability of high- vs low-reward branches")
        fig.tight_layout()
        Path(self.plot_path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.plot_path)
        plt.close(fig)
        log.info("saved %s", self.plot_path)
        for lg in trainer.loggers:
            if isinstance(lg, MLFlowLogger):
                lg.experiment.log_artifact(lg.run_id, self.plot_path)
