"""Preemption signals at any moment: during start-up (imports, data, the MLflow store) the run
exits with code 75 and one line - before, the default action killed it with code 143 and no
word, and a job script requeueing on 75 lost the job; in the middle of a checkpoint write the
previous checkpoint stays valid (SIGTERM only sets the flag: the write completes, the run
stops at the next step boundary; SIGKILL leaves a half-written ``.partial``, removed at the
next start). Each stopped run is continued with ``resume_from=auto`` to the weights of a run
never interrupted, bit for bit. (Signals in the middle of a step: test_preemption.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_runs import (TINY, assert_same_weights, checkpointed_run, inject, one_error_line, train, weights,
                         write_trees)
from treelit.utils.integrity import verify

EXIT = 75
STEPS = ["trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_trees(tmp_path_factory.mktemp("signals") / "trees.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    return checkpointed_run(tmp_path_factory.mktemp("signals_full") / "run", data)


def _printed(cwd: Path, text: str):
    return lambda: any(text in p.read_text(errors="replace") for p in cwd.glob("run*.out"))


def _startup(data, tmp_path, sig, until_text=None, until_file=None, mlflow=False):
    out = tmp_path / "run"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = [*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS, "resume_from=auto"]
    if mlflow:
        args = [a for a in args if a != "logger=none"] + [f"logger.mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    until = _printed(cwd, until_text) if until_text else (lambda: until_file.exists())
    rc, _, err = train(args, cwd, until=until, then=sig)
    assert rc == EXIT, (rc, err[-3000:])
    name = "SIGTERM" if sig == 15 else "SIGUSR1"
    assert one_error_line(err).startswith(f"error: preempted by {name} during start-up, before training began: "
                                          "nothing to save; exit code 75"), err
    assert not list((out / "checkpoints").glob("*.ckpt")) if (out / "checkpoints").exists() else True
    return out, args, cwd


def test_sigterm_during_start_up_exits_75_with_one_line(data, tmp_path):
    """SIGTERM once the checkpoint folder was looked at (the model, the data and the trainer
    not built yet)."""
    import signal

    _startup(data, tmp_path, signal.SIGTERM, until_text="resume_from=auto: no complete checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["resume_from=auto: no complete checkpoint", "mlflow.db.lock"])
def test_sigusr1_during_start_up_exits_75_and_the_requeued_run_trains(point, data, uninterrupted, tmp_path):
    """SIGUSR1 (SLURM's warning) once the checkpoint folder was looked at, and
    while the MLflow store is created; the requeued run then trains to the uninterrupted
    weights."""
    import signal

    if point.endswith(".lock"):
        out, args, cwd = _startup(data, tmp_path, signal.SIGUSR1, until_file=tmp_path / point, mlflow=True)
    else:
        out, args, cwd = _startup(data, tmp_path, signal.SIGUSR1, until_text=point)
    rc, _, err = train(args, cwd)
    assert rc == 0, err
    assert_same_weights(weights(out), weights(uninterrupted))


def test_sigterm_mid_checkpoint_write_keeps_it_and_stops_at_the_next_step(data, uninterrupted, tmp_path, cli_main,
                                                                         capsys):
    """SIGTERM half-way through step 2's checkpoint file: the write completes (step 2's
    checkpoint verifies), the run stops after step 3 with code 75, the resumed run ends with the
    uninterrupted weights."""
    out = tmp_path / "run"
    common = [*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS, "resume_from=auto"]
    status = cli_main(*common, *inject("w", "SignalDuringWrite", step=2, sig="SIGTERM"))
    err = capsys.readouterr().err
    assert status == EXIT, err
    assert "preempted by SIGTERM: stopped after step 3" in one_error_line(err)
    for n in (1, 2, 3):
        assert verify(out / "checkpoints" / f"step-{n:06d}.ckpt", "t") is not None
    assert cli_main(*common) == 0, capsys.readouterr().err
    assert_same_weights(weights(out), weights(uninterrupted))


@pytest.mark.slow
def test_sigkill_mid_checkpoint_write_keeps_the_previous_one(data, uninterrupted, tmp_path):
    """SIGKILL half-way through step 2's checkpoint file: step 1's checkpoint verifies, the
    half-written ``.partial`` is removed at the next start, which resumes from step 1."""
    out = tmp_path / "run"
    common = [*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS, "resume_from=auto"]
    rc, _, err = train([*common, *inject("w", "SignalDuringWrite", step=2, sig="SIGKILL")], tmp_path)
    assert rc == -9, err
    d = out / "checkpoints"
    assert (d / "step-000002.ckpt.partial").is_file() and not (d / "step-000002.ckpt").exists()
    assert verify(d / "step-000001.ckpt", "t") is not None and verify(d / "last.ckpt", "t") is not None
    rc, stdout, err = train(common, tmp_path)
    assert rc == 0, err
    assert "(step 1)" in stdout and f"removed {d / 'step-000002.ckpt.partial'}" in stdout, stdout
    assert not list(d.glob("*.partial"))
    assert_same_weights(weights(out), weights(uninterrupted))
