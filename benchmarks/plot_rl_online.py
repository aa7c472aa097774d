"""Plot an online RL run from its rollout files: mean reward per file against the policy
version it was sampled with, and each file's staleness (trainer version - policy version).

    python benchmarks/plot_rl_online.py rl_online/rollouts docs/img/rl_online_reward.png

Reads ``step-<i>.jsonl`` files (consumed, skipped or pending) as ``treelit-rollout`` writes
them; the trainer's version when it takes file i is taken to be i x ``--versions-per-step``
(one publish per file: ``ppo_epochs=1``, ``publish.every_n_steps=1``). Prints one line per file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_run(directory: Path, versions_per_step: int = 1):
    rows = []
    for p in sorted(directory.glob("step-*.jsonl*")):
        stem = p.name[5:].split(".")[0]
        if not stem.isdigit():
            continue
        i = int(stem)
        recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        rewards = [b["reward"] for r in recs for b in r["branches"]]
        version = min(r.get("policy_version", 0) for r in recs)
        rows.append({"step": i, "version": version, "reward": sum(rewards) / len(rewards),
                     "staleness": i * versions_per_step - version, "stale_skipped": p.name.endswith(".stale")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rollouts")
    ap.add_argument("out")
    ap.add_argument("--versions-per-step", type=int, default=1)
    ap.add_argument("--title", default="experiment=rl_online")
    a = ap.parse_args()
    rows = read_run(Path(a.rollouts), a.versions_per_step)
    for r in rows:
        print(json.dumps(r))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax1.plot([r["version"] for r in rows], [r["reward"] for r in rows], "o-", ms=3)
    ax1.set_ylabel("mean reward of the file")
    ax1.set_title(a.title)
    ax2.bar([r["version"] for r in rows], [r["staleness"] for r in rows], width=0.8)
    ax2.set_ylabel("staleness")
    ax2.set_xlabel("policy version the file was sampled with")
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)


if __name__ == "__main__":
    main()
