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
    # the verdict against the 10%, as computed from the step's own figures
    assert step["within_10pct"] == (abs(step["measured_over_predicted"] - 1) <= 0.10)
    assert planner["prediction_within_10pct"] == all(s["within_10pct"] for s in planner["steps"])
    assert ("PASS" if planner["prediction_within_10pct"] else "FAIL") + " (predicted peak within 10%)" in res.stdout
    assert "gpu_bench:" in res.stdout and "of a 420 s budget" in res.stdout


def _bench():
    sys.path.insert(0, str(BENCH))
    import gpu_bench

    return gpu_bench


def test_adamw_states_exist_before_the_resident_memory_is_measured():
    """The planner row measures the resident state after AdamW's states are made (they are made
    lazily in the first step otherwise): every parameter has them, and no weight moved."""
    import torch

    gb = _bench()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = gb.init_adamw_states(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    for p in model.parameters():
        st = opt.state[p]
        assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape and p.grad is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert opt.param_groups[0]["weight_decay"] == 0.1


def test_a_row_starts_only_with_the_time_it_needs_and_a_run_of_skipped_rows_ends_cleanly(tmp_path, capsys):
    gb = _bench()
    args = gb.parse(["--row-reserve-s", "40", "--fla-reserve-s", "240"])
    assert gb.row_need("qwen3_1.7b", {}, args) == 40
    assert gb.row_need("qwen3_1.7b", {"qwen3_0.6b": 30.0, "": 90.0}, args) == 90  # not run yet: the previous row's
    assert gb.row_need("qwen3_0.6b", {"qwen3_0.6b": 70.0, "": 10.0}, args) == 70  # its own last row's
    assert gb.row_need("qwen3.5_0.8b ssm=fla", {"": 90.0}, args) == 240
    # no budget at all: every row is skipped, and the run still writes its JSON and its last line
    assert gb.main(gb.parse(["--dry-run", "--budget-s", "0", "--out", str(tmp_path)]), str(tmp_path / "cache")) == 0
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert len(data["rows"]) == len(gb.ORDER) and all("time budget" in r["skipped"] for r in data["rows"])
    assert data["elapsed_s"] >= 0 and data["compile_cache_bytes"] == 0
    assert "gpu_bench: " in capsys.readouterr().out
