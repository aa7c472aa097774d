"""A step's metrics reach the loggers before the checkpoint that contains the step is written.

Lightning logs a step's metrics after every ``on_train_batch_end`` hook has run, and the
checkpoint callback writes in that hook: a run stopped between the two (a preemption, which
stops right after the checkpoint; a kill) had step N in its checkpoint and not in MLflow, and
the resumed run starts at N+1 - a gap. :func:`log_step_now`, called by the checkpoint and
preemption callbacks before they write, logs what the step has logged so far, as Lightning
would (the same values, the same ``log_every_n_steps`` rule); Lightning's own call at the end
of the step then logs only the keys logged after that point (a later callback's), so every
metric reaches the loggers once. Steps that a killed run logged after its last checkpoint are
not logged twice either: the resumed run's MLflow logger keeps the first values
(:class:`~treelit.lightning.mlflow_logger.TreeMLFlowLogger`).
"""

from __future__ import annotations

from typing import Any, Optional, Set, Tuple

import lightning.pytorch as pl

__all__ = ["log_step_now"]

_ATTR = "_treelit_logged_early"


def _install(trainer: pl.Trainer) -> Any:
    connector = trainer._logger_connector
    if hasattr(connector, _ATTR):
        return connector
    original = connector.update_train_step_metrics
    setattr(connector, _ATTR, None)

    def update_train_step_metrics() -> None:
        early: Optional[Tuple[int, Set[str]]] = getattr(connector, _ATTR)
        setattr(connector, _ATTR, None)
        if early is None or early[0] != trainer.global_step:
            return original()
        rest = {k: v for k, v in connector.metrics["log"].items() if k not in early[1] or k == "step"}
        if set(rest) - {"step"}:
            connector.log_metrics(rest)

    connector.update_train_step_metrics = update_train_step_metrics
    return connector


def log_step_now(trainer: pl.Trainer) -> None:
    """Log this step's metrics now, in ``on_train_batch_end`` before a checkpoint is written
    (every rank calls it; Lightning's loggers log on rank 0)."""
    connector = _install(trainer)
    early = getattr(connector, _ATTR)
    if early is not None and early[0] == trainer.global_step:
        return  # logged already at this step
    if not trainer.training or connector._first_loop_iter is None:
        return  # not inside a training step (an epoch's end)
    if not (connector.should_update_logs or trainer.fast_dev_run):
        return
    metrics = connector.metrics["log"]
    connector.log_metrics(metrics)
    setattr(connector, _ATTR, (trainer.global_step, set(metrics)))
