"""Ctrl-C (SIGINT) during training: the run finishes the step it is in, writes that step's
checkpoint, prints one line with the way to continue and exits 130 (the shell's code for a
Ctrl-C); ``resume_from=auto`` then continues from that step, to the weights of a run never
interrupted, bit for bit. Before, Python's ``KeyboardInterrupt`` reached Lightning, which
printed "attempting graceful shutdown", wrote no checkpoint and exited 1, so the steps since
the last periodic checkpoint were trained again. A second Ctrl-C stops at once, without
saving; a Ctrl-C during start-up ends the run with one line and 130 (not a traceback)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from fault_runs import TINY, assert_same_weights, checkpointed_run, inject, one_error_line, train, weights, write_trees

EXIT = 130
STEPS = ["trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=100"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_trees(tmp_path_factory.mktemp("interrupt") / "trees.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    return checkpointed_run(tmp_path_factory.mktemp("interrupt_full") / "run", data)


def _resume_line(step: int, saved: Path) -> str:
    return (f"error: interrupted by Ctrl-C (SIGINT): stopped after step {step} on every rank and saved {saved}; "
            f"exit code {EXIT}: run again with resume_from=auto (the same output_dir) to continue")


def test_ctrl_c_saves_the_step_it_is_in_and_the_run_resumes_from_it(data, uninterrupted, tmp_path, cli_main,
                                                                    capsys):
    out = tmp_path / "run"
    common = [*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS, "resume_from=auto"]
    status = cli_main(*common, *inject("sig", "SendSignal", step=2, at="during", sig="SIGINT"))
    _, err = capsys.readouterr()
    assert status == EXIT, err
    saved = out / "checkpoints" / "step-000002.ckpt"
    assert one_error_line(err) == _resume_line(2, saved)
    assert "graceful shutdown" not in err and saved.is_file()
    assert not (out / "hf_checkpoint").exists() and not (out / "summary.json").exists()
    status = cli_main(*common)
    stdout, err = capsys.readouterr()
    assert status == 0, err
    assert f"resume_from=auto: resuming from {out / 'checkpoints'}" in stdout and "(step 2)" in stdout
    assert_same_weights(weights(out), weights(uninterrupted))


def test_a_second_ctrl_c_stops_at_once_without_saving(data, tmp_path, cli_main, capsys):
    out = tmp_path / "run"
    status = cli_main(*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS,
                      *inject("sig", "SendSignal", step=2, at="during", sig="SIGINT", times=2))
    _, err = capsys.readouterr()
    assert status == EXIT, err
    assert one_error_line(err) == (
        f"error: interrupted by a second Ctrl-C (SIGINT) in step 2: stopped at once, without saving it; exit code "
        f"{EXIT}: run again with resume_from=auto (the same output_dir) to continue from the newest checkpoint")
    assert not list(out.rglob("*.ckpt")), "the step the second Ctrl-C cut short was saved"


def test_ctrl_c_to_the_process_group_from_a_terminal(data, uninterrupted, tmp_path):
    """As a terminal sends it: SIGINT to every process of the run while step 3 waits; the
    console script says what it does on the first Ctrl-C, exits 130 with the resume line, and
    the resumed run starts from step 3."""
    out = tmp_path / "run"
    marker = tmp_path / "at_step_3"
    common = [*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS, "resume_from=auto"]
    rc, stdout, err = train([*common, *inject("hold", "HoldUntilSignal", step=3, marker=marker)], tmp_path,
                            until=marker.exists, then=signal.SIGINT)
    assert rc == EXIT, err
    assert one_error_line(err) == _resume_line(3, out / "checkpoints" / "step-000003.ckpt")
    assert ("Ctrl-C: finishing step 3, then saving it and stopping (Ctrl-C again stops at once, without saving)"
            in stdout), stdout
    rc, stdout, err = train(common, tmp_path)
    assert rc == 0, err
    assert "(step 3)" in stdout
    assert_same_weights(weights(out), weights(uninterrupted))


def test_ctrl_c_during_start_up_is_one_line_and_130(data, tmp_path):
    out = tmp_path / "run"
    rc, _, err = train([*TINY, f"data.train_path={data}", f"output_dir={out}", *STEPS, "resume_from=auto"], tmp_path,
                       until=lambda: any("resume_from=auto: no complete checkpoint" in p.read_text(errors="replace")
                                         for p in tmp_path.glob("run*.out")), then=signal.SIGINT)
    assert rc == EXIT, err
    assert one_error_line(err).startswith("error: interrupted by Ctrl-C (SIGINT) during start-up, before training "
                                          f"began: nothing to save; exit code {EXIT}")


def test_preemption_signals_without_sigint_leave_ctrl_c_to_python():
    """``callbacks.preemption.signals`` without SIGINT: Ctrl-C is not treelit's (not reported
    as a stop during start-up either)."""
    import signal as sig

    from treelit.cli import startup_signals

    startup_signals.install()
    try:
        startup_signals.keep_only(["SIGTERM", "USR1"])
        assert sig.getsignal(sig.SIGINT) is not startup_signals._handler
        assert sig.getsignal(sig.SIGTERM) is startup_signals._handler
        assert sig.getsignal(sig.SIGUSR1) is startup_signals._handler
    finally:
        startup_signals.uninstall()
    assert sig.getsignal(sig.SIGTERM) is not startup_signals._handler


def test_a_second_ctrl_c_during_start_up_ends_the_process_at_once():
    """The first Ctrl-C during start-up raises (the command reports it); should its way out
    hang, the second ends the process with one line and 130."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from treelit.cli import startup_signals as s\n"
            "s.install(); s.running()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "except s.StartupPreempted as e:\n    print(e.exit_code, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "print('still running', flush=True)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == EXIT and res.stdout == "130\n", (res.stdout, res.stderr)
    assert res.stderr == "error: interrupted by a second Ctrl-C (SIGINT) during start-up: stopped at once\n"


@pytest.mark.slow
def test_fsdp2_a_ctrl_c_that_reached_one_rank_stops_both_with_130(data, tmp_path):
    """Two processes (FSDP2); the SIGINT reaches rank 1 only, during step 2: both ranks finish
    step 2, write its sharded checkpoint, exit 130 with one line (rank 0's), and the resumed run
    starts from step 2."""
    out = tmp_path / "run"
    common = [*TINY, f"data.train_path={data}", f"output_dir={out}", "trainer=fsdp2_cpu", *STEPS, "resume_from=auto"]
    rc, _, err = train([*common, *inject("sig", "SendSignal", step=2, at="during", sig="SIGINT", rank=1)], tmp_path)
    assert rc == EXIT, err
    assert one_error_line(err) == _resume_line(2, out / "checkpoints" / "step-000002.ckpt")
    assert (out / "checkpoints" / "step-000002.ckpt" / "meta.pt").is_file()
    rc, stdout, err = train(common, tmp_path)
    assert rc == 0, err
    assert "(step 2)" in stdout
