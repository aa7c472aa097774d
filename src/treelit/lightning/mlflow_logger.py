"""Lightning's MLflow logger, safe for concurrent runs and honest about how a run ended.

:class:`TreeMLFlowLogger` is Lightning's ``MLFlowLogger`` plus the run lifecycle a
training framework owes its users:

* opening the store, getting or creating the experiment and creating (or reopening)
  the run happen under the store's file lock (:mod:`treelit.utils.mlflow_store`), so
  any number of runs may start at once on one fresh ``mlflow.db``; a fresh store is built
  under a temporary name and renamed, so a kill during its creation leaves none, not half
  of one;
* every run carries liveness tags, and opening the store marks ``KILLED`` the runs of
  this machine whose process died without closing them;
* ``run_id=`` (set by ``treelit-train`` from a ``resume_from`` checkpoint) reopens that
  run: its status goes back to ``RUNNING``, metrics continue at the checkpoint's step -
  a metric is logged only past the last step the run's history holds for it, so each step
  appears once - and parameters already logged keep their first values;
* a run stopped by Ctrl+C or SIGTERM ends ``KILLED``, one stopped by an error
  ``FAILED`` with the error in the tag ``treelit.end``;
* artifacts of a local sqlite store go to ``mlruns/`` beside the database;
  :func:`log_artifact_checked` copies a file or folder there under a temporary name and
  renames it into place, so a copy that fails (a full disk) leaves no partial artifact and
  an earlier artifact of that name as it was (a warning names it and the bytes it needed);
* credentials in the store's URI are never written: log lines, the ``treelit.end`` tag and
  checkpoints carry it redacted (:mod:`treelit.utils.redact`), and MLflow's own "View run
  at <url>" line, which would show them, is switched off for such a store.

:class:`MLflowRunInCheckpoint` writes the run's id and store into every Lightning
checkpoint, which is how ``resume_from`` finds the run to continue.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, Optional
from urllib.parse import unquote, urlparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from treelit.utils.mlflow_store import (
    DEFAULT_TRACKING_URI,
    TAG_END,
    default_artifact_location,
    ensure_store,
    mark_dead_runs_killed,
    process_tags,
    resolve_tracking_uri,
    store_lock,
)
from treelit.utils.integrity import FULL, disk_full, fmt_bytes, remove_path
from treelit.utils.redact import redact_text

__all__ = ["TreeMLFlowLogger", "MLflowRunInCheckpoint", "CHECKPOINT_KEY", "log_artifact_checked"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "treelit_mlflow"


def _interrupted(exc: Optional[BaseException]) -> bool:
    # ``preempted``: a preemption signal before training began (treelit.cli.startup_signals)
    return isinstance(exc, (KeyboardInterrupt, SIGTERMException)) or bool(getattr(exc, "preempted", False))


class TreeMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` with a locked store, liveness tags and run resumption.

    Args:
        experiment_name: the MLflow experiment (created if missing).
        run_name: the run's display name.
        tracking_uri: the store; default ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``.
        tags: extra run tags.
        artifact_location: where a *new* experiment keeps artifacts; default ``mlruns/``
            beside a sqlite database.
        run_id: an existing run to reopen and continue (resumed training).
        **kwargs: passed to ``MLFlowLogger`` (``log_model``, ``prefix``, ``synchronous``).
    """

    def __init__(
        self,
        experiment_name: str = "treelit",
        run_name: Optional[str] = None,
        tracking_uri: Optional[str] = None,
        tags: Optional[Dict[str, Any]] = None,
        artifact_location: Optional[str] = None,
        run_id: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        uri = resolve_tracking_uri(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)
        if redact_text(uri) != uri:  # MLflow prints "View run at <server URL>" with its credentials: not that
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        if artifact_location is None:
            artifact_location = default_artifact_location(uri)
        self.reopened = run_id is not None
        with store_lock(uri):
            ensure_store(uri)  # built under another name and renamed: a kill leaves no half-made store
            super().__init__(
                experiment_name=experiment_name,
                run_name=run_name,
                tracking_uri=uri,
                tags={**dict(tags or {}), **process_tags()},
                artifact_location=artifact_location,
                run_id=run_id,
                **kwargs,
            )
            # creating the client opens the store; make sure a fresh database is created
            # and migrated here, under the lock, whatever the client does lazily
            self._mlflow_client.search_experiments(max_results=1)

    @property
    def tracking_uri(self) -> str:
        return self._tracking_uri

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._initialized:
            return self._mlflow_client
        with store_lock(self._tracking_uri):
            if self.reopened and not self._reopenable():
                log.warning("MLflow: the checkpoint's run %s is not in %s (or was deleted): starting a new run",
                            self._run_id, redact_text(self._tracking_uri))
                self._run_id, self.reopened = None, False
            client = MLFlowLogger.experiment.fget(self)  # get/create experiment, create run
            killed = mark_dead_runs_killed(client, self._experiment_id, keep=self._run_id)
            if killed:
                log.info("MLflow: marked %d run(s) of dead processes KILLED: %s", len(killed), ", ".join(killed))
            if self.reopened:
                self._logged_before = _last_steps(client, self._run_id)
                client.update_run(self._run_id, status="RUNNING")
                for k, v in process_tags().items():
                    client.set_tag(self._run_id, k, v)
                client.set_tag(self._run_id, TAG_END, "")
        return client

    @rank_zero_only
    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        """A reopened run logs a metric only past the last step its history holds for it:
        the steps a stopped run logged after its last checkpoint, which the resumed run redoes,
        keep the values logged first (each step once). Redone steps match those values only
        where training is deterministic (on CPU, or with deterministic settings); one info line
        says how many steps kept the earlier run's values."""
        before = getattr(self, "_logged_before", None) if self.reopened else None
        if before is None and self.reopened:
            self.experiment  # noqa: B018  (opens the run, reads its history)
            before = getattr(self, "_logged_before", None)
        if before:
            kept = {k: v for k, v in metrics.items() if (step or 0) > before.get(self._prefixed(k), -1)}
            if len(kept) < len(metrics):
                self._kept_steps = getattr(self, "_kept_steps", set()) | {step or 0}
            metrics = kept
            if not metrics:
                return
            self._say_kept_steps()
        super().log_metrics(metrics, step)

    def _say_kept_steps(self) -> None:
        kept = getattr(self, "_kept_steps", None)
        if kept and not getattr(self, "_said_kept", False):
            self._said_kept = True
            log.info("MLflow: resumed run kept the earlier run's values for %d redone step(s) (%d-%d): each step is "
                     "logged once; the values this run computed for them are not logged", len(kept), min(kept),
                     max(kept))

    def _prefixed(self, key: str) -> str:
        return f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key

    def _reopenable(self) -> bool:
        from mlflow.exceptions import MlflowException  # heavy (~1 s CPU): imported when a store is opened

        try:
            return self._mlflow_client.get_run(self._run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """Log ``params``; a reopened run keeps the values logged first (MLflow refuses to
        change a parameter) and logs only the new keys."""
        if not self.reopened or not isinstance(params, dict):
            return super().log_hyperparams(params)
        old = self.experiment.get_run(self.run_id).data.params
        new = {k: v for k, v in params.items() if k not in old}
        changed = sorted(k for k, v in params.items() if k in old and old[k] != str(v)[:250])
        if changed:
            log.info("MLflow: resumed run keeps the first values of %s (this run's config.yaml has the new ones)",
                     ", ".join(changed))
        if new:
            super().log_hyperparams(new)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self._initialized:
            return
        self._say_kept_steps()
        exc = sys.exc_info()[1]  # Lightning finalizes inside its exception handler
        if status == "failed" and exc is not None:
            if _interrupted(exc):
                status = "KILLED"
                reason = f"interrupted ({type(exc).__name__})"
            else:
                reason = f"failed: {type(exc).__name__}: {exc}"
            self.experiment.set_tag(self.run_id, TAG_END, redact_text(reason)[:4000])
        super().finalize(status)


def _last_steps(client: Any, run_id: str) -> Dict[str, int]:
    """The last step each metric of run ``run_id`` was logged at."""
    out: Dict[str, int] = {}
    for key in client.get_run(run_id).data.metrics:
        history = client.get_metric_history(run_id, key)
        if history:
            out[key] = max(int(m.step) for m in history)
    return out


class MLflowRunInCheckpoint(pl.Callback):
    """Stores the MLflow run (id, store, experiment) in every Lightning checkpoint under
    ``checkpoint["treelit_mlflow"]``, so resuming from it continues the same run. The store's
    URI is stored with its credentials redacted (:mod:`treelit.utils.redact`): a checkpoint
    handed to someone else carries no password."""

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Dict[str, Any]) -> None:
        for lg in trainer.loggers:
            if isinstance(lg, MLFlowLogger) and lg.run_id:
                checkpoint[CHECKPOINT_KEY] = {
                    "run_id": lg.run_id,
                    "tracking_uri": redact_text(resolve_tracking_uri(lg._tracking_uri)),  # no credentials
                    "experiment_id": lg.experiment_id,
                }
                return


def _local_artifact_root(client: Any, run_id: str) -> Optional[Path]:
    """The run's artifact folder when it is on this machine (``file://`` or a plain path)."""
    uri = str(client.get_run(run_id).info.artifact_uri or "")
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and uri:
        return Path(uri)
    return None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def log_artifact_checked(client: Any, run_id: str, local: Any, artifact_path: Optional[str] = None) -> bool:
    """MLflow's ``log_artifact`` (a file) or ``log_artifacts`` (a folder, ``artifact_path`` given)
    that never leaves a partial copy: into a local artifact store the copy is made under a
    hidden name and renamed into place. A copy that fails for want of space is a warning naming
    the artifact and the bytes it needed (the files stay in the output folder); False then.
    Other errors are raised."""
    local = Path(local)
    needed = _size(local)
    root = _local_artifact_root(client, run_id)
    if root is None or (local.is_dir() and not artifact_path):  # a remote store: MLflow uploads it
        try:
            (client.log_artifacts if local.is_dir() else client.log_artifact)(run_id, str(local), artifact_path)
        except Exception as exc:
            code = disk_full(exc)
            if code is None:
                raise
            log.warning("MLflow artifact %s of run %s not logged: %s; it needs %s (%s stays where it is)",
                        f"{artifact_path}/{local.name}" if artifact_path else local.name, run_id, FULL[code],
                        fmt_bytes(needed), local)
            return False
        return True
    folder = root / artifact_path if artifact_path else root
    dest = folder if local.is_dir() else folder / local.name
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_path(tmp)
        if local.is_dir():
            shutil.copytree(local, tmp)
        else:
            shutil.copy2(local, tmp)
    except OSError as exc:
        remove_path(tmp)
        code = disk_full(exc)
        if code is None:
            raise
        kept = f"; the earlier {dest.name} is as it was" if dest.exists() else ""
        log.warning("MLflow artifact %s not copied: %s; it needs %s; the partial copy was removed%s (%s stays "
                    "where it is)", dest, FULL[code], fmt_bytes(needed), kept, local)
        return False
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    remove_path(old)
    return True
