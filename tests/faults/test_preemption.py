"""Preemption: on SIGTERM or SIGUSR1 (SLURM's warning before the kill) every rank finishes the
step it is in, the run writes that step's checkpoint and exits with code 75 and one line; run
again with ``resume_from=auto`` (same ``output_dir``) it continues from the highest-step complete
checkpoint and ends with the weights of a run that was never interrupted, bit for bit.

The signal is sent at several points of a step: before it (at its start), during it (in its
forward pass) and after it (once its update is applied: the stop then comes at the end of the
next step); from inside the run (the injector callback) and from outside (the whole process
group, as a scheduler does); under a simulated SLURM job (Lightning's SLURM requeue handler is
not used: the same behaviour in and out of SLURM); and, under FSDP2 with two processes, on rank
0 only or on rank 1 only."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from fault_runs import (TINY, assert_same_weights, checkpointed_run, inject, one_error_line, train, weights,
                         write_trees)
from treelit.cli.train import find_resume_checkpoint

EXIT = 75
STEPS = ["trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=100"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_trees(tmp_path_factory.mktemp("preempt") / "trees.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The run never interrupted, a checkpoint after every step."""
    return checkpointed_run(tmp_path_factory.mktemp("uninterrupted") / "run", data)


def _cli(cli_main, capsys, *args):
    status = cli_main(*TINY, *args)
    out, err = capsys.readouterr()
    return status, out, err


def _preempt_then_resume(cli_main, capsys, data, out, at, sig, stop_step, monkeypatch=None, slurm=False):
    status, stdout, err = _cli(cli_main, capsys, f"data.train_path={data}", f"output_dir={out}", *STEPS,
                               "resume_from=auto", *inject("sig", "SendSignal", step=2, at=at, sig=sig))
    assert f"resume_from=auto: no complete checkpoint in {out / 'checkpoints'}: starting fresh" in stdout
    assert status == EXIT, err
    line = one_error_line(err)
    saved = out / "checkpoints" / f"step-{stop_step:06d}.ckpt"
    assert line == (f"error: preempted by {sig}: stopped after step {stop_step} on every rank and saved {saved}; "
                    f"exit code {EXIT}: run again with resume_from=auto (the same output_dir) to continue"), line
    assert saved.is_file() and (out / "checkpoints" / "last.ckpt").is_file()
    assert not (out / "hf_checkpoint").exists() and not (out / "summary.json").exists()
    assert not any("hpc" in p.name for p in out.rglob("*")), "Lightning's own SLURM checkpoint"
    if slurm and monkeypatch is not None:
        for k in [k for k in os.environ if k.startswith("SLURM_")]:
            monkeypatch.delenv(k)
    status, stdout, err = _cli(cli_main, capsys, f"data.train_path={data}", f"output_dir={out}", *STEPS,
                               "resume_from=auto")
    assert status == 0, err
    assert f"resume_from=auto: resuming from {out / 'checkpoints'}" in stdout and f"(step {stop_step})" in stdout


@pytest.mark.parametrize("at,sig,stop_step,slurm", [
    ("during", "SIGUSR1", 2, True),
    pytest.param("before", "SIGTERM", 2, False, marks=pytest.mark.slow),
    pytest.param("after", "SIGUSR1", 3, False, marks=pytest.mark.slow),
], ids=["during-slurm", "before", "after"])
def test_preempted_run_resumes_to_the_uninterrupted_weights(at, sig, stop_step, slurm, data, uninterrupted, tmp_path,
                                                            cli_main, capsys, monkeypatch):
    if slurm:  # a one-task SLURM job: Lightning picks its SLURMEnvironment, with auto-requeue on SIGUSR1
        for k, v in dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="treelit", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
                         SLURM_NNODES="1", SLURM_NODELIST="localhost", SLURM_PROCID="0", SLURM_LOCALID="0",
                         SLURM_NODEID="0").items():
            monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    _preempt_then_resume(cli_main, capsys, data, out, at, sig, stop_step, monkeypatch, slurm)
    assert_same_weights(weights(out), weights(uninterrupted))


def test_a_signal_in_the_last_step_lets_the_run_end(data, tmp_path, cli_main, capsys):
    """The last step's boundary is the end of the run: it ends as usual (export, summary, exit 0)."""
    out = tmp_path / "run"
    status, _, err = _cli(cli_main, capsys, f"data.train_path={data}", f"output_dir={out}", *STEPS,
                          *inject("sig", "SendSignal", step=4, at="during", sig="SIGTERM"))
    assert status == 0 and err == "", err
    assert (out / "hf_checkpoint").is_dir() and (out / "summary.json").is_file()


