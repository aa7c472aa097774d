"""``bench_critic.py --quick``: the three paths (tree, treelit per branch, transformers with a
value head written without treelit) run one PPO + critic update each, agree on the loss and
every gradient, and the tree's peak is the smallest."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_critic.py")


def test_quick_run_compares_three_paths(tmp_path):
    out = tmp_path / "critic.json"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {r["path"]: r for r in data["rows"]}
    assert set(rows) == {"tree", "linear", "hf"}
    assert rows["tree"]["loss"] != 0
    for path in ("linear", "hf"):
        assert rows[path]["max_rel_grad_diff"] < 1e-4, path
        assert rows[path]["loss_rel_diff"] < 1e-4, path
        assert rows[path]["peak_bytes"] > 0 and len(rows[path]["times_s"]) == 1
    assert rows["tree"]["peak_bytes"] < rows["linear"]["peak_bytes"]
