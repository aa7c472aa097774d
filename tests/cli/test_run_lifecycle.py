"""The MLflow run lifecycle and resumption: kill -9 mid-step then resume, signals, dead runs,
the first and last step always logged, unique names, the progress bar after a resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import treelit
from app_helpers import STALL
from cli_helpers import TINY, cli_env, finish, runs, start
from treelit.cli.config import compose
from treelit.cli.train import run


def _in_process(tmp_path, name, *overrides):
    cfg = compose([f"output_dir={tmp_path / name}", *TINY, *overrides])
    return run(cfg), tmp_path / name


def _one_thread(tmp_path, name, *overrides):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _in_process(tmp_path, name, *overrides)
    finally:
        torch.set_num_threads(threads)


def test_sigkill_mid_step_then_resume_equals_the_uninterrupted_run(tmp_path, mlflow_db):
    """kill -9 inside step 4 of 6 (after its backward, before its update), resume from the
    last checkpoint (step 3): the weights equal an uninterrupted run's bit for bit, and the
    resumed run continues the same MLflow run, its metrics at the right steps."""
    db, uri = mlflow_db
    (tmp_path / "stall.py").write_text(STALL)
    marker = tmp_path / "stalled"
    common = [*TINY, "trainer.max_steps=6", "callbacks.checkpoint.every_n_train_steps=1",
              "trainer.log_every_n_steps=1", "data.micro_batch_tokens=1200"]
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    victim = start(*common, f"logger.mlflow.tracking_uri={uri}", f"output_dir={tmp_path / 'killed'}",
                   "+callbacks.stall._target_=stall.Stall", "+callbacks.stall.at_step=3",
                   f"+callbacks.stall.marker={marker}", cwd=tmp_path, env=env)
    # meanwhile, the uninterrupted run (in this process, on one thread like the subprocess)
    full, full_dir = _one_thread(tmp_path, "full", *common[len(TINY):], "logger=none")
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert victim.poll() is None, finish(victim).stderr[-3000:]
        assert time.monotonic() < deadline, "the run never reached step 4"
        time.sleep(0.2)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL

    client, (killed,) = runs(uri)
    assert killed.info.status == "RUNNING"  # nobody could close it
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3

    resumed, resumed_dir = _one_thread(tmp_path, "resumed", *common[len(TINY):], f"logger.mlflow.tracking_uri={uri}",
                                       f"resume_from={last}")
    a = treelit.load_hf_checkpoint(full_dir / "hf_checkpoint").state_dict()
    b = treelit.load_hf_checkpoint(resumed_dir / "hf_checkpoint").state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    _, (again,) = runs(uri)  # the same run, continued
    assert again.info.run_id == killed.info.run_id and again.info.status == "FINISHED"
    assert resumed["mlflow"]["run_id"] == killed.info.run_id and resumed["mlflow"]["continued"]
    history = client.get_metric_history(again.info.run_id, "loss")
    steps = sorted(m.step for m in history)
    assert steps == [0, 1, 2, 3, 4, 5], steps  # steps 1-3 before the kill, 4-6 after: each once
    final = max(history, key=lambda m: m.step).value
    assert final == pytest.approx(full["loss"]["last"][1], rel=1e-6)
    assert again.data.tags["treelit.resumed_from"] == str(last)
    arts = {a.path for a in client.list_artifacts(again.info.run_id)}
    assert {"config.yaml", "config-resumed-at-step-3.yaml", "hf_checkpoint"} <= arts, arts


SIGTERM_AT_STEP_2 = '''
import os, signal
import lightning.pytorch as pl

class SendSigterm(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
'''


def test_sigterm_ends_the_run_killed(tmp_path, mlflow_db, monkeypatch):
    """SIGTERM: Lightning finishes the step and stops; the MLflow run ends KILLED (not FAILED,
    not RUNNING) with the reason in the tag treelit.end."""
    (tmp_path / "sigterm_cb.py").write_text(SIGTERM_AT_STEP_2)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, uri = mlflow_db
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException
        _in_process(tmp_path, "out", "trainer.max_steps=50", f"logger.mlflow.tracking_uri={uri}",
                    "+callbacks.sigterm._target_=sigterm_cb.SendSigterm")
    _, (r,) = runs(uri)
    assert r.info.status == "KILLED"
    assert "interrupted" in r.data.tags["treelit.end"]
    assert "loss" in r.data.metrics


def test_runs_of_dead_processes_are_marked_killed_by_the_next_run(tmp_path, mlflow_db):
    from mlflow.tracking import MlflowClient

    from treelit.lightning.mlflow_logger import TreeMLFlowLogger
    from treelit.utils.mlflow_store import process_tags

    _, uri = mlflow_db
    client = MlflowClient(uri)
    exp = client.create_experiment("treelit", artifact_location=str(tmp_path / "mlruns"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = client.create_run(exp, tags={**process_tags(), "treelit.pid": str(dead.pid), "mlflow.runName": "gone"})
    alive = client.create_run(exp, tags={**process_tags(), "mlflow.runName": "alive"})  # this process
    elsewhere = client.create_run(exp, tags={**process_tags(), "treelit.pid": str(dead.pid),
                                             "treelit.machine": "another-host|x|y", "mlflow.runName": "elsewhere"})
    lg = TreeMLFlowLogger(tracking_uri=uri, run_name="next")
    lg.log_metrics({"x": 1.0}, step=0)
    status = {r.info.run_name: r.info.status for r in runs(uri)[1]}
    assert status == {"gone": "KILLED", "alive": "RUNNING", "elsewhere": "RUNNING", "next": "RUNNING"}
    assert "killed" in client.get_run(gone.info.run_id).data.tags["treelit.end"]
    lg.finalize("success")
    assert client.get_run(lg.run_id).info.status == "FINISHED"
    del alive, elsewhere


@pytest.mark.parametrize("steps,logged", [(3, [0, 2]), (7, [0, 4, 6])])
def test_first_and_last_step_are_always_logged(tmp_path, mlflow_db, steps, logged):
    """log_every_n_steps=5: a 3-step run still logs its loss (steps 1 and 3, Lightning's
    0-based step index), a 7-step run logs steps 1, 5 and 7."""
    _, uri = mlflow_db
    _in_process(tmp_path, "out", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=5",
                f"logger.mlflow.tracking_uri={uri}", "callbacks.checkpoint=null", "callbacks.hf_export=null")
    client, (r,) = runs(uri)
    assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "loss")) == logged


def test_default_output_dir_and_run_name_are_unique_and_agree():
    a, b = compose(), compose()
    assert a.output_dir != b.output_dir
    for cfg in (a, b):
        assert os.path.basename(cfg.output_dir) == cfg.logger.mlflow.run_name
        assert cfg.output_dir == cfg.output_dir  # resolved once per config (cached)


def test_progress_bar_counts_optimizer_steps_after_a_resume(tmp_path, capsys):
    base = ["trainer.max_steps=2", "callbacks.checkpoint.every_n_train_steps=1", "logger=none",
            "callbacks.hf_export=null", "callbacks.progress.refresh_rate=1", "trainer.enable_progress_bar=true",
            "callbacks.progress.plain=false"]  # the bar, though captured output is not a terminal
    tiny = [o for o in TINY if "progress" not in o]
    run(compose([f"output_dir={tmp_path / 'a'}", *tiny, *base]))
    capsys.readouterr()
    run(compose([f"output_dir={tmp_path / 'b'}", *tiny, *base, "trainer.max_steps=4",
                 f"resume_from={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}"]))
    text = capsys.readouterr().out.replace("\r", "\n")
    bars = [line for line in text.splitlines() if line.startswith("steps")]
    assert bars and all("/4 " in line for line in bars), bars[-3:]  # never "4/?"
    assert "4/4" in bars[-1]


def test_a_checkpoint_write_that_dies_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    """The write of last.ckpt at step 3 dies half-way: last.ckpt still holds step 2, and a
    resume from it works (files are written as <name>.partial, then renamed; the partial one
    is removed)."""
    from treelit.lightning.callbacks import TreeCheckpointIO

    real = TreeCheckpointIO.save_checkpoint

    def dies_at_step_3(self, checkpoint, path, *args, **kwargs):
        if checkpoint["global_step"] == 3 and os.path.basename(str(path)).startswith("last"):
            with open(path, "wb") as f:
                f.write(b"half a checkpoint")
            raise OSError(28, "No space left on device", str(path))
        return real(self, checkpoint, path, *args, **kwargs)

    monkeypatch.setattr(TreeCheckpointIO, "save_checkpoint", dies_at_step_3)
    over = ["trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=1", "logger=none", "callbacks.hf_export=null"]
    with pytest.raises(OSError, match="last.ckpt not written at step 3: no space left on device"):
        _in_process(tmp_path, "a", *over)
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2
    assert not list(last.parent.glob("*.partial*"))
    monkeypatch.setattr(TreeCheckpointIO, "save_checkpoint", real)
    summary, _ = _in_process(tmp_path, "b", *over, f"resume_from={last}")
    assert summary["global_step"] == 4


PROBE = '''
import torch
import lightning.pytorch as pl

SEEN = []

class Threads(pl.Callback):
    def on_train_batch_end(self, *args):
        SEEN.append(torch.get_num_threads())
'''


@pytest.mark.parametrize("setting,inside", [("auto", 1), ("null", 2), ("3", 3)])
def test_torch_threads_during_training_and_restored_after(setting, inside, tmp_path, monkeypatch):
    """auto: one thread for a small model on CPU (two OpenMP threads on shared cores were
    measured 5x slower); null: torch's default; N: N. The caller's setting comes back."""
    (tmp_path / "threads_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    import threads_probe

    threads_probe.SEEN.clear()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _in_process(tmp_path, "out", "trainer.max_steps=2", "logger=none", "callbacks.checkpoint=null",
                    "callbacks.hf_export=null", f"torch_threads={setting}", "+callbacks.probe._target_=threads_probe.Threads")
        assert threads_probe.SEEN == [inside, inside]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(Exception, match="torch_threads must be auto, null"):
        _in_process(tmp_path, "bad", "torch_threads=0", "logger=none")


def test_resuming_a_run_that_is_gone_starts_a_new_one(tmp_path, mlflow_db):
    from mlflow.tracking import MlflowClient

    from treelit.lightning.mlflow_logger import TreeMLFlowLogger

    _, uri = mlflow_db
    lg = TreeMLFlowLogger(tracking_uri=uri, run_name="first")
    lg.finalize("success")
    MlflowClient(uri).delete_run(lg.run_id)
    for gone in (lg.run_id, "0123456789abcdef0123456789abcdef"):  # deleted, never existed
        again = TreeMLFlowLogger(tracking_uri=uri, run_name="again", run_id=gone)
        assert again.run_id != gone and not again.reopened
        again.finalize("success")


def test_a_resumed_run_says_how_many_steps_kept_the_earlier_values(tmp_path, mlflow_db, caplog):
    """Steps a reopened run redoes keep the values logged first; one info line says how many."""
    import logging

    from mlflow.tracking import MlflowClient

    from treelit.lightning.mlflow_logger import TreeMLFlowLogger

    _, uri = mlflow_db
    lg = TreeMLFlowLogger(tracking_uri=uri, run_name="first")
    for step in range(5):
        lg.log_metrics({"loss": float(step)}, step=step)
    lg.finalize("success")
    again = TreeMLFlowLogger(tracking_uri=uri, run_name="first", run_id=lg.run_id)
    assert again.reopened
    with caplog.at_level(logging.INFO, logger="treelit.lightning.mlflow_logger"):
        for step in range(2, 7):  # resumed from a checkpoint at step 2: steps 2-4 are redone
            again.log_metrics({"loss": 10.0 + step}, step=step)
        again.finalize("success")
    said = [r.getMessage() for r in caplog.records if "redone" in r.getMessage()]
    assert said == ["MLflow: resumed run kept the earlier run's values for 3 redone step(s) (2-4): each step is "
                    "logged once; the values this run computed for them are not logged"], said
    history = MlflowClient(uri).get_metric_history(lg.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),
                                                          (5, 15.0), (6, 16.0)]


def test_a_clean_resume_says_nothing_about_redone_steps(tmp_path, mlflow_db, caplog):
    """A run resumed from its last step redoes nothing: once its data statistics (logged at step 0
    when the run began) made it say "kept the earlier run's values for 1 redone step(s) (0-0)"."""
    import logging

    from mlflow.tracking import MlflowClient

    from treelit.cli.config import compose
    from treelit.cli.train import _start_tracking
    from treelit.lightning.mlflow_logger import TreeMLFlowLogger

    _, uri = mlflow_db
    cfg = compose(["logger=none", f"output_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    stats = {"trees": 8, "branches": 68}
    lg = TreeMLFlowLogger(tracking_uri=uri, run_name="first")
    _start_tracking([lg], cfg, stats, tmp_path, None)
    for step in range(2):
        lg.log_metrics({"loss": float(step)}, step=step)
    lg.finalize("success")
    again = TreeMLFlowLogger(tracking_uri=uri, run_name="first", run_id=lg.run_id)
    with caplog.at_level(logging.INFO, logger="treelit.lightning.mlflow_logger"):
        _start_tracking([again], cfg, stats, tmp_path, {"global_step": 2, "path": str(tmp_path / "last.ckpt")})
        for step in range(2, 4):  # the checkpoint was at step 2: nothing is redone
            again.log_metrics({"loss": 10.0 + step}, step=step)
        again.finalize("success")
    assert not [r.getMessage() for r in caplog.records if "redone" in r.getMessage()]
    assert [m.value for m in MlflowClient(uri).get_metric_history(lg.run_id, "data/trees")] == [8.0]


def test_a_checkpoint_written_over_a_hard_link_leaves_the_linked_file_alone(tmp_path):
    """resume_from=auto makes last.ckpt.partial a hard link to step-N.ckpt; if that link
    survived, the next write of last.ckpt.partial must make a new file, not truncate step-N."""
    from treelit.lightning.callbacks import TreeCheckpointIO

    step = tmp_path / "step-3.ckpt"
    torch.save({"global_step": 3}, step)
    before = step.read_bytes()
    partial = tmp_path / "last.ckpt.partial"
    os.link(step, partial)
    TreeCheckpointIO().save_checkpoint({"global_step": 5}, str(partial))
    assert step.read_bytes() == before and os.stat(step).st_nlink == 1
    assert torch.load(partial, map_location="cpu", weights_only=False) == {"global_step": 5}
