"""``bench_step.py --tree-steps``: several tree steps per repetition, around the per-branch
step, so that both modes sample the machine over a similar stretch of time."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

from bench_step import tree_steps_per_rep  # noqa: E402


def test_auto_matches_the_per_branch_step_and_is_capped():
    assert tree_steps_per_rep("auto", 2.0, 9.1) == 5  # 4.55 tree steps last one per-branch step
    assert tree_steps_per_rep("auto", 2.0, 1.0) == 1  # never fewer than one
    assert tree_steps_per_rep("auto", 1.0, 100.0) == 8  # at most the cap
    assert tree_steps_per_rep("auto", 1.0, 100.0, cap=20) == 20
    assert tree_steps_per_rep("3", 1.0, 100.0) == 3  # a fixed count ignores the timings


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="--tree-steps"):
        tree_steps_per_rep(bad, 1.0, 1.0)


def run(tmp_path, *extra):
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(BENCH, "bench_step.py"), "--quick", "--scale", "0.01", "--cases", "multi_turn",
           "--no-peer", "--no-memory", "--preset", "head_heavy", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return proc, out


def test_each_repetition_times_k_tree_steps_and_reports_their_mean(tmp_path):
    proc, out = run(tmp_path, "--reps", "2", "--tree-steps", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    r = data["cases"][0]
    assert data["env"]["tree_steps"] == "3" and r["tree_steps_per_rep"] == 3
    steps = r["tree_step_times_s"]
    assert len(steps) == 6 and len(r["times_s"]["tree"]) == 2 and len(r["times_s"]["linear"]) == 2
    assert r["times_s"]["tree"] == pytest.approx([sum(steps[:3]) / 3, sum(steps[3:]) / 3])
    assert r["efficiency"] == pytest.approx(r["time_linear_s"] / r["time_tree_s"] / r["ideal_compute"])
    # each repetition's own ratio, in order, and the table's range column
    assert r["efficiency_reps"] == pytest.approx([lin / tr / r["ideal_compute"]
                                                  for lin, tr in zip(r["times_s"]["linear"], r["times_s"]["tree"])])
    lo, hi = min(r["efficiency_reps"]), max(r["efficiency_reps"])
    assert f"{lo:.2f}-{hi:.2f}" in proc.stdout
    assert r["max_rel_grad_diff"] < 1e-3


def test_bad_tree_steps_fail_before_any_work(tmp_path):
    proc, out = run(tmp_path, "--tree-steps", "0")
    assert proc.returncode == 2 and "--tree-steps must be 'auto' or >= 1" in proc.stderr
    assert not out.exists()
