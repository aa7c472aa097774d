"""``bench_compile.py --quick``: both copies step through two trees, one compile serves both, no
graph break, and the compiled copy's gradients equal the eager copy's."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_compile.py")


@pytest.mark.slow
def test_quick_run_compiles_once_and_matches_eager(tmp_path):
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["backend"] == "aot_eager" and len(data["rows"]) == 2
    assert data["frames_compiled"] == 1 and data["graph_breaks"] == 0
    for row in data["rows"]:
        assert row["max_abs_grad_diff"] <= 1e-6 and row["eager_s"] > 0 and row["compiled_s"] > 0
    assert "geometric mean speedup" in proc.stdout
