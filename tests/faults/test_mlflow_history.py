"""A run stopped and continued with ``resume_from=auto`` has every step in its MLflow
history exactly once: the step a checkpoint holds was logged before the checkpoint was
written (no gap after a preemption, or after a kill right behind the checkpoint), and the
steps a killed run logged after its last checkpoint are not logged again when the resumed
run redoes them (no duplicate)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from fault_runs import TINY, inject, train, write_trees
from treelit.cli.train import read_resume_checkpoint

EXIT = 75


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_trees(tmp_path_factory.mktemp("history") / "trees.jsonl")


def _args(data, out: Path, every: int, steps: int = 4):
    tiny = [a for a in TINY if a != "logger=none"]
    return [*tiny, f"data.train_path={data}", f"output_dir={out}", f"trainer.max_steps={steps}",
            "trainer.log_every_n_steps=1", f"callbacks.checkpoint.every_n_train_steps={every}",
            f"logger.mlflow.tracking_uri=sqlite:///{out.parent / 'mlflow.db'}", "resume_from=auto"]


def history(out: Path) -> dict:
    """{metric key: [steps]} of the MLflow run the run's last checkpoint belongs to."""
    link = read_resume_checkpoint(str(out / "checkpoints" / "last.ckpt"))["mlflow"]
    client = MlflowClient(link["tracking_uri"])
    keys = [k for k in client.get_run(link["run_id"]).data.metrics if not k.startswith("data/")]
    return {k: sorted(m.step for m in client.get_metric_history(link["run_id"], k)) for k in keys}


def _each_step_once(out: Path, steps: int) -> None:
    h = history(out)
    assert {"loss", "lr", "epoch"} <= set(h), h
    wrong = {k: v for k, v in h.items() if v != list(range(steps))}  # every key is logged at every step here
    assert not wrong, wrong


def test_a_preempted_and_continued_run_logs_each_step_once(data, tmp_path, cli_main, capsys):
    """SIGTERM in step 2: its checkpoint is written and the run exits 75; before, step 2's
    metrics never reached MLflow (the continued run starts at step 3)."""
    out = tmp_path / "run"
    status = cli_main(*_args(data, out, every=1), *inject("sig", "SendSignal", step=2, at="during", sig="SIGTERM"))
    assert status == EXIT, capsys.readouterr().err
    status = cli_main(*_args(data, out, every=1))
    assert status == 0, capsys.readouterr().err
    _each_step_once(out, 4)


@pytest.mark.slow
def test_a_kill_after_steps_past_the_checkpoint_logs_them_once(data, tmp_path):
    """Checkpoints every 2 steps, SIGKILL at the start of step 4: step 3 was logged, the
    checkpoint holds step 2; the continued run redoes step 3 (before, it was logged twice)."""
    out = tmp_path / "run"
    rc, _, err = train([*_args(data, out, every=2), *inject("k", "SendSignal", step=4, at="before", sig="SIGKILL")],
                       tmp_path)
    assert rc == -9, err
    rc, _, err = train(_args(data, out, every=2), tmp_path)
    assert rc == 0, err
    _each_step_once(out, 4)


@pytest.mark.slow
def test_a_kill_right_after_the_checkpoint_logs_its_step(data, tmp_path):
    """SIGKILL right after step 2's checkpoint (last.ckpt) is renamed into place: before,
    step 2's metrics were lost (Lightning logs them after the checkpoint callback)."""
    out = tmp_path / "run"
    rc, _, err = train([*_args(data, out, every=1), *inject("k", "KillAfterCommit", step=2)], tmp_path)
    assert rc == -9, err
    rc, _, err = train(_args(data, out, every=1), tmp_path)
    assert rc == 0, err
    _each_step_once(out, 4)
