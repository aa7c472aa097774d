"""``segment_math_launches.py --quick``: one layer of ``segment``'s CUDA code path, counted on CPU,
dispatches the same number of kernels on trees of 5 to 121 segments, asks the host nothing, and
its plan uploads its indices once."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "segment_math_launches.py")


def test_quick_run_counts_flat_launches(tmp_path):
    out = tmp_path / "launches.json"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and max(r["segments"] for r in rows) >= 100
    assert len({r["launches"] for r in rows}) == 1, rows
    for r in rows:
        assert r["syncs"] == 0 and r["uploads"] == 0 and r["plan_uploads"] == 1, r
        assert r["pairs"] >= r["visible_pairs"] > 0
    assert "| grpo_64 |" in proc.stdout
