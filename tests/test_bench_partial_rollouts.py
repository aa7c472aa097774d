"""``bench_partial_rollouts.py --quick``: both modes sample the same completions (the same
drawn lengths); with partial rollouts the batch's slots stay fuller and fewer token steps run,
and tokens of an older version reach later files (the price, reported)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def test_quick_run_compares_whole_files_and_partial_rollouts(tmp_path):
    out = tmp_path / "partial.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_partial_rollouts.py"), "--quick", "--json",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["median"]}
    whole, partial = rows["whole"], rows["partial"]
    assert whole["completions"] == partial["completions"] == 4 * 2 * 2
    assert whole["tokens"] == partial["tokens"]  # the same drawn lengths
    assert partial["forwards"] < whole["forwards"] and partial["slot_idle_share"] < whole["slot_idle_share"]
    assert whole["tokens_beyond_max_staleness"] == 0
    assert "| 0.05 | 1 | partial |" in proc.stdout  # the docs' table


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [("rl_async_partial.py", ["--steps", "3", "--window", "2"]),
                                          ("rl_tree_node_loop.py", ["--steps", "2", "--prompts", "2"])])
def test_closed_loop_scripts_run(tmp_path, script, args):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), *args, "--json", str(out), "--png",
                           str(tmp_path / "r.png")], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(json.loads(out.read_text())["runs"]) == 2 and (tmp_path / "r.png").stat().st_size > 0
