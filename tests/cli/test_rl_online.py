"""The online RL loop as processes: ``treelit-train experiment=rl_online`` and ``treelit-rollout``
run 30 synchronous steps on CPU; the worker and then the trainer are killed with SIGKILL
mid-run and restarted. Every rollout file is trained exactly once, no file is trained on a
version more than ``data.max_staleness`` behind, and the mean reward rises."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXE = str(Path(sys.executable).with_name("treelit-train"))
STEPS = 30


def consumed(d: Path) -> int:
    return len(list(d.glob("step-*.jsonl.consumed"))) if d.is_dir() else 0


def wait_until(cond, procs, what, timeout=600):
    end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"{what}: a process failed ({p.args[:3]}): {p.returncode}")
        assert time.monotonic() < end, f"{what}: timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_trainer_and_worker_processes_learn_and_survive_kill_9(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    rl = tmp_path / "rl"
    rollouts = rl / "rollouts"
    train = [EXE, "experiment=rl_online", f"rl_dir={rl}", "logger=none", f"trainer.max_steps={STEPS}",
             "trainer.enable_progress_bar=false", "callbacks.progress=null", "callbacks.checkpoint.every_n_train_steps=1"]
    work = [sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"), "--out", str(rollouts),
            "--prompts", "rl_online_prompts.jsonl", "--reward", "even_tokens", "--n", "8", "--max-new-tokens", "6",
            "--steps", str(STEPS), "--max-staleness", "0"]
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(cmd, name):
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=open(logs / f"{name}.out", "w"),
                                stderr=subprocess.STDOUT)

    trainer = start(train + [f"output_dir={tmp_path / 'out1'}"], "train1")
    worker = start(work, "work1")
    try:
        wait_until(lambda: consumed(rollouts) >= 8, [trainer, worker], "8 steps")
        os.kill(worker.pid, signal.SIGKILL)  # the worker dies (possibly mid-file), and is restarted
        worker.wait()
        worker = start(work, "work2")
        wait_until(lambda: consumed(rollouts) >= 18, [trainer, worker], "18 steps")
        os.kill(trainer.pid, signal.SIGKILL)  # the trainer dies mid-run, and resumes from its last checkpoint
        trainer.wait()
        ckpt = tmp_path / "out1" / "checkpoints" / "last.ckpt"
        trainer = start(train + [f"output_dir={tmp_path / 'out2'}", f"resume_from={ckpt}"], "train2")
        assert trainer.wait(timeout=900) == 0, (logs / "train2.out").read_text()[-3000:]
        assert worker.wait(timeout=300) == 0, (logs / "work2.out").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.kill()
    summary = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert summary["global_step"] == STEPS
    names = sorted(p.name for p in rollouts.iterdir())
    assert names == [f"step-{i:06d}.jsonl.consumed" for i in range(STEPS)], names  # each trained once, none stale
    rewards, lag = [], []
    for i in range(STEPS):
        recs = [json.loads(line) for line in (rollouts / f"step-{i:06d}.jsonl.consumed").read_text().splitlines()]
        rewards.append(sum(b["reward"] for r in recs for b in r["branches"]) / sum(len(r["branches"]) for r in recs))
        lag.append(i - min(r["policy_version"] for r in recs))  # the trainer is at version i when it takes file i
    assert max(lag) <= 1, lag  # data.max_staleness=1 in experiment=rl_online
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward: first 5 files {first:.3f}, last 5 files {last:.3f}; staleness per file {lag}")
    assert last > first + 0.1, rewards


@pytest.mark.slow
def test_online_ppo_with_a_critic_learns_and_publishes_the_policy_only(tmp_path):
    """``experiment=rl_online objective=ppo critic=shared``: the trainer's GAE advantages come from its
    value head; the mean reward rises, the value loss falls, and the published folders hold the
    policy's weights only (a sampler loads them as a plain checkpoint)."""
    from safetensors import safe_open

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    rl, steps = tmp_path / "rl", 20
    train = [EXE, "experiment=rl_online", f"rl_dir={rl}", "logger=none", f"trainer.max_steps={steps}",
             "trainer.enable_progress_bar=false", "callbacks.progress=null", "objective=ppo", "critic=shared",
             "tree_builder.advantage=null", f"output_dir={tmp_path / 'out'}"]
    work = [sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"), "--out",
            str(rl / "rollouts"), "--prompts", "rl_online_prompts.jsonl", "--reward", "even_tokens", "--n", "8",
            "--max-new-tokens", "6", "--steps", str(steps), "--max-staleness", "1"]
    logs = tmp_path / "logs"
    logs.mkdir()
    trainer = subprocess.Popen(train, cwd=tmp_path, env=env, stdout=open(logs / "train.out", "w"),
                               stderr=subprocess.STDOUT)
    worker = subprocess.Popen(work, cwd=tmp_path, env=env, stdout=open(logs / "work.out", "w"),
                              stderr=subprocess.STDOUT)
    try:
        assert trainer.wait(timeout=900) == 0, (logs / "train.out").read_text()[-3000:]
        assert worker.wait(timeout=300) == 0, (logs / "work.out").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.kill()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    first, last = summary["rl"]["first"], summary["rl"]["last"]
    assert last["reward_mean"] > first["reward_mean"] + 0.1, (first, last)
    assert last["critic/value_loss"] < first["critic/value_loss"], (first, last)
    published = sorted((rl / "policy").glob("step-*/model.safetensors"))
    assert published
    keys = list(safe_open(str(published[-1]), "pt").keys())
    assert keys and not any("critic" in k or "value_head" in k for k in keys), keys