def test_auto_takes_the_highest_complete_step(uninterrupted, tmp_path, caplog):
    """Highest step that verifies, whatever the file times; a truncated file and a sharded
    directory without its meta.pt (its step unreadable) are passed over, each named with why;
    a partial file is never a candidate."""
    d = tmp_path / "checkpoints"
    d.mkdir()
    src = uninterrupted / "checkpoints"
    for n in (1, 2):
        shutil.copy(src / f"step-{n:06d}.ckpt", d)
    (d / "step-000003.ckpt").write_bytes((src / "step-000003.ckpt").read_bytes()[:5000])  # cut short
    (d / "step-000004.ckpt").mkdir()  # a sharded checkpoint whose meta.pt was never written
    (d / "step-000004.ckpt" / "__0_0.distcp").write_bytes(b"\0" * 64)
    shutil.copy(src / "step-000004.ckpt", d / "step-000005.ckpt.partial")
    now = time.time()
    for i, name in enumerate(["step-000002.ckpt", "step-000001.ckpt", "step-000003.ckpt", "step-000004.ckpt",
                              "step-000005.ckpt.partial"]):
        os.utime(d / name, (now + i, now + i))
    with caplog.at_level("WARNING", logger="treelit.train"):
        info = find_resume_checkpoint(d)
    assert info["path"] == str(d / "step-000002.ckpt") and info["global_step"] == 2
    passed = sorted(r.getMessage() for r in caplog.records if r.name == "treelit.train")
    assert len(passed) == 2 and all("passing over" in m and "its step unreadable" in m for m in passed), passed
    assert "step-000003.ckpt" in passed[0] and "step-000004.ckpt" in passed[1] and "without meta.pt" in passed[1]
    shutil.rmtree(d / "step-000004.ckpt")
    (d / "step-000004.ckpt").mkdir()  # a sharded checkpoint, complete: its meta.pt loads
    shutil.copy(src / "step-000004.ckpt", d / "step-000004.ckpt" / "meta.pt")
    os.utime(d / "step-000004.ckpt" / "meta.pt", (now - 99, now - 99))
    assert find_resume_checkpoint(d)["global_step"] == 4
    assert find_resume_checkpoint(tmp_path / "none") is None


# from outside, and two processes ---------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_to_the_process_group_from_outside(data, uninterrupted, tmp_path):
    """As a scheduler stops a job: SIGTERM to every process of the run while step 3 waits (the
    injector holds it until the signal has arrived), then a resumed run in the same folder."""
    out = tmp_path / "run"
    marker = tmp_path / "at_step_3"
    common = [*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS, "resume_from=auto"]
    rc, _, err = train([*common, *inject("hold", "HoldUntilSignal", step=3, marker=marker)], tmp_path,
                       until=marker.exists)
    assert rc == EXIT, err
    assert "preempted by SIGTERM: stopped after step 3" in one_error_line(err)
    rc, stdout, err = train(common, tmp_path)
    assert rc == 0, err
    assert "(step 3)" in stdout
    assert_same_weights(weights(out), weights(uninterrupted))


@pytest.fixture(scope="module")
def fsdp2_uninterrupted(data, tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp2_full")
    rc, _, err = train([*TINY, f"data.train_path={data}", f"output_dir={d / 'run'}", "trainer=fsdp2_cpu",
                        *STEPS], d)
    assert rc == 0, err
    return d / "run"


@pytest.mark.slow
@pytest.mark.parametrize("rank,at,sig", [(1, "during", "SIGUSR1"), (0, "before", "SIGTERM")])
def test_fsdp2_a_signal_to_one_rank_stops_both(rank, at, sig, data, fsdp2_uninterrupted, tmp_path):
    """The signal reaches one process only; the ranks agree at the end of step 2, write its sharded
    checkpoint (a directory with meta.pt) and exit 75 with one line; the resumed run equals the
    uninterrupted one bit for bit."""
    out = tmp_path / "run"
    common = [*TINY, f"data.train_path={data}", f"output_dir={out}", "trainer=fsdp2_cpu", *STEPS, "resume_from=auto"]
    rc, _, err = train([*common, *inject("sig", "SendSignal", step=2, at=at, sig=sig, rank=rank)], tmp_path)
    assert rc == EXIT, err
    assert one_error_line(err).startswith(f"error: preempted by {sig}: stopped after step 2 on every rank and saved "
                                          f"{out / 'checkpoints' / 'step-000002.ckpt'};")
    assert (out / "checkpoints" / "step-000002.ckpt" / "meta.pt").is_file()
    rc, stdout, err = train(common, tmp_path)
    assert rc == 0, err
    assert "(step 2)" in stdout
    assert_same_weights(weights(out), weights(fsdp2_uninterrupted))
