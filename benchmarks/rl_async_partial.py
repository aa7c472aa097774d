"""The closed loop: synchronous training against asynchronous training with partial rollouts
and ``max_staleness=2``, on ``experiment=rl_online``, reward against wall time.

Two runs of ``treelit-train experiment=rl_online`` with ``treelit-rollout`` (two processes,
one CPU thread each, ``--steps`` steps):

* ``sync``: ``treelit-rollout --max-staleness 0``: file i is sampled from the weights after i
  updates; sampling and training take turns.
* ``async``: ``treelit-rollout --partial --max-staleness 2`` and ``data.max_staleness=2
  data.staleness_policy=drop_tokens``: the sampler runs up to two versions ahead, and
  generations in flight continue under each new version.

Each file's mean reward is taken at the time the file was written (seconds since both
processes started). The run's curve is the mean over the last ``--window`` files; the
synchronous run's final reward is the mean of its last ``--window`` files, and each run's time
to reach it is the first file at which its curve does. Writes a JSON of both runs, a
markdown table and a PNG plot (matplotlib).

    python benchmarks/rl_async_partial.py --json benchmarks/results/rl_async_partial.json \\
        --png docs/img/rl_async_partial.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = str(Path(sys.executable).with_name("treelit-train"))


def run(name: str, steps: int, workdir: Path, partial: bool, staleness: int, seed: int):
    rl = workdir / name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = [TRAIN, "experiment=rl_online", f"rl_dir={rl}", "logger=none", f"trainer.max_steps={steps}",
             f"data.max_staleness={max(staleness, 1)}", "data.staleness_policy=drop_tokens", f"output_dir={rl / 'out'}",
             f"seed={seed}", "trainer.enable_progress_bar=false", "callbacks.progress=null", "callbacks.checkpoint=null"]
    work = [sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"), "--out", str(rl / "rollouts"),
            "--prompts", "rl_online_prompts.jsonl", "--reward", "even_tokens", "--n", "8", "--max-new-tokens", "6",
            "--steps", str(steps), "--max-staleness", str(staleness), "--seed", str(seed)] + (["--partial"] if partial else [])
    t0 = time.time()
    trainer = subprocess.Popen(train, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker = subprocess.run(work, cwd=workdir, env=env, capture_output=True, text=True)
    _, err = trainer.communicate()
    wall = time.time() - t0
    assert trainer.returncode == 0 and worker.returncode == 0, (err[-2000:], worker.stderr[-2000:])
    files = []
    for p in sorted((rl / "rollouts").glob("step-*.jsonl*")):
        recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        rewards = [b["reward"] for r in recs for b in r["branches"]]
        versions = [v for r in recs for b in r["branches"] for v in b.get("policy_versions") or [] if v is not None]
        files.append({"step": int(p.name[5:11]), "t": round(p.stat().st_mtime - t0, 3),
                      "reward": sum(rewards) / len(rewards), "versions": [min(versions), max(versions)] if versions else None,
                      "mixed_branches": sum(1 for r in recs for b in r["branches"]
                                            if len({v for v in b.get("policy_versions") or [] if v is not None}) > 1)})
    summary = json.loads((rl / "out" / "summary.json").read_text())
    return {"name": name, "partial": partial, "max_staleness": staleness, "wall_s": round(wall, 2), "files": files,
            "dropped_tokens_last": summary.get("metrics", {}).get("staleness/tokens_dropped")}


def curve(files, window):
    out = []
    for j in range(len(files)):
        w = files[max(0, j - window + 1): j + 1]
        out.append(sum(f["reward"] for f in w) / len(w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args()
    res = {"command": "python benchmarks/rl_async_partial.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
           "load_avg_start": os.getloadavg()[0], "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, partial, s in (("sync", False, 0), ("async", True, 2)):
            r = run(name, a.steps, Path(tmp), partial, s, a.seed)
            res["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "files"}), flush=True)
    res["load_avg_end"] = os.getloadavg()[0]
    sync = res["runs"][0]
    target = sum(f["reward"] for f in sync["files"][-a.window:]) / a.window
    res["target"] = target
    print(f"target: the sync run's last {a.window} files' mean reward {target:.3f}")
    print("| run | wall s | final reward (last 5 files) | time to the sync run's final reward | files with a branch "
          "sampled under two versions |")
    print("|---|---|---|---|---|")
    for r in res["runs"]:
        c = curve(r["files"], a.window)
        hit = next((f["t"] for f, v in zip(r["files"], c) if v >= target - 1e-9), None)
        r["t_target"] = hit
        r["final"] = c[-1]
        print(f"| {r['name']} | {r['wall_s']:.0f} | {c[-1]:.3f} | {'not reached' if hit is None else f'{hit:.0f} s'} "
              f"| {sum(1 for f in r['files'] if f['mixed_branches'])} of {len(r['files'])} |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for r in res["runs"]:
            label = f"{r['name']} (max_staleness {r['max_staleness']}{', partial' if r['partial'] else ''})"
            line, = ax.plot([f["t"] for f in r["files"]], curve(r["files"], a.window), "-", label=label)
            ax.plot([f["t"] for f in r["files"]], [f["reward"] for f in r["files"]], ".", ms=3, color=line.get_color(),
                    alpha=0.5)
        ax.axhline(target, color="grey", lw=0.8, ls="--", label="sync final reward")
        ax.set_xlabel("wall time (s), trainer and sampler started at 0")
        ax.set_ylabel(f"mean reward of a file ({a.window}-file mean)")
        ax.set_title(f"experiment=rl_online, {a.steps} steps, 2 processes on CPU")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(a.png, dpi=100)


if __name__ == "__main__":
    main()
