"""The online RL loop on a tiny MoE with routing replay, as processes (``treelit-train
experiment=rl_online model=qwen3_moe_tiny`` and ``treelit-rollout``): the sampler records the
experts it routed each token to, the trainer replays them, and the sampler-to-trainer KL at the
first update (``behavior/kl``: KL(sampler || trainer) over the sampled tokens, same weights) is 0.

Sampler and trainer share their numerics here (float64 weights, treelit's decoder on both
sides), so live routing picks the same experts too and gives the same figure; the KL replay
removes is the one numerics make: the bfloat16-sampler case below measures it (docs/rl.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXE = str(Path(sys.executable).with_name("treelit-train"))


def first_update(tmp_path, routing, dtype="float64", sampler="float64", engine="treelit"):
    """One step of the loop; the trainer's first-update metrics and the rollout file."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    rl = tmp_path / f"{routing}-{sampler}"
    train = [EXE, "experiment=rl_online", f"rl_dir={rl}", "logger=none", "trainer.max_steps=1",
             "trainer.enable_progress_bar=false", "callbacks.progress=null", "callbacks.checkpoint=null",
             "model=qwen3_moe_tiny", "model.config.vocab_size=16", f"model.dtype={dtype}", f"publish.dtype={sampler}",
             f"model.moe.routing={routing}", f"output_dir={rl / 'out'}"]
    work = [sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"), "--out",
            str(rl / "rollouts"), "--prompts", "rl_online_prompts.jsonl", "--reward", "even_tokens", "--n", "8",
            "--max-new-tokens", "6", "--steps", "1", "--dtype", sampler, "--engine", engine]
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    trainer = subprocess.Popen(train, cwd=tmp_path, env=env, stdout=open(logs / f"{rl.name}-train.out", "w"),
                               stderr=subprocess.STDOUT)
    worker = subprocess.Popen(work, cwd=tmp_path, env=env, stdout=open(logs / f"{rl.name}-work.out", "w"),
                              stderr=subprocess.STDOUT)
    try:
        assert worker.wait(timeout=300) == 0, (logs / f"{rl.name}-work.out").read_text()[-3000:]
        assert trainer.wait(timeout=300) == 0, (logs / f"{rl.name}-train.out").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.kill()
    summary = json.loads((rl / "out" / "summary.json").read_text())
    recs = [json.loads(line) for f in sorted((rl / "rollouts").glob("step-000000.jsonl*"))
            for line in f.read_text().splitlines()]
    return summary["rl"]["first"], recs


@pytest.mark.slow
def test_replay_makes_the_first_update_kl_zero(tmp_path):
    replay, recs = first_update(tmp_path, "replay")
    assert recs and all("routed_experts" in b for r in recs for b in r["branches"])
    live, live_recs = first_update(tmp_path, "live")
    assert live_recs and not any("routed_experts" in b for r in live_recs for b in r["branches"])
    print(f"first-update sampler-to-trainer KL: replay {replay['behavior/kl']:.3g}, live {live['behavior/kl']:.3g}")
    assert abs(replay["behavior/kl"]) <= 1e-12, replay
    assert live["behavior/kl"] >= replay["behavior/kl"] - 1e-15, (live, replay)


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "rl_online_replay_kl.json"


@pytest.mark.slow
def test_replay_lowers_the_first_update_kl_of_a_bfloat16_sampler(tmp_path):
    """A bfloat16 sampler (transformers, ``--engine auto``, published bfloat16) and a float32
    trainer: replay removes the part of the sampler-to-trainer KL that routing flips make, so it
    is below live routing's. With ``TREELIT_WRITE_RESULTS=1`` the figures go to
    benchmarks/results/rl_online_replay_kl.json (quoted in docs/rl.md)."""
    kl = {}
    for routing in ("replay", "live"):
        first, recs = first_update(tmp_path, routing, dtype="float32", sampler="bfloat16", engine="auto")
        assert recs and all(("routed_experts" in b) == (routing == "replay") for r in recs for b in r["branches"])
        kl[routing] = first["behavior/kl"]
    print(f"first-update sampler-to-trainer KL, bfloat16 sampler / float32 trainer: {kl}")
    assert 0 < kl["replay"] < kl["live"], kl
    if not os.environ.get("TREELIT_WRITE_RESULTS"):
        return
    RESULTS.write_text(json.dumps({
        "command": "TREELIT_WRITE_RESULTS=1 python -m pytest -q -n 0 -m slow tests/cli/test_rl_online_replay.py"
                   " -k bfloat16 -s",
        "setup": "experiment=rl_online model=qwen3_moe_tiny model.config.vocab_size=16 model.dtype=float32 "
                 "publish.dtype=bfloat16; treelit-rollout --engine auto --dtype bfloat16 --n 8 "
                 "--max-new-tokens 6 --steps 1",
        "metric": "behavior/kl at the first update: KL(sampler || trainer) over the sampled tokens",
        "replay": kl["replay"], "live": kl["live"],
        "replay_removes": 1 - kl["replay"] / kl["live"],
    }, indent=2) + "\n")
