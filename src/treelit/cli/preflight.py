"""Checks that fail fast, before anything is trained: can the run write its outputs?

A run that trains for an hour and then cannot write its checkpoint has wasted the
hour. Two checks run before training: the output directory must be creatable and
writable (a probe file is written, synced and removed - this also catches a full or
read-only filesystem), and its filesystem must have room for at least the first
checkpoint and the final export (estimated from the model's parameter bytes; a run
whose later checkpoints may not fit gets a warning with the numbers). Under
``treelit-train`` the first check also runs as a Hydra callback, before Hydra itself
creates the directory, so the user sees one clear line instead of a traceback.

The output directory belongs to one run: :func:`lock_output_dir` takes its lock
(:mod:`treelit.utils.dir_lock`) before anything is written there, so a second run given
the same ``output_dir`` while the first one runs is refused with one line naming the
holder. Under ``treelit-train`` the Hydra callback takes it before Hydra writes its
``.hydra/`` files and ``train.log``; it then redacts credentials from those files
(:mod:`treelit.utils.redact`) before the run starts.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import yaml
from hydra.experimental.callback import Callback

from treelit.cli.config import ConfigError, check_input_files
from treelit.cli.console import process_rank
from treelit.utils.dir_lock import DirLock, DirLocked
from treelit.utils.redact import redact_config, redact_text

__all__ = ["check_writable", "check_space", "free_bytes", "lock_output_dir", "OutputDirCheck"]

log = logging.getLogger(__name__)

PROBE_BYTES = 64 * 1024


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).free)


def check_writable(out: Path) -> None:
    """Create ``out`` and write, sync and remove a probe file there; :class:`ConfigError`
    (naming ``output_dir``) if any of it fails."""
    out = Path(out)
    probe = out / f".treelit-write-probe-{os.getpid()}"
    there = next((p for p in (out, *out.parents) if p.exists()), None)
    if there is not None and not there.is_dir():
        what = "" if there == out else f": {str(there)!r}"
        raise ConfigError(f"output_dir {str(out)!r}{what} is a file, not a directory; choose a directory with "
                          "output_dir=DIR")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) not in (str(probe), str(out)) else ""
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise ConfigError(
            f"output_dir {str(out)!r}: cannot write there: {reason}{where}; "
            + ("free some space or choose another directory" if full else "choose a writable directory")
            + " with output_dir=DIR"
        ) from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def check_space(out: Path, model: Any, checkpoint: Optional[Any], max_steps: int, export: bool, tracked: bool) -> None:
    """Fail if ``out``'s filesystem cannot hold the first checkpoint and the export; warn if
    every checkpoint the run keeps may not fit.

    Estimate: a Lightning checkpoint holds the weights and about two optimizer moments per
    weight (3x the parameter bytes); the export 1x; an MLflow store on the same machine gets
    copies of the last checkpoint and the export.
    """
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ckpt_bytes = 3 * param_bytes
    n_ckpt = 0
    if checkpoint is not None:
        every = getattr(checkpoint, "_every_n_train_steps", 0) or 0
        top_k = getattr(checkpoint, "save_top_k", 1)
        periodic = max_steps // every if every else 0
        n_ckpt = (periodic if top_k < 0 else min(periodic, max(top_k, 0))) + (1 if checkpoint.save_last else 0)
        n_ckpt = max(n_ckpt, 1)
    first = (ckpt_bytes if n_ckpt else 0) + (param_bytes if export else 0)
    total = n_ckpt * ckpt_bytes + (param_bytes if export else 0)
    if tracked:
        total += (ckpt_bytes if n_ckpt else 0) + (param_bytes if export else 0)
    free = free_bytes(out)
    if free < first:
        raise ConfigError(
            f"output_dir {str(out)!r}: {_fmt(free)} free on its filesystem, but the first checkpoint and "
            f"the model export need about {_fmt(first)} (parameters: {_fmt(param_bytes)}); "
            "free some space or choose another directory with output_dir=DIR"
        )
    if free < total:
        log.warning("output_dir %s: %s free, this run may write about %s (%d checkpoints of ~%s%s); "
                    "later checkpoints may fail", out, _fmt(free), _fmt(total), n_ckpt, _fmt(ckpt_bytes),
                    ", the export and MLflow copies" if tracked else " and the export")


_UNLOCKABLE: set = set()  # output directories on filesystems without locks (warned about once)


def lock_output_dir(out: Path) -> Optional[DirLock]:
    """Take (or, in this process, take again) the lock of ``out``; :class:`ConfigError`
    naming the holder (pid, start time) if another live process holds it. ``None`` in a
    process started by a multi-process launcher (rank > 0): the launching process holds it.
    Release with ``.release()``."""
    if process_rank() != 0:
        return None
    try:
        return DirLock.of(Path(out)).acquire()
    except DirLocked as exc:
        raise ConfigError(f"output_dir {str(out)!r} is {exc}: wait for that run to end, or choose another "
                          "directory with output_dir=DIR") from None
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):  # a filesystem without locks
            if str(out) not in _UNLOCKABLE:
                _UNLOCKABLE.add(str(out))
                print(f"warning: output_dir {str(out)!r}: its filesystem cannot lock files ({exc.strerror}): "
                      "nothing stops another run from using this folder at the same time", file=sys.stderr)
            return None
        raise ConfigError(f"output_dir {str(out)!r}: cannot lock it: {exc.strerror or exc}; "
                          "choose another directory with output_dir=DIR") from None


def redact_hydra_files(output_dir: Path, subdir: Optional[str]) -> None:
    """Rewrite Hydra's ``<output_dir>/<subdir>/{config,hydra,overrides}.yaml`` with
    credentials redacted (they hold the command-line overrides as typed)."""
    if subdir is None:
        return
    for path in (Path(output_dir) / subdir).glob("*.yaml"):
        try:
            text = path.read_text()
            clean = yaml.safe_dump(redact_config(yaml.safe_load(text)), sort_keys=False, allow_unicode=True)
        except (OSError, yaml.YAMLError):  # not Hydra's: redact as text
            clean = redact_text(text)
        if clean != text:
            path.write_text(clean)


class OutputDirCheck(Callback):
    """Hydra callback: :func:`check_writable` and :func:`lock_output_dir` on
    ``hydra.run.dir`` before Hydra creates it and writes its own files there (a failure
    prints ``error: ...`` and exits with status 1, the traceback before it only with
    ``HYDRA_FULL_ERROR=1``: Hydra would turn an exception into a warning and go on); credentials redacted from Hydra's files once written; the
    lock released when the run ends."""

    def __init__(self) -> None:
        self.lock: Optional[DirLock] = None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        try:
            check_input_files(config)  # first: resolving the run folder's name imports torch
            out = Path(str(config.hydra.run.dir))
            check_writable(out)
            self.lock = lock_output_dir(out)
        except ConfigError as exc:  # Hydra turns a callback's exception into a warning and goes on: exit here
            # the user's HYDRA_FULL_ERROR (treelit-train sets it to 1 while Hydra starts, keeping the user's)
            if os.environ.get("HYDRA_FULL_ERROR_USER", os.environ.get("HYDRA_FULL_ERROR")) == "1":
                traceback.print_exc()
            print(f"error: {redact_text(str(exc))}", file=sys.stderr)
            sys.exit(1)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        redact_hydra_files(Path(str(config.hydra.runtime.output_dir)), config.hydra.output_subdir)

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
