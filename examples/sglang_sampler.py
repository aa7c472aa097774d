"""A rollout sampler for treelit's online RL loop, on an SGLang server.

    python examples/sglang_sampler.py --url http://127.0.0.1:30000 --prompts prompts.jsonl \
        --out rl/rollouts --steps 100 --n 8 --max-new-tokens 256 --max-staleness 1

The trainer (``treelit-train data=rollouts publish.dir=... publish.hooks={sglang:...}``) tells the
server about each policy version it publishes (``/update_weights_from_disk`` with the version as
``weight_version``). This script, for each training step i:

1. waits until the server's weight version is at least i - ``--max-staleness`` (the version the
   trainer holds when it takes file i, with one version per step);
2. samples ``--n`` completions of every prompt at temperature 1 (no top-p / top-k, so the
   log-probs are the policy's own) through SGLang's native ``/generate``, with the log-prob of
   every sampled token;
3. scores each completion with ``reward`` below (replace it with your own);
4. writes ``<out>/step-<i>.jsonl`` (one record per prompt, one branch per completion, the
   completions of a prompt in one ``group``, ``policy_version`` the version that served them)
   under a hidden name, then renames it, so the trainer never reads half a file.

Prompts: JSONL records ``{"id": ..., "input_ids": [token ids]}``; their other fields reach the reward.
Restarted, it continues after the files already in ``--out``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path


def reward(prompt_ids, completion_ids, **fields):
    """The toy task's reward: the share of even token ids in the completion."""
    return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)


def call(url, route, body=None, timeout=600):
    """GET (``body`` None) or POST JSON to the server; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as res:
        return json.loads(res.read())


def server_version(url):
    """The server's weight version as an int, or None before the trainer's first update
    (SGLang starts at "default"). Newer SGLang reports it in /model_info, older in /get_weight_version."""
    for route in ("/model_info", "/get_weight_version"):
        try:
            version = call(url, route, timeout=30).get("weight_version")
        except OSError:
            continue
        try:
            return int(version)
        except (TypeError, ValueError):
            return None
    return None


def next_step(out):
    """The first step without a file in ``out`` (files the trainer consumed or skipped count)."""
    done = [int(p.name.split(".")[0][5:]) for p in out.glob("step-*.jsonl*") if p.name.split(".")[0][5:].isdigit()]
    return max(done) + 1 if done else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the SGLang server (the hook's url)")
    p.add_argument("--prompts", required=True, help="JSONL of {id, input_ids}")
    p.add_argument("--out", required=True, help="the trainer's data.directory")
    p.add_argument("--steps", type=int, required=True, help="files to write (training steps)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (a group)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-staleness", type=int, default=1, help="versions the sampler may run ahead (0: synchronous)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="how long to wait for a version")
    a = p.parse_args(argv)

    prompts = [json.loads(line) for line in open(a.prompts) if line.strip()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(next_step(out), a.steps):
        need, t0 = max(0, i - a.max_staleness), time.monotonic()
        while True:
            version = server_version(a.url)
            if version is not None and version >= need:
                break
            if time.monotonic() - t0 > a.timeout_s:
                raise SystemExit(f"error: {a.url}: no weight version >= {need} within {a.timeout_s:g}s")
            time.sleep(0.2)
        # one batch: each prompt n times, so the answers come back in that order
        batch = [rec["input_ids"] for rec in prompts for _ in range(a.n)]
        outs = call(a.url, "/generate", {
            "input_ids": batch, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": a.max_new_tokens}})
        version = min(int(o["meta_info"]["weight_version"]) for o in outs)  # an update may land mid-batch
        records, rewards = [], []
        for j, rec in enumerate(prompts):
            fields = {k: v for k, v in rec.items() if k not in ("id", "input_ids")}
            prompt, group = rec["input_ids"], f"{rec.get('id', j)}@{i}"
            branches = []
            for o in outs[j * a.n:(j + 1) * a.n]:
                completion = o["output_ids"]
                logprobs = [lp for lp, _tok, _text in o["meta_info"]["output_token_logprobs"]]
                r = float(reward(prompt, completion, **fields))
                rewards.append(r)
                branches.append({"input_ids": prompt + completion,
                                 "loss_mask": [0] * len(prompt) + [1] * len(completion),
                                 "old_logprobs": [None] * len(prompt) + logprobs, "reward": r, "group": group})
            records.append({"id": group, "policy_version": version, "branches": branches})
        name = f"step-{i:06d}.jsonl"
        tmp = out / f".{name}.tmp"  # the trainer's pattern (*.jsonl) does not match it
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, out / name)
        print(json.dumps({"step": i, "policy_version": version, "reward_mean": sum(rewards) / len(rewards)}),
              flush=True)


if __name__ == "__main__":
    main()
