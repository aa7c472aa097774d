"""``treelit-train experiment=ppo_critic`` as a user runs it: the critic learns (its explained
variance rises above 0), its metrics reach the summary in PPO terms, a resume is bit-exact for
the policy and the critic, the trainer's per-branch check agrees with the tree, and bad options
or data are one line before training."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from app_helpers import SMALL
from treelit.cli.config import compose
from treelit.cli.console import SetupError
from treelit.cli.train import run

RUN = SMALL + ["experiment=ppo_critic", "data.max_trees=16", "callbacks.reward_margin=null"]


def train(tmp_path, name, *extra):
    out = tmp_path / name
    return run(compose([f"output_dir={out}", *RUN, *extra])), out


def test_shared_critic_run_checks_itself_against_per_branch(tmp_path):
    """Default suite: a few steps; the self-check (tree vs per branch, policy and critic) holds
    and the critic's metrics are in the summary."""
    s, _ = train(tmp_path, "run", "trainer.max_steps=3", "verify_every=1", "model.dtype=float64")
    m = s["metrics"]
    assert m["verify/loss_rel_diff"] < 1e-9 and m["verify/grad_rel_diff"] < 1e-9, m
    for k in ("critic/value_loss", "critic/explained_variance", "critic/values_mean", "critic/returns_mean",
              "critic/clip_fraction"):
        assert k in m, k
    assert "critic/value_loss" in s["rl"]["last"]


@pytest.mark.slow
def test_separate_critic_from_a_checkpoint_with_activation_checkpointing(tmp_path):
    """critic.hf_checkpoint=DIR (a trained run's export) and activation checkpointing on both
    models: the update equals the per-branch path's; the critic's own weights move."""
    _, first = train(tmp_path, "first", "trainer.max_steps=1")
    ckpt = first / "hf_checkpoint"
    out = tmp_path / "sep"
    s = run(compose([f"output_dir={out}", *[o for o in RUN if o != "callbacks.checkpoint=null"],
                     "trainer.max_steps=2", "verify_every=1", "model.dtype=float64", "critic=separate",
                     f"critic.hf_checkpoint={ckpt}", "model.activation_checkpointing=true"]))
    m = s["metrics"]
    assert m["verify/loss_rel_diff"] < 1e-9 and m["verify/grad_rel_diff"] < 1e-9, m
    assert m["critic/grad_norm"] > 0
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert any(k.startswith("critic.trunk.") for k in state) and any(k.startswith("critic.head.") for k in state)


@pytest.mark.parametrize("kind", ["shared", pytest.param("separate", marks=pytest.mark.slow)])
def test_partitioned_critic_run_checks_itself_against_per_branch(tmp_path, kind):
    """Trees cut into partitions of 60 tokens (the values' pass and both losses folded per pass):
    the update equals the per-branch path's (policy and critic)."""
    extra = [f"critic={kind}"] + (["critic.model=policy"] if kind == "separate" else [])
    s, _ = train(tmp_path, "part", "trainer.max_steps=2", "verify_every=1", "model.dtype=float64",
                 "partition=redundancy_free", "partition.budget_tokens=60", *extra)
    m = s["metrics"]
    assert m["verify/loss_rel_diff"] < 1e-9 and m["verify/grad_rel_diff"] < 1e-9, m
    assert m["partitions"] > m["micro_batches"], m
    assert m["critic/value_loss"] > 0


@pytest.mark.slow
def test_ppo_critic_preset_learns_values(tmp_path):
    out = tmp_path / "preset"
    s = run(compose([f"output_dir={out}", "logger=none", "callbacks.checkpoint=null", "callbacks.progress=null",
                     "trainer.enable_progress_bar=false", "experiment=ppo_critic"]))
    first, last = s["rl"]["first"], s["rl"]["last"]
    assert last["critic/explained_variance"] > 0.1, (first, last)
    assert last["critic/explained_variance"] > first["critic/explained_variance"]
    assert last["critic/value_loss"] < first["critic/value_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shared", "separate"])
def test_critic_resume_is_bit_exact(tmp_path, kind):
    extra = [f"critic={kind}", "optimizer=adamw", "callbacks.checkpoint.every_n_train_steps=1",
             "callbacks.checkpoint.save_top_k=-1"] + (["critic.model=policy"] if kind == "separate" else [])
    RUN_CK = [o for o in RUN if o != "callbacks.checkpoint=null"]

    def go(name, *more):
        out = tmp_path / name
        run(compose([f"output_dir={out}", *RUN_CK, *extra, *more]))
        return torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]

    full = go("full", "trainer.max_steps=4")
    go("cut", "trainer.max_steps=2")
    resumed = go("resumed", "trainer.max_steps=4", f"resume_from={tmp_path / 'cut' / 'checkpoints' / 'step-000002.ckpt'}")
    assert any(k.startswith("critic.") for k in full)
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


@pytest.mark.parametrize("args,expected", [
    (["critic=separate"], "critic=separate needs its own model: critic.hf_checkpoint=DIR"),
    (["critic=separate", "critic.model=nosuch"], "critic.model='nosuch': not a model config"),
    (["objective=grpo"], "critic=shared trains with objective=ppo"),
    (["objective.gamma=1.5"], "objective.gamma=1.5: must be a number in [0, 1]"),
    (["objective.lam=-0.5"], "objective.lam=-0.5: must be a number in [0, 1]"),
    (["tree_builder.advantage=grpo"], "critic=shared with tree_builder.advantage=grpo: the critic computes"),
    (["critic.vf_coef=0"], "critic.vf_coef=0: must be a number > 0"),
])
def test_bad_critic_options_are_one_line(tmp_path, args, expected):
    with pytest.raises((ValueError, SetupError)) as exc:
        train(tmp_path, "bad", "trainer.max_steps=1", *args)
    assert expected in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_records_without_rewards_are_named(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    good = {"input_ids": [1, 20, 21, 22], "loss_mask": [0, 1, 1, 1], "reward": 1.0}
    bad = {"input_ids": [1, 20, 23], "loss_mask": [0, 1, 1], "advantage": 0.5}
    path.write_text(json.dumps({"id": "t0", "branches": [good, bad]}) + "\n")
    with pytest.raises(ValueError) as exc:
        train(tmp_path, "norew", "trainer.max_steps=1", "data=jsonl", f"data.train_path={path}",
              "tree_builder=sequences", "~data.max_trees")
    msg = str(exc.value)
    assert "rollouts.jsonl:1" in msg and "reward" in msg and "critic" in msg and "\n" not in msg, msg
