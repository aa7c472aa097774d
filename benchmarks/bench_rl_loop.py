"""The online RL loop's time per step, and what publishing a policy costs.

Part 1 runs ``treelit-train experiment=rl_online`` and ``treelit-rollout`` as two processes
for ``--steps`` steps, synchronous (``--max-staleness 0``) and asynchronous (1, 2), and
splits each step's time (median over the steps after the first two):

* worker: ``sample`` (sampling the file), ``wait`` (waiting for the version it needs),
  ``load`` (loading a new version);
* trainer: ``wait`` (from the previous publish to the file being read and built: waiting
  for data), ``train`` (the step's update(s)), ``publish`` (writing the version);
* ``wall/step``: the trainer's wall time per step.

The trainer's pieces come from the timestamps of its log (``<output_dir>/train.log``:
"step k: <file>" when the file is read, "published version k ... (Xs" after the publish).

Part 2 publishes random-init models of the tiny sizes and of the ``qwen3_0_6b`` shape
(bfloat16 and float32) with :class:`~treelit.lightning.publish.PolicyPublisher` and reports
seconds and bytes (median of ``--repeats``), including the fsyncs.

    OMP_NUM_THREADS=1 python benchmarks/bench_rl_loop.py --json benchmarks/results/bench_rl_loop.json

Both processes use one CPU thread each; on a shared machine the other processes' load
shows in the numbers (state the machine with them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

TRAIN = str(Path(sys.executable).with_name("treelit-train"))
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def _t(line: str) -> float:
    return datetime.strptime(STAMP.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def trainer_times(log: Path):
    """Per step k >= 1: (wait, train, publish) seconds from the trainer's log."""
    loaded, published = {}, {}
    for line in log.read_text().splitlines():
        if not STAMP.match(line):
            continue
        m = re.search(r"\] - step (\d+): step-", line)
        if m:
            loaded[int(m.group(1))] = _t(line)
        m = re.search(r"published version (\d+) to .* \(([\d.]+)s,", line)
        if m:
            published[int(m.group(1))] = (_t(line), float(m.group(2)))
    out = []
    for k in sorted(loaded):
        if k in published and k - 1 in published:
            t_pub, pub_s = published[k]
            out.append({"wait": loaded[k] - published[k - 1][0], "train": t_pub - pub_s - loaded[k], "publish": pub_s})
    return out


def loop(staleness: int, steps: int, workdir: Path):
    rl = workdir / f"s{staleness}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    trainer = subprocess.Popen([TRAIN, "experiment=rl_online", f"rl_dir={rl}", "logger=none", f"trainer.max_steps={steps}",
                                f"data.max_staleness={max(staleness, 1)}", f"output_dir={rl / 'out'}",
                                "trainer.enable_progress_bar=false", "callbacks.progress=null", "callbacks.checkpoint=null"],
                               cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.run([sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"),
                             "--out", str(rl / "rollouts"), "--prompts", "rl_online_prompts.jsonl", "--reward",
                             "even_tokens", "--n", "8", "--max-new-tokens", "6", "--steps", str(steps),
                             "--max-staleness", str(staleness)], cwd=workdir, env=env, capture_output=True, text=True)
    assert trainer.wait() == 0 and worker.returncode == 0, worker.stderr[-2000:]
    total = time.monotonic() - t0
    w = [json.loads(line) for line in worker.stdout.splitlines() if line.startswith("{")][2:]
    t = trainer_times(rl / "out" / "train.log")[2:]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"max_staleness": staleness, "steps": steps, "total_s": total,
            "worker": {k: med([r[f"{k}_s"] for r in w]) for k in ("sample", "wait", "load")},
            "trainer": {k: med([r[k] for r in t]) for k in ("wait", "train", "publish")},
            "wall_per_step": med([r["wait"] + r["train"] + r["publish"] for r in t]),
            "reward_last": w[-1]["reward_mean"] if w else None}


def publish_cost(preset: str, dtype: str, repeats: int, workdir: Path, **config):
    import torch

    import treelit
    from treelit.lightning.publish import PolicyPublisher

    torch.manual_seed(0)
    model = treelit.build_model(preset, **config)
    params = sum(p.numel() for p in model.parameters())
    pub = PolicyPublisher(workdir / f"pub-{preset}-{dtype}", dtype=dtype, keep=1)
    pub.prepare()
    secs, size = [], 0
    for v in range(repeats):
        r = pub.publish(model, v)
        secs.append(r.seconds)
        size = r.bytes
    del model
    name = preset if preset != "qwen2_5_tiny" else f"tiny (vocab {config.get('vocab_size')})"
    return {"model": name, "params": params, "dtype": dtype, "seconds": statistics.median(secs), "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--staleness", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {"loop": [], "publish": [], "threads": 1, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not a.skip_loop:
            for s in a.staleness:
                r = loop(s, a.steps, tmp)
                out["loop"].append(r)
                print(json.dumps(r), flush=True)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        tiny = dict(num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=192)  # model=tiny
        cases = [("qwen2_5_tiny", {**tiny, "vocab_size": 16}),  # experiment=rl_online's model
                 ("qwen2_5_tiny", {**tiny, "vocab_size": 512}),  # model=tiny
                 ("qwen3_0_6b", {})]
        for preset, cfg in cases:
            for dtype in ("bfloat16", "float32"):
                r = publish_cost(preset, dtype, a.repeats, tmp, **cfg)
                out["publish"].append(r)
                print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
