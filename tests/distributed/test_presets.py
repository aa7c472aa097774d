"""Every ``experiment=`` preset, and every built-in callback, runs to exit 0 on two CPU
processes under ``trainer=ddp_cpu`` and ``trainer=fsdp2_cpu`` (short runs).

Under FSDP2 every pass over the model is a collective, so a callback or an export that
runs the model on one rank only waits for ever (the reward-margin plot once did, at the
end of ``experiment=rl_synthetic``); collectives now also time out, so a regression fails
here with an error instead of hanging. The default suite runs two combinations (the
originally hanging preset, with the memory planner and partitioning on top, under both
trainers); the full matrix (the tau-bench presets with their 151k-token vocabulary take
minutes each) is marked slow.
"""

from __future__ import annotations

from importlib import resources

import pytest

from cli import run, tail

PRESETS = sorted(p.name[: -len(".yaml")] for p in (resources.files("treelit") / "conf" / "experiment").iterdir()
                 if p.name.endswith(".yaml"))
SHORT = ["trainer.max_steps=2", "logger=none", "data.max_trees=8",
         "callbacks.checkpoint.every_n_train_steps=1"]
DEFAULT = {("rl_synthetic", "fsdp2_cpu"), ("rl_synthetic", "ddp_cpu")}
EVERY_CALLBACK = ["callbacks=planner", "callbacks.memory_planner.memory_limit_bytes=40000000",
                  "partition=redundancy_free"]


def test_presets_are_found():
    assert {"rl_synthetic", "tau_bench_sft", "tau_bench_grpo"} <= set(PRESETS)


# rl_online trains on what a sampler writes: it runs with treelit-rollout beside it (tests/cli/test_rl_online.py,
# the online-RL recipe in tests/test_docs.py), not alone
ALONE = [p for p in PRESETS if p != "rl_online"]
CASES = [pytest.param(p, t, marks=() if (p, t) in DEFAULT else pytest.mark.slow, id=f"{p}-{t}")
         for p in ALONE for t in ("ddp_cpu", "fsdp2_cpu")]


@pytest.mark.parametrize("preset,trainer", CASES)
def test_preset_runs_to_exit_0(tmp_path, preset, trainer):
    extra = EVERY_CALLBACK if preset.startswith("rl_") else []
    if preset.startswith("rl_"):
        extra = extra + ["callbacks.reward_margin.every_n_steps=1", "callbacks.reward_margin.max_trees=2"]
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    rc = run([f"experiment={preset}", f"trainer={trainer}", f"output_dir={out}", *SHORT, *extra], tmp_path, log,
             timeout=600)
    assert rc == 0, tail(log)
    assert (out / "hf_checkpoint" / "config.json").is_file(), tail(log)
    assert (out / "checkpoints" / "last.ckpt").exists(), tail(log)
    if preset.startswith("rl_"):
        assert (out / "reward_margin.png").is_file(), "the reward-margin callback ran to its end on every rank"
