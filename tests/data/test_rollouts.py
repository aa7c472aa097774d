"""Online rollouts from a watched directory: three files dropped while ``treelit-train`` runs give
three steps, each trained on its file (``ppo_epochs`` passes with the files' rollout log-probs),
exactly as a hand-written loop over the same files; each file is marked consumed once trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import treelit
from app_helpers import SMALL
from helpers import tiny_model
from treelit.objectives import make_objective

EXE = str(Path(sys.executable).with_name("treelit-train"))


def rollout_file(step: int, rng) -> list:
    """A GRPO-style batch: 2 prompts x 3 completions, advantages and sampling log-probs per token."""
    recs = []
    for p in range(2):
        prompt = rng.integers(1, 11, 4).tolist()
        branches = []
        for _ in range(3):
            comp = rng.integers(1, 11, int(rng.integers(2, 5))).tolist()
            ids = prompt + comp
            # a sampler's log-probs: one value per prefix (completions sharing a prefix agree on it)
            old = [None] * len(prompt) + [-0.5 - (hash(tuple(ids[: t + 1])) % 100) / 40 for t in range(len(prompt), len(ids))]
            branches.append({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(comp),
                             "advantage": float(rng.normal()), "old_logprobs": old})
        recs.append({"id": f"s{step}-p{p}", "branches": branches})
    return recs


def test_three_files_dropped_while_it_runs_train_three_steps(tmp_path):
    ckpt = treelit.save_hf_checkpoint(tiny_model("qwen2_tiny", torch.float32, max_seq_len=64), tmp_path / "ckpt")
    d = tmp_path / "rollouts"
    args = [*SMALL, f"model.hf_checkpoint={ckpt}", "data=rollouts", f"data.directory={d}", "data.timeout_s=120",
            "objective=ppo", "optimizer=sgd", "optimizer.lr=0.5", "grad_clip=0", "ppo_epochs=2", "trainer.max_steps=6",  # optimizer updates: 3 files x 2 epochs
            f"output_dir={tmp_path / 'out'}"]
    proc = subprocess.Popen([EXE, *args], cwd=tmp_path, env={**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rng = np.random.default_rng(0)
    files = [rollout_file(s, rng) for s in range(3)]
    try:
        for s, recs in enumerate(files):
            if s:  # the engine waits for the trainer to finish the previous step
                deadline = time.monotonic() + 240
                while not (d / f"step-{s - 1:03d}.jsonl.consumed").exists():
                    assert proc.poll() is None, proc.stdout.read()[-3000:]
                    assert time.monotonic() < deadline, "the previous file was never consumed"
                    time.sleep(0.1)
            else:
                time.sleep(1.0)  # the trainer is already waiting
            tmp = d / f"step-{s:03d}.jsonl.tmp"
            d.mkdir(exist_ok=True)
            tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
            os.replace(tmp, d / f"step-{s:03d}.jsonl")
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["global_step"] == 6  # three steps, two PPO epochs each
    assert sorted(p.name for p in d.iterdir()) == [f"step-{s:03d}.jsonl.consumed" for s in range(3)]

    # the same three steps by hand
    model = treelit.load_hf_checkpoint(ckpt)
    obj = make_objective("ppo")
    for recs in files:
        br = [b for r in recs for b in r["branches"]]
        trees = [treelit.TokenTree.from_branches([b["input_ids"] for b in r["branches"]],
                                                 [b["loss_mask"] for b in r["branches"]],
                                                 advantages=[b["advantage"] for b in r["branches"]],
                                                 old_logprobs=[b["old_logprobs"] for b in r["branches"]]) for r in recs]
        batch = treelit.TreeBatch.pack([t.to_batch() for t in trees])
        assert len(br) == 6
        for _ in range(2):  # ppo_epochs
            model.zero_grad()
            loss, _ = obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.5 * p.grad
    got = treelit.load_hf_checkpoint(tmp_path / "out" / "hf_checkpoint").state_dict()
    start = treelit.load_hf_checkpoint(ckpt).state_dict()
    ref = model.state_dict()
    assert max((ref[k] - start[k]).abs().max().item() for k in ref) > 1e-3
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=k)
