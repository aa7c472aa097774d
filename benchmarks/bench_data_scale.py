"""Start-up cost against data size: peak host memory and time to the first step.

Generates agentic-shaped token records (a shared system prompt, a task, several calls per
episode: about 400 flat tokens per record) at two sizes, 4M and 40M flat tokens (10,000
and 100,000 records, written once into ``--dir``), and runs ``treelit-train`` for two
steps on each, in a fresh process per run:

* ``data=stream``: records read lazily, trees built into a shuffle buffer (bounded memory);
* ``data=jsonl``: every tree built before the first step (``--in-memory`` adds these runs).

For each run it reports the process's peak resident memory (``wait4`` rusage), the time
from process start to the end of step 1 (a callback writes the time) and the wall time.
Defaults: the tiny default model, ``logger=none``, no checkpoints, one thread.

    python benchmarks/bench_data_scale.py --in-memory --json benchmarks/results/bench_data_scale.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

CALLBACK = '''
import time
import lightning.pytorch as pl

class FirstStep(pl.Callback):
    def __init__(self, path):
        self.path = path
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            with open(self.path, "w") as f:
                f.write(repr(time.time()))
'''


def generate(path: Path, n_records: int, seed: int = 0) -> int:
    """Write ``n_records`` records; returns the flat tokens written."""
    rng = np.random.default_rng(seed)
    system = rng.integers(16, 512, 60).tolist()
    flat = 0
    with open(path, "w") as f:
        for i in range(n_records):
            task = rng.integers(16, 512, 12).tolist()
            ctx = system + task
            branches = []
            for _ in range(3):
                call = rng.integers(16, 512, int(rng.integers(20, 40))).tolist()
                ids = ctx + call
                branches.append({"input_ids": ids, "loss_mask": [0] * len(ctx) + [1] * len(call)})
                ctx = ids + rng.integers(16, 512, 10).tolist()  # the tool result joins the context
            flat += sum(len(b["input_ids"]) for b in branches)
            f.write(json.dumps({"id": f"ep-{i}", "branches": branches}, separators=(",", ":")) + "\n")
    return flat


def run_once(args: List[str], workdir: Path) -> Dict[str, float]:
    marker = workdir / f"first-{time.time_ns()}"
    exe = str(Path(sys.executable).with_name("treelit-train"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(workdir), os.environ.get("PYTHONPATH", "")])}
    cmd = [exe, *args, "trainer.max_steps=2", "logger=none", "callbacks.checkpoint=null", "callbacks.progress=null",
           "trainer.enable_progress_bar=false", f"output_dir={workdir / 'out'}",
           "+callbacks.first._target_=first_step.FirstStep", f"+callbacks.first.path={marker}"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    first = float(marker.read_text()) - t0
    return {"peak_rss_mib": usage.ru_maxrss / 1024, "first_step_s": first, "wall_s": wall}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where the generated data goes (default: a temporary directory)")
    p.add_argument("--records", default="10000,100000")
    p.add_argument("--in-memory", action="store_true", help="also run data=jsonl (every tree built up front)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    work = Path(a.dir or tempfile.mkdtemp(prefix="treelit-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "first_step.py").write_text(CALLBACK)
    print(f"# tiny default model, 2 steps, one thread; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; data in {work}")
    print(f"{'data':<10} {'records':>8} {'flat tokens':>12} {'peak RSS':>10} {'first step':>11} {'wall':>7}")
    rows = []
    sizes = [int(x) for x in a.records.split(",")]
    for n in sizes:
        path = work / f"episodes-{n}.jsonl"
        meta = work / f"episodes-{n}.json"
        if not meta.exists():
            flat = generate(path, n)
            meta.write_text(json.dumps({"flat_tokens": flat}))
        flat = json.loads(meta.read_text())["flat_tokens"]
        modes = [("stream", ["data=stream", f"data.source.paths={path}"])]
        if a.in_memory:
            modes.append(("in-memory", ["data=jsonl", f"data.train_path={path}"]))
        for mode, opts in modes:
            r = run_once(opts, work)
            rows.append({"mode": mode, "records": n, "flat_tokens": flat, **r})
            print(f"{mode:<10} {n:>8} {flat / 1e6:>11.1f}M {r['peak_rss_mib']:>8.0f}Mi {r['first_step_s']:>10.1f}s "
                  f"{r['wall_s']:>6.1f}s", flush=True)
    for mode in ("stream", "in-memory"):
        mine = [r for r in rows if r["mode"] == mode]
        if len(mine) == 2:
            small, big = mine
            print(f"# {mode}: {big['flat_tokens'] / small['flat_tokens']:.0f}x the data -> peak RSS x"
                  f"{big['peak_rss_mib'] / small['peak_rss_mib']:.2f}, time to first step x"
                  f"{big['first_step_s'] / small['first_step_s']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "cpu_count": os.cpu_count()}, indent=2))


if __name__ == "__main__":
    main()
