"""``tree_builder.advantage=tree_node`` in the online loop, on tree-search rollouts.

``treelit-train experiment=rl_online`` trains while this script samples (synchronously: file i
from the weights after i updates, with ``treelit-rollout``'s sampler, in this process) a
tree-search rollout per prompt: ``--k`` samples of ``--segment`` tokens from the prompt, then
``--k`` samples continued from each of those, and so on for ``--depth`` levels: ``k**depth``
leaves per prompt, each scored with ``even_tokens`` (the share of even token ids of the
completion). The leaves of a prompt are one group; the trainer merges them into one tree
whose intermediate nodes are the shared segments, and gives each token its node's
advantage (``tree_node``: the node's mean leaf reward minus its parent's). The same run with
``tree_builder.advantage=grpo`` (each leaf's reward minus its group's mean) is the reference.

    python benchmarks/rl_tree_node_loop.py --json benchmarks/results/rl_tree_node_loop.json \\
        --png docs/img/rl_tree_node.png
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

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(Path(sys.executable).with_name("treelit-train"))


def tree_rollout(sampler, prompt, k, depth, segment, gen):
    """(completion tokens, their log-probs) of every leaf: k samples continued from each node."""
    nodes = [([], [])]
    for _ in range(depth):
        nodes = [(toks + c, lps + lp) for toks, lps in nodes
                 for c, lp in sampler._sample(list(prompt) + toks, k, segment, gen)]
    return nodes


def run(advantage: str, a, workdir: Path):
    import torch

    from treelit.cli.rollout import Sampler, read_prompts
    from treelit.rl.rewards import even_tokens

    rl = workdir / advantage
    out = rl / "rollouts"
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = [TRAIN, "experiment=rl_online", f"rl_dir={rl}", "logger=none", f"trainer.max_steps={a.steps}",
             f"tree_builder.advantage={advantage}", f"output_dir={rl / 'out'}", f"seed={a.seed}",
             "trainer.enable_progress_bar=false", "callbacks.progress=null", "callbacks.checkpoint=null",
             *a.override]
    t0 = time.time()
    trainer = subprocess.Popen(train, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    torch.set_num_threads(1)
    sampler = Sampler(str(rl / "policy"))
    prompts = read_prompts("rl_online_prompts.jsonl")[: a.prompts]
    rows = []
    for i in range(a.steps):
        while True:
            latest = sampler.latest()
            if latest is not None and latest["version"] >= i:
                break
            assert trainer.poll() is None, trainer.stderr.read()[-2000:]
            time.sleep(0.05)
        if latest["version"] != sampler.version:
            sampler.load(latest)
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + i)
        records, rewards = [], []
        for p in prompts:
            ids, key = p["input_ids"], f"{p['id']}@{i}"
            branches = []
            for toks, lps in tree_rollout(sampler, ids, a.k, a.depth, a.segment, gen):
                r = float(even_tokens(ids, toks))
                rewards.append(r)
                branches.append({"input_ids": ids + toks, "loss_mask": [0] * len(ids) + [1] * len(toks),
                                 "old_logprobs": [None] * len(ids) + lps, "reward": r, "group": key})
            records.append({"id": key, "policy_version": sampler.version, "branches": branches})
        tmp = out / f".step-{i:06d}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, out / f"step-{i:06d}.jsonl")
        rows.append({"step": i, "version": sampler.version, "t": round(time.time() - t0, 2),
                     "reward": sum(rewards) / len(rewards)})
    _, err = trainer.communicate()
    assert trainer.returncode == 0, err[-3000:]
    return {"advantage": advantage, "wall_s": round(time.time() - t0, 1), "files": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--k", type=int, default=4, help="samples continued from each node")
    ap.add_argument("--depth", type=int, default=2, help="levels of the search")
    ap.add_argument("--segment", type=int, default=3, help="tokens per level")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per file (of the 16 bundled)")
    ap.add_argument("--advantages", nargs="*", default=["tree_node", "grpo"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", nargs="*", default=[], help="more treelit-train overrides")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args()
    res = {"command": "python benchmarks/rl_tree_node_loop.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
           "load_avg_start": os.getloadavg()[0], "k": a.k, "depth": a.depth, "segment": a.segment, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for adv in a.advantages:
            r = run(adv, a, Path(tmp))
            res["runs"].append(r)
            f = r["files"]
            print(json.dumps({"advantage": adv, "wall_s": r["wall_s"], "first5": sum(x["reward"] for x in f[:5]) / 5,
                              "last5": sum(x["reward"] for x in f[-5:]) / 5}), flush=True)
    res["load_avg_end"] = os.getloadavg()[0]
    print("| step | " + " | ".join(r["advantage"] for r in res["runs"]) + " |")
    print("|---|" + "---|" * len(res["runs"]))
    for j in range(0, a.steps, 5):
        print(f"| {j} | " + " | ".join(f"{r['files'][j]['reward']:.3f}" for r in res["runs"]) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for r in res["runs"]:
            ax.plot([f["step"] for f in r["files"]], [f["reward"] for f in r["files"]], "o-", ms=3,
                    label=f"tree_builder.advantage={r['advantage']}")
        ax.set_xlabel("step (the file sampled from the weights after that many updates)")
        ax.set_ylabel("mean leaf reward of the file")
        ax.set_title(f"tree-search rollouts: {a.k} samples continued from each node, depth {a.depth}, "
                     f"{a.segment} tokens per level", fontsize=9)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(a.png, dpi=100)


if __name__ == "__main__":
    main()
