"""benchmarks/gpu_bench.py without a GPU: ``--dry-run`` goes through every row's setup on CPU with tiny
shapes (models built from their configs, the trees, the transformers peer, AdamW, the timed steps, the
memory planner under a memory cap), so that nothing is tried for the first time on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_dry_run_sets_up_and_steps_every_row(tmp_path):
    sys.path.insert(0, str(BENCH))
    from gpu_bench import ORDER

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(BENCH / "gpu_bench.py"), "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert data["dry_run"] and data["budget_s"] == 420
    rows = data["rows"]
    assert [(r.get("row", r["model"]), r["tree"]) for r in rows] == ORDER
    for r in rows:
        if r.get("planner"):
            continue
        if "ssm=fla" in r["model"]:  # fla's kernels need CUDA: the row says so
            assert "ssm=fla needs CUDA" in r["error"], r
            continue
        assert "error" not in r and not any(k.startswith("error_") for k in r), r
        for mode in ("tree", "linear", "hf"):
            assert r[f"time_{mode}_s"] > 0 and r[f"tokens_per_s_{mode}"] > 0 and r[f"mfu_{mode}"] > 0, (r, mode)
            assert r[f"loss_{mode}"] > 0, (r, mode)
        assert r["loss_rel_diff_tree_linear"] < 1e-2 and r["loss_rel_diff_tree_hf"] < 2e-2, r  # bfloat16
        assert r["ideal_compute"] > 1 and r["flat_tokens"] > r["tree_tokens"]
    deep = next(r for r in rows if r["tree"] == "agent_deep_27")
    assert deep["por"] >= 0.8  # the deep agent tree's shape survives the tiny scale
    planner = next(r for r in rows if r.get("planner"))
    assert planner["planner"] and "error" not in planner, planner
    step = planner["steps"][0]
    assert step["partitions"] > 1 and step["chain_tokens"] <= step["budget"]  # capped: the tree is cut
    assert step["loss"] > 0 and step["measured_peak_bytes"] > 0 and step["predicted_peak_bytes"] > 0
    assert "gpu_bench:" in res.stdout and "of a 420 s budget" in res.stdout
