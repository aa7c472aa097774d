"""What ``treelit-train`` prints: one line per message, user errors without tracebacks.

Hydra configures the root logger (``conf/hydra/job_logging/treelit.yaml``): this
console handler, and the full-format ``train.log`` file in the output directory.
Libraries install handlers of their own (Lightning's ``lightning`` logger prints
``INFO: ...`` to stderr *and* propagates to the root; MLflow and alembic print with
their own format), so every line would appear twice or in three styles:
:func:`tidy_library_logging` removes those handlers and lets the records reach the root
once. The console handler writes through ``tqdm.write`` so a log line never lands in
the middle of the progress bar, drops a few library messages that say nothing about
the run (Lightning's device report and distributed start-up banner, service tips; the
file log keeps them), and sends warnings and errors to stderr. transformers draws its own
progress bars when it loads or saves a model: :func:`quiet_transformers_bars` turns those
off for ``treelit-train``.

A user error (bad data, bad config, a missing or corrupt checkpoint, an unwritable or
full output directory) is reported as ``error: <message>`` with no Python traceback;
``HYDRA_FULL_ERROR=1`` shows the traceback. A mistake Hydra finds while it composes the
config from the command line (``model=qwen3_tinyy``, ``trainer.max_step=5``) is reported
the same way, with the closest known names (:func:`hydra_error_message`), instead of
Hydra's multi-line dump.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import re
import sys
import warnings
from typing import List, Optional, Sequence

from tqdm import tqdm

from treelit.cli.config import process_rank, rank_label  # the rank a line is printed for

__all__ = ["ConsoleFormatter", "ConsoleHandler", "SetupError", "hydra_error_message", "quiet_transformers_bars",
           "tidy_library_logging", "user_error_message"]

# substrings of library messages the console leaves out (train.log keeps them)
NOISE = (
    "Tip: For seamless cloud",  # Lightning advertising its services (logging, model registry)
    "GPU available:",  # Lightning's device report: trainer.accelerator says what is used
    "TPU available:",
    "HPU available:",
    "CUDA_VISIBLE_DEVICES: [",  # Lightning's per-rank device line
    "Initializing distributed:",  # Lightning's DDP banner (rank, members, backend)
    "All distributed processes registered",
    "`Trainer.fit` stopped: `max_steps=",  # the end-of-run summary says it
    "not found. Creating it.",  # a new MLflow experiment: nothing to act on
    "Restoring states from the checkpoint path at",  # resume_from: the summary's "resumed" row says it
    "Restored all states from the checkpoint",
)

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "mlflow", "alembic", "torchmetrics")
QUIET_LOGGERS = ("mlflow", "alembic")  # INFO from these is database plumbing
# torchao warns on import when triton is absent (a plain CPU install): nothing treelit runs needs it.
# Set before torchtune imports torchao, so a clean run's console stays clean.
SILENT_LOGGERS = ("torchao.kernel.intmm",)
for _name in SILENT_LOGGERS:
    logging.getLogger(_name).setLevel(logging.ERROR)


class ConsoleFormatter(logging.Formatter):
    """``message`` for INFO and below, ``warning: message`` / ``error: message`` above."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        if record.levelno >= logging.ERROR:
            return f"error: {msg}"
        if record.levelno >= logging.WARNING:
            return f"warning: {msg}"
        return msg