@pytest.mark.slow
@pytest.mark.parametrize("model", [[], ["model=qwen3_moe_tiny", "model.moe.routing=replay"]],
                         ids=["dense", "moe-replay"])
def test_the_recipe_run_again_in_the_same_folder_stops_at_once_and_says_why(tmp_path, model):
    """docs/recipes.md's online RL and MoE replay recipes, run twice in one folder: the second
    trainer and worker each stop within seconds with one line naming what they found (before:
    the worker exited 0 silently, the trainer waited data.timeout_s=600 s, and latest.json named
    a version keep-pruning had deleted); latest.json still names a folder that exists."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rl = tmp_path / "rl"
    train = [EXE, "experiment=rl_online", f"rl_dir={rl}", *model, "logger=none", "trainer.max_steps=3",
             "trainer.enable_progress_bar=false", "callbacks.progress=null"]
    work = [sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"), "--out",
            str(rl / "rollouts"), "--prompts", "rl_online_prompts.jsonl", "--reward", "even_tokens", "--n", "8",
            "--max-new-tokens", "6", "--steps", "3", "--max-staleness", "1"]

    def both(tag, timeout):
        procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for cmd in (train + [f"output_dir={tmp_path / tag}"], work)]
        try:
            return [p.communicate(timeout=timeout) + (p.returncode,) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()

    (t_out, t_err, t_rc), (w_out, w_err, w_rc) = both("first", 600)
    assert t_rc == 0 and w_rc == 0, (t_err[-3000:], w_err[-3000:])
    start = time.monotonic()
    (t_out, t_err, t_rc), (w_out, w_err, w_rc) = both("second", 300)
    assert time.monotonic() - start < 120
    assert t_rc == 1 and w_rc == 1, (t_err[-3000:], w_err[-3000:])
    assert t_err.strip().count("\n") == 0 and t_err.startswith(f"error: publish.dir {rl / 'policy'} holds policy "
                                                               "versions 1-3"), t_err
    assert "an earlier run's. Continue that run with resume_from=" in t_err and "(rl_dir=NEW" in t_err
    assert w_err.startswith(f"error: --out {rl / 'rollouts'} already holds the files of steps 0-2"), w_err
    latest = json.loads((rl / "policy" / "latest.json").read_text())
    assert latest["version"] == 3 and Path(latest["path"]).is_dir()
