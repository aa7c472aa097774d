"""What ``treelit-train`` prints: one line per message, user errors without tracebacks.

Hydra configures the root logger (``conf/hydra/job_logging/treelit.yaml``): this
console handler, and the full-format ``train.log`` file in the output directory.
Libraries install handlers of their own (Lightning's ``lightning`` logger prints
``INFO: ...`` to stderr *and* propagates to the root; MLflow and alembic print with
their own format), so every line would appear twice or in three styles:
:func:`tidy_library_logging` removes those handlers and lets the records reach the root
once. The console handler writes through ``tqdm.write`` so a log line never lands in
the middle of the progress bar, drops a few library messages that say nothing about
the run (the file log keeps them), and sends warnings and errors to stderr.

A user error (bad data, bad config, a missing or corrupt checkpoint, an unwritable or
full output directory) is reported as ``error: <message>`` with no Python traceback;
``HYDRA_FULL_ERROR=1`` shows the traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Optional

__all__ = ["ConsoleFormatter", "ConsoleHandler", "SetupError", "tidy_library_logging", "user_error_message"]

# substrings of library messages the console leaves out (train.log keeps them)
NOISE = (
    "Tip: For seamless cloud",  # Lightning advertising its services (logging, model registry)
    "TPU available:",
    "HPU available:",
    "`Trainer.fit` stopped: `max_steps=",  # the end-of-run summary says it
    "not found. Creating it.",  # a new MLflow experiment: nothing to act on
)

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "mlflow", "alembic", "torchmetrics")
QUIET_LOGGERS = ("mlflow", "alembic")  # INFO from these is database plumbing


class ConsoleFormatter(logging.Formatter):
    """``message`` for INFO and below, ``warning: message`` / ``error: message`` above."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        if record.levelno >= logging.ERROR:
            return f"error: {msg}"
        if record.levelno >= logging.WARNING:
            return f"warning: {msg}"
        return msg


def process_rank() -> int:
    """This process's rank in a multi-process run (0 when alone), from the launcher's environment."""
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


class ConsoleHandler(logging.Handler):
    """INFO to stdout, warnings and errors to stderr, through ``tqdm.write`` (the progress
    bar is cleared and redrawn around the line). In a multi-process run only rank 0 prints
    INFO lines; other ranks print their warnings and errors, prefixed with their rank."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            rank = process_rank()
            if rank and record.levelno < logging.WARNING:
                return
            msg = self.format(record)
            if any(n in msg for n in NOISE):
                return
            if rank:
                msg = f"[rank {rank}] {msg}"
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            from tqdm import tqdm

            tqdm.write(msg, file=stream)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def tidy_library_logging() -> None:
    """Route the libraries' loggers through the root's handlers only (idempotent; call after
    importing Lightning and MLflow, which install their handlers on import)."""
    for name in LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                lg.removeHandler(h)
        lg.propagate = True
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # a deprecation inside Lightning's own pytree helper, not actionable for a user
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


class SetupError(Exception):
    """A ``ValueError``/``KeyError`` raised while the run is built from its config (before
    training): an invalid option value, reported like other user errors."""


def _user_error_types() -> tuple:
    from hydra.errors import InstantiationException
    from omegaconf.errors import OmegaConfBaseException

    from treelit.cli.config import ConfigError
    from treelit.models.hf import CheckpointError
    from treelit.registry import RegistryError
    from treelit.tree.token_tree import TreeInputError

    types = [ConfigError, CheckpointError, RegistryError, TreeInputError, SetupError, OSError,
             InstantiationException, OmegaConfBaseException]
    try:
        from mlflow.exceptions import MlflowException

        types.append(MlflowException)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def user_error_message(exc: BaseException) -> Optional[str]:
    """The one-line report of a user error, or ``None`` for anything else (a bug: keep the
    traceback)."""
    if not isinstance(exc, _user_error_types()):
        return None
    if isinstance(exc, OSError) and exc.strerror:
        return (f"{exc.filename}: " if exc.filename is not None else "") + exc.strerror
    name = type(exc).__name__
    if name == "MlflowException":
        return f"MLflow: {exc}"
    return str(exc).strip() or name


def full_error_requested() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"