class ConsoleHandler(logging.Handler):
    """INFO to stdout, warnings and errors to stderr, through ``tqdm.write`` (the progress
    bar is cleared and redrawn around the line). In a multi-process run only rank 0 prints
    INFO lines; other ranks print their warnings and errors, prefixed with their rank. A record
    with ``file_only`` set (``log.info(..., extra={"file_only": True})``) is for ``train.log`` only."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            rank = process_rank()
            if rank and record.levelno < logging.WARNING or getattr(record, "file_only", False):
                return  # (file_only: a line for train.log, e.g. a step line while the bar shows the step)
            msg = self.format(record)
            if any(n in msg for n in NOISE):
                return
            if rank:
                label = rank_label()
                msg = f"[{'rank ' + str(rank) if label == f'rank{rank}' else label}] {msg}"
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
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
    # FSDP2 warns when a wrapped forward returns a view (treelit's passes return slices of hidden states and
    # log-probs), in case the caller writes into it in place; treelit never does, and the FSDP2 runs are
    # checked equal to one process in float64 (tests/distributed)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class SetupError(Exception):
    """A ``ValueError``/``KeyError`` raised while the run is built from its config (before
    training): an invalid option value, reported like other user errors."""


def _user_error_types() -> tuple:
    from hydra.errors import InstantiationException  # cli: stats and list pay no Hydra
    from omegaconf.errors import OmegaConfBaseException  # as above

    from treelit.cli.config import ConfigError
    from treelit.models.errors import CheckpointError
    from treelit.registry import RegistryError
    from treelit.partition.plan import BudgetError
    from treelit.tree.token_tree import TreeInputError

    types = [ConfigError, CheckpointError, RegistryError, TreeInputError, SetupError, OSError, BudgetError,
             InstantiationException, OmegaConfBaseException]
    mlflow_errors = sys.modules.get("mlflow.exceptions")  # not imported: no error of it to report (and
    if mlflow_errors is not None:                       # importing it only to check costs seconds)
        types.append(mlflow_errors.MlflowException)
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
    if name == "BudgetError":  # a fixed budget below a branch met in training (a streamed tree)
        return f"partition.budget_tokens: {exc}"
    if name == "InstantiationException":
        return _instantiation_message(exc)
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if isinstance(exc, _omegaconf_error()):  # its detail lines (full_key, object_type) repeat the key
        lines = lines[:1]
    return "; ".join(lines) or name  # one line, always


def _omegaconf_error() -> type:
    from omegaconf.errors import OmegaConfBaseException  # cli: stats and list pay no Hydra

    return OmegaConfBaseException


def _instantiation_message(exc: BaseException) -> str:
    """Hydra's report of a failed ``_target_`` call, on one line; an unexpected keyword (a key
    added with ``+group.key=...`` that the target does not take) names the closest parameters."""
    text = str(exc)
    cause = exc.__cause__
    target = re.search(r"target '([\w.]+)'", text)
    unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(cause)) if isinstance(cause, TypeError) else None
    full_key = re.search(r"full_key: ([\w.]+)", text)
    if target and unexpected:
        key = unexpected.group(1)
        where = f"{full_key.group(1)}.{key}" if full_key else key
        try:
            from hydra.utils import get_object  # cli: stats and list pay no Hydra

            params = [n for n in inspect.signature(get_object(target.group(1))).parameters if n not in ("self", "kwargs")]
        except Exception:  # pragma: no cover - the target cannot be inspected: Hydra's words
            params = []
        return f"{where}: {target.group(1)} takes no option {key!r}" + (
            f"; did you mean {' or '.join(_closest(key, params))}?" if _closest(key, params) else "")
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def full_error_requested() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _closest(word: str, names: Sequence[str], n: int = 3) -> List[str]:
    return difflib.get_close_matches(word, [str(x) for x in names], n=n, cutoff=0.6)


def _choices(word: str, names: Sequence[str], what: str) -> str:
    """``did you mean X?`` when some names are close to ``word``, else every name."""
    close = _closest(word, names)
    if close:
        return f"did you mean {' or '.join(close)}?"
    return f"{what}: {', '.join(sorted(str(x) for x in names)) or 'none'}"


def hydra_error_message(exc: BaseException, overrides: Optional[Sequence[str]] = None) -> Optional[str]:
    """One line for an error Hydra raises while it composes the config from the command line
    (an unknown option of a config group, an unknown key, an override it cannot parse), with
    the closest known names; ``None`` for anything else. Hydra's own report is a multi-line
    dump (every option of the group, the config search path). ``overrides``: the command
    line's (default ``sys.argv[1:]``), to name the one Hydra cannot parse."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException  # cli: stats and list pay no Hydra

    if not isinstance(exc, HydraException):
        return None
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        options = list(exc.options or [])
        if not options:  # older Hydra: the options are listed in the message, one per tab-indented line
            options = [line.strip() for line in str(exc).splitlines() if line.startswith("\t")
                       and "provider=" not in line]
        if not name:
            return f"{group}= needs an option: {', '.join(options)}"
        return f"{group}={name}: no such option (no config {group}/{name}); " \
               f"{_choices(name, options, f'options of {group!r}')}"
    cause = exc.__cause__
    key = getattr(cause, "key", None)
    full_key = getattr(cause, "full_key", None)
    parent = getattr(cause, "parent_node", None)
    if key is not None and full_key and hasattr(parent, "keys") and str(exc).startswith("Could not override"):
        where = full_key.rpartition(".")[0]
        keys = [str(k) for k in parent.keys()]
        if where:
            close = [f"{where}.{k}" for k in _closest(str(key), keys)]
        else:
            close = _closest(str(key), keys)
        if close:
            return f"{full_key}: no such option; did you mean {' or '.join(close)}?"
        return (f"{full_key}: no such option; the options {f'under {where} ' if where else ''}are "
                f"{', '.join(sorted(keys))} (add a new key with +{full_key}=VALUE)")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if isinstance(exc, OverrideParseException):
        bad = _unparsable(sys.argv[1:] if overrides is None else overrides)
        return f"cannot parse {bad!r}: " + "; ".join(lines) if bad else "; ".join(lines)
    return "; ".join(lines) or type(exc).__name__


def _unparsable(overrides: Sequence[str]) -> Optional[str]:
    """The first command-line override Hydra cannot parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # cli: stats and list pay no Hydra

    parser = OverridesParser.create()
    for arg in overrides:
        if arg.startswith("-"):
            continue
        try:
            parser.parse_overrides([arg])
        except Exception:
            return arg
    return None


def quiet_transformers_bars() -> None:
    """Turn off transformers' own progress bars in this process ("Loading weights" when a
    checkpoint is read, "Writing model shards" when the model is exported): noise in a log,
    and the run's own lines say what happens. Downloads from the Hugging Face Hub keep their
    bars. (Only called when the run uses transformers, which is then imported anyway.)"""
    from transformers.utils import logging as hf_logging  # heavy (~1.5 s CPU): runs using transformers only

    if hasattr(hf_logging, "set_tqdm_hook"):  # transformers 5: only transformers' own bars
        hf_logging.set_tqdm_hook(lambda factory, args, kwargs: hf_logging.EmptyTqdm(*args, **kwargs))
    else:  # pragma: no cover - older transformers: every bar it draws, Hub downloads included
        hf_logging.disable_progress_bar()
