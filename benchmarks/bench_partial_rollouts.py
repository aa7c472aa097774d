"""Partial rollouts: the sampler's idle time and rollouts per minute with and without them,
on a long-tailed distribution of generation lengths.

The sampler is ``treelit-rollout``'s, in this process, on the ``experiment=rl_online`` model
(tiny, vocabulary 16, float32 on CPU, one thread). Each file holds ``--groups`` prompts x
``--n`` completions. A completion's length is drawn from a long-tailed distribution
(log-normal, median ``--median`` tokens, sigma ``--sigma``, capped at ``--max-new-tokens``;
the same draws in both modes): it ends there (EOS is not used).

The trainer is simulated (stated in the results): a thread that takes file k once it is
written and the previous step is done, "trains" for ``--train-s`` seconds (a sleep: it uses no
CPU), and publishes version k+1 (the real publisher, other weights) — the trainer's version
when it takes file k is k, as in the online loop with one publish per file. Both modes keep
the same staleness bound: no token for file i before version i - ``--max-staleness``.

* ``whole``: without partial rollouts (today's ``treelit-rollout``): file i waits for the bound,
  loads the newest version, starts its ``--groups`` groups together and samples until the
  longest completion ends; every token of the file is of one version.
* ``partial``: ``treelit-rollout --partial`` (:mod:`treelit.cli.rollout_partial`): the groups in
  flight continue under each new version; a done group's slots take the next prompt at once;
  file i is written when ``--groups`` groups are done.

Both sample with the same engine (one batched forward per token over the unfinished
completions, prefixes recomputed), so the difference is the scheduling. Reported per mode:
wall time, rollouts (completions) per minute, the sampler's idle seconds (waiting for a
version it may sample with), the slots' idle share (completion slots of the batch left empty
while it waits for its longest completion: 1 - tokens / (slots x token steps)), the
trainer's idle seconds (waiting for a file), the token steps run (one batched decode of the
completions in flight each; ``forwards`` in the JSON), and the trained tokens'
mean staleness and share more than ``--max-staleness`` versions behind when their file is
taken (a long generation spans the versions published while it runs: its head is what
``data.staleness_policy=drop_tokens`` would take out of the loss).

    OMP_NUM_THREADS=1 python benchmarks/bench_partial_rollouts.py --json benchmarks/results/bench_partial_rollouts.json
    python benchmarks/bench_partial_rollouts.py --quick      # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from treelit.cli.rollout import Sampler, _args, read_prompts  # noqa: E402
from treelit.cli.rollout_partial import Pool, run_partial, write_file  # noqa: E402
from treelit.lightning.publish import PolicyPublisher  # noqa: E402
from treelit.rl.rewards import resolve_reward  # noqa: E402

TINY = dict(num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=192, vocab_size=16)


class Trainer(threading.Thread):
    """Takes file k when it is written and step k-1 is done, sleeps ``train_s``, publishes k+1."""

    def __init__(self, out: Path, pub: PolicyPublisher, model, steps: int, train_s: float) -> None:
        super().__init__(daemon=True)
        self.out, self.pub, self.model, self.steps, self.train_s = out, pub, model, steps, train_s
        self.idle, self.taken, self.error = 0.0, {}, None

    def run(self) -> None:
        try:
            for k in range(self.steps):
                t0 = time.monotonic()
                path = self.out / f"step-{k:06d}.jsonl"
                while not path.exists():
                    time.sleep(0.002)
                self.idle += time.monotonic() - t0
                self.taken[k] = path
                time.sleep(self.train_s)
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(torch.randn_like(p), alpha=1e-3)
                self.pub.publish(self.model, k + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc


def lengths(a):
    """stop_at(group, row): the completion's drawn length (the same for both modes)."""
    def stop_at(group, row):
        g = torch.Generator().manual_seed(1_000_003 * group.serial + row + 7)
        z = float(torch.randn(1, generator=g))
        return max(1, min(a.max_new_tokens, int(round(a.median * math.exp(a.sigma * z)))))
    return stop_at


def whole(a, worker, stop_at, log):
    """Without partial rollouts: each file's groups start together under one version."""
    out = Path(worker.out)
    sampler = Sampler(worker.publish_dir, "float32")
    reward = resolve_reward(worker.reward)
    prompts = [json.loads(line) for line in Path(worker.prompts).read_text().splitlines()]
    pool = Pool(sampler, a.n, a.max_new_tokens, torch.Generator().manual_seed(0), stop_at)
    started = 0
    for i in range(a.steps):
        t0 = time.monotonic()
        need = max(0, i - a.max_staleness)
        while True:
            latest = sampler.latest()
            if latest is not None and latest["version"] >= need:
                break
            time.sleep(worker.poll_s)
        waited = time.monotonic() - t0
        if latest["version"] != sampler.version:
            sampler.load(latest)
        for _ in range(a.groups):
            p = prompts[started % len(prompts)]
            pool.add(f"{p['id']}@{started}", p["input_ids"], {})
            started += 1
        seen = (pool.row_steps, pool.forwards)
        while pool.flight:
            pool.step()
        groups, pool.done = pool.done, []
        rewards, _ = write_file(out, i, groups, reward)
        log({"step": i, "wait_s": waited, "completions": len(rewards), "tokens": pool.row_steps - seen[0],
             "forwards": pool.forwards - seen[1]})


