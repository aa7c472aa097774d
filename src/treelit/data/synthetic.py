"""A synthetic agentic dataset that a tiny model can actually learn.

Each record is one agent episode exported per model call (token-level format): a
fixed system prompt shared by every episode, a user task, and turns in which the
assistant issues several concurrent tool calls, reads their results and answers.
The assistant's tokens follow rules a small model can pick up (a tool call echoes
the task in reverse, an answer copies the head of a tool result), so the training
loss visibly falls within a few hundred steps on CPU.

    python -m treelit.data.synthetic --out src/treelit/data/bundled/synthetic_agentic.jsonl.gz
    python -m treelit.data.synthetic --kind rollouts --n 64 --seed 1 --out src/treelit/data/bundled/synthetic_rollouts.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from typing import Dict, List, Tuple

import numpy as np

IM_START, IM_END = 1, 2
ROLE = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
CALL, ANSWER = 7, 8
FIRST_TEXT = 16


def _frame(role: str, body: List[int]) -> Tuple[List[int], List[int]]:
    ids = [IM_START, ROLE[role]] + body + [IM_END]
    train = role == "assistant"
    # the role header is context; the body and the end-of-turn token are targets
    return ids, [0, 0] + [int(train)] * (len(body) + 1)


def episode(rng: np.random.Generator, system: List[int], vocab: int) -> Dict:
    task = rng.integers(FIRST_TEXT, vocab, size=int(rng.integers(6, 12))).tolist()
    ctx: List[Tuple[List[int], List[int]]] = [_frame("system", system), _frame("user", task)]
    branches = []
    for turn in range(int(rng.integers(1, 4))):
        k = int(rng.integers(1, 4))
        calls = []
        for j in range(k):  # concurrent tool calls, one branch each
            call = _frame("assistant", [CALL, FIRST_TEXT + j] + task[::-1])
            result = rng.integers(FIRST_TEXT, vocab, size=int(rng.integers(20, 40))).tolist()
            answer = _frame("assistant", [ANSWER] + result[:8])
            calls.append((call, _frame("tool", result), answer))
        for call, result, answer in calls:
            branches.append(ctx + [call])  # the call that issued the tool call
            branches.append(ctx + [call, result, answer])  # the call that answered
        chosen = calls[int(rng.integers(k))]
        ctx = ctx + list(chosen) + [_frame("user", rng.integers(FIRST_TEXT, vocab, size=4).tolist())]
    out = []
    for br in branches:
        ids = [t for frame in br for t in frame[0]]
        # per-call export: train only the call's own (last) message
        mask = [0] * (len(ids) - len(br[-1][0])) + br[-1][1]
        out.append({"input_ids": ids, "loss_mask": mask})
    return {"branches": out}


def synthetic_agentic_records(n: int = 240, seed: int = 0, vocab: int = 512, system_len: int = 160) -> List[Dict]:
    rng = np.random.default_rng(seed)
    system = rng.integers(FIRST_TEXT, vocab, size=system_len).tolist()
    return [{"id": f"episode-{i}", **episode(rng, system, vocab)} for i in range(n)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--kind", choices=["agentic", "rollouts"], default="agentic")
    args = p.parse_args(argv)
    if args.kind == "agentic":
        recs = synthetic_agentic_records(args.n, args.seed, args.vocab)
    else:
        recs = rollout_group_records(args.n, seed=args.seed, vocab=args.vocab)
    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wt", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")



def rollout_group_records(n_prompts: int = 64, group: int = 8, seed: int = 1, vocab: int = 512) -> List[Dict]:
    """Synthetic GRPO rollout groups with known rewards.

    Each record is one prompt with ``group`` sampled completions (one branch each, trained
    on the completion). A completion earns reward 1 when its first token is even, else 0:
    a rule the policy can learn, so the probability of high-reward completions should rise
    relative to low-reward ones under GRPO.
    """
    rng = np.random.default_rng(seed)
    system = rng.integers(FIRST_TEXT, vocab, size=24).tolist()
    recs = []
    for i in range(n_prompts):
        prompt = [IM_START, ROLE["system"]] + system + [IM_END, IM_START, ROLE["user"]]
        prompt += rng.integers(FIRST_TEXT, vocab, size=8).tolist() + [IM_END, IM_START, ROLE["assistant"]]
        branches = []
        for _ in range(group):
            comp = rng.integers(FIRST_TEXT, vocab, size=6).tolist() + [IM_END]
            branches.append({
                "input_ids": prompt + comp,
                "loss_mask": [0] * len(prompt) + [1] * len(comp),
                "reward": float(comp[0] % 2 == 0),
                "group": f"prompt-{i}",
            })
        recs.append({"id": f"prompt-{i}", "branches": branches})
    return recs


if __name__ == "__main__":
    main()
