"""The memory planner's user errors are one ``error:`` line naming the option, no traceback: a
CPU run without ``memory_limit_bytes`` (before training), and a memory limit too small for the
data's longest branch (at the first step)."""

from __future__ import annotations

COMMON = ["experiment=rl_synthetic", "partition=redundancy_free", "callbacks=planner", "trainer=cpu",
          "trainer.max_steps=1", "logger=none"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_planner_on_cpu_without_a_memory_limit_is_refused_before_training(cli_main, tmp_path, capsys):
    assert cli_main(*COMMON, f"output_dir={tmp_path / 'run'}") != 0
    assert _one_error_line(capsys).startswith("error: callbacks.memory_planner.memory_limit_bytes is needed on CPU")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_memory_limit_below_the_longest_branch_is_one_line(cli_main, tmp_path, capsys):
    assert cli_main(*COMMON, "callbacks.memory_planner.memory_limit_bytes=1000000", f"output_dir={tmp_path / 'run'}") != 0
    line = _one_error_line(capsys)
    assert line.startswith("error: callbacks.memory_planner: the memory available holds"), line
    assert "less than the longest branch (47 tokens)" in line