def one(a, mode: str, tmp: Path):
    d = tmp / f"{mode}-s{a.max_staleness}"
    d.mkdir(parents=True)
    torch.manual_seed(0)
    import treelit

    model = treelit.build_model("qwen2_5_tiny", **TINY)
    pub = PolicyPublisher(d / "policy", dtype="float32", keep=4)
    pub.publish(model, 0)
    prompts = d / "prompts.jsonl"
    g = torch.Generator().manual_seed(0)
    prompts.write_text("".join(json.dumps({"id": f"p{j}", "input_ids": torch.randint(0, 16, (4,), generator=g).tolist()})
                               + "\n" for j in range(16)))
    (d / "out").mkdir()
    worker = _args(["--publish-dir", str(d / "policy"), "--prompts", str(prompts), "--out", str(d / "out"),
                    "--n", str(a.n), "--max-new-tokens", str(a.max_new_tokens), "--reward", "even_tokens",
                    "--steps", str(a.steps), "--max-staleness", str(a.max_staleness), "--prompts-per-step",
                    str(a.groups), "--poll-s", "0.002", "--partial"])
    trainer = Trainer(d / "out", pub, model, a.steps, a.train_s_now)
    rows, stop_at = [], lengths(a)
    trainer.start()
    t0 = time.monotonic()
    if mode == "partial":
        run_partial(worker, 0, Sampler, read_prompts, stop_at=stop_at, log=rows.append)
    else:
        whole(a, worker, stop_at, rows.append)
    wall = time.monotonic() - t0
    trainer.join()
    if trainer.error:
        raise trainer.error
    tokens = stale = lag = 0
    for k, path in trainer.taken.items():
        for line in path.read_text().splitlines():
            for br in json.loads(line)["branches"]:
                vs = [v for v in br["policy_versions"] if v is not None]
                tokens += len(vs)
                stale += sum(1 for v in vs if k - v > a.max_staleness)
                lag += sum(k - v for v in vs)
    done = sum(r["completions"] for r in rows)
    slots, toks, fwd = a.groups * a.n, sum(r["tokens"] for r in rows), sum(r["forwards"] for r in rows)
    return {"mode": mode, "train_s": a.train_s_now, "max_staleness": a.max_staleness, "wall_s": round(wall, 3),
            "rollouts_per_min": round(60 * done / wall, 1), "sampler_idle_s": round(sum(r["wait_s"] for r in rows), 3),
            "sampler_idle_share": round(sum(r["wait_s"] for r in rows) / wall, 3),
            "slot_idle_share": round(1 - toks / (slots * fwd), 3),
            "forwards": fwd, "tokens": toks, "trainer_idle_s": round(trainer.idle, 3),
            "token_staleness_mean": round(lag / max(tokens, 1), 3),
            "tokens_beyond_max_staleness": round(stale / max(tokens, 1), 4), "completions": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--groups", type=int, default=8, help="prompts per file")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--median", type=float, default=6.0, help="median completion length (tokens)")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the length")
    ap.add_argument("--train-s", type=float, nargs="*", default=[0.1, 0.3], help="the simulated trainer's seconds per step")
    ap.add_argument("--staleness", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3, help="runs per case (the table: medians; modes alternate)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.steps, a.groups, a.n, a.max_new_tokens, a.train_s, a.staleness, a.reps = 4, 2, 2, 24, [0.05], [1], 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    res = {"command": "python benchmarks/bench_partial_rollouts.py " + " ".join(sys.argv[1:]),
           "trainer": "simulated: train_s per step (a sleep), then a real publish", "steps": a.steps,
           "groups": a.groups, "n": a.n, "max_new_tokens": a.max_new_tokens, "median": a.median, "sigma": a.sigma,
           "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
           "load_avg": os.getloadavg()[0], "reps": a.reps, "median": [], "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for train_s in list(a.train_s):
            for s in a.staleness:
                a.max_staleness, a.train_s_now = s, train_s
                runs = {"whole": [], "partial": []}
                for rep in range(a.reps):
                    for mode in ("whole", "partial") if rep % 2 == 0 else ("partial", "whole"):
                        r = one(a, mode, Path(tmp) / f"t{train_s}-r{rep}")
                        runs[mode].append(r)
                        res["runs"].append(r)
                        print(json.dumps(r), flush=True)
                for mode, rs in runs.items():
                    res["median"].append({k: statistics.median(r[k] for r in rs) if isinstance(v, (int, float)) else v
                                          for k, v in rs[0].items()})
    print("| trainer s/step | max_staleness | mode | wall s | rollouts/min | sampler idle s (share) | slots idle "
          "| token steps | trainer idle s | token staleness mean | tokens > max_staleness |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["median"]:
        print(f"| {r['train_s']:g} | {r['max_staleness']:g} | {r['mode']} | {r['wall_s']:.2f} | {r['rollouts_per_min']:.0f} "
              f"| {r['sampler_idle_s']:.2f} ({r['sampler_idle_share']:.0%}) | {r['slot_idle_share']:.0%} | {r['forwards']:g} "
              f"| {r['trainer_idle_s']:.2f} | {r['token_staleness_mean']:.2f} | {r['tokens_beyond_max_staleness']:.0%} |")
    res["load_avg_end"] = os.getloadavg()[0]
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
