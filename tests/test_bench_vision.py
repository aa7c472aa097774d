"""``bench_vision.py --quick`` on a small GUI-agent shape: the three modes run, the tree encodes each
distinct screenshot once where the per-branch loops encode every one shown, and their gradients
agree with the tree step's."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_vision.py")


@pytest.mark.slow
def test_quick_run_writes_every_mode(tmp_path):
    out = tmp_path / "vision.json"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--width", "224", "--height", "112", "--turns", "4",
                           "--branch-at", "1,2", "--json", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    shape, rows = data["shape"], {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"tree", "branch", "hf"}
    # turns 0 shared, turn 1 split in two, turns 2-3 in four: 1 + 2 + 4 + 4 screenshots, 16 shown
    assert shape["branches"] == 4 and shape["distinct_images"] == 11 and shape["image_occurrences"] == 16
    assert rows["tree"]["images_encoded"] == 11 and rows["branch"]["images_encoded"] == rows["hf"]["images_encoded"] == 16
    assert rows["tree"]["tokens"] < rows["hf"]["tokens"]
    for r in rows.values():
        assert r["peak_bytes"] > 0 and r["max_rel_grad_diff"] < 1e-4, r
    assert "GUI-agent episode" in proc.stdout
    assert data["env"]["command"] == ("python benchmarks/bench_vision.py --quick --width 224 --height 112 --turns 4 "
                                      f"--branch-at 1,2 --json {out}")


@pytest.mark.slow
def test_quick_run_on_the_flagship_model(tmp_path):
    """``--family qwen3_5_moe --lora R``: the flagship's model with replayed routes and adapters;
    the tree and per-branch rows agree, the adapters and the tower train, and there is no transformers row."""
    out = tmp_path / "flagship.json"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--family", "qwen3_5_moe", "--lora", "4", "--width", "224",
                           "--height", "112", "--turns", "4", "--branch-at", "1,2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"tree", "branch"}
    assert data["model"]["routing"] == "replay" and data["model"]["lora_rank"] == 4
    assert data["model"]["vision_params"] < data["model"]["trained_params"] < data["model"]["params"]
    assert rows["tree"]["images_encoded"] == 11 and rows["branch"]["images_encoded"] == 16
    assert rows["branch"]["max_rel_grad_diff"] < 1e-4 and rows["branch"]["time_over_tree"] > 0
    assert "Qwen3.5-MoE-shaped" in proc.stdout and "MoE routes replayed" in proc.stdout
