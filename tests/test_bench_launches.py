"""``bench_launches.py --quick``: the launch/sync/upload counts of a few small trees, as the
benchmarks page's table is made (the full grid and ``--fla`` run by hand)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_counts_every_row_and_the_head(tmp_path):
    out = tmp_path / "launches.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_launches.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["family"], r["backend"]) for r in rows} == {(f, b) for f in ("attention", "hybrid")
                                                            for b in ("sdpa_dense", "segment", "segment/cuda")}
    assert all(r["launches"] > 50 for r in rows)
    assert all(r["syncs"] <= 8 and r["uploads"] <= 8 for r in rows if r["backend"] != "segment")
    fits = {(f["family"], f["backend"]): f for f in data["fits"]}
    assert abs(fits[("attention", "segment/cuda")]["b_per_segment"]) < 1e-9  # flat in segments on these trees
    head = {h["where"]: h for h in data["head"]}
    assert head["80 GiB device"]["sft"] <= 100 < head["cpu"]["sft"]
    assert "| head, 20,000 targets" in proc.stdout
