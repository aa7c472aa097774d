"""``bench_lora.py --quick``: the six modes run, their memory splits add up, LoRA leaves the base
without gradients or optimizer state, every mode's gradients agree, and publishing writes an
adapter much smaller than the merged weights."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_lora.py")


def test_quick_run_writes_every_mode_and_the_publishing_rows(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--publish-dtypes", "bfloat16", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {(r["training"], r["path"]): r for r in data["rows"]}
    assert set(rows) == {(t, p) for t in ("full", "lora") for p in ("tree", "linear", "hf")}
    for (training, path), r in rows.items():
        assert r["params_bytes"] + r["grads_bytes"] + r["adamw_bytes"] + r["act_bytes"] == r["peak_bytes"]
        assert r["act_bytes"] > 0 and len(r["times_s"]) == 1
        if path != "tree":
            assert r["max_rel_grad_diff"] < 1e-4, (training, path)
    full, lora = rows["full", "tree"], rows["lora", "tree"]
    assert full["grads_bytes"] == full["params_bytes"] and full["adamw_bytes"] >= 2 * full["params_bytes"]
    # only the adapters train: gradients and AdamW state of a few percent of the model
    assert lora["grads_bytes"] < 0.1 * lora["params_bytes"]
    assert lora["adamw_bytes"] < 2.5 * lora["grads_bytes"]
    assert lora["peak_lora_over_full"] < 1.0
    (pub,) = data["publish"]
    assert pub["dtype"] == "bfloat16" and pub["adapter_bytes"] * 5 < pub["merged_bytes"]
    assert "adapter_model.safetensors" in pub["files"]["adapter"] and "config.json" in pub["files"]["merged"]
    assert "LoRA tree step against the transformers + PEFT loop" in proc.stdout and "publish" in proc.stdout
