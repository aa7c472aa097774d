"""PPO with a critic under FSDP2 on two CPU processes (gloo): the value head (and a separate
critic's model) are sharded with the policy, the step-global advantage whitening sums over the
ranks, and the policy's weights (float64) and the critic's metrics equal one process's:
unpartitioned, partitioned (``partition=redundancy_free``: every rank calls the sharded head in
every pass, empty ones included) and under context parallelism (each tree's row split over the
two ranks, partitioned or not)."""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from cli import run, tail

COMMON = [
    "experiment=ppo_critic", "data.max_trees=16", "data.shuffle=false", "data.micro_batch_tokens=512",
    "data.micro_batches_per_step=2", "trainer.max_steps=3", "logger=none", "callbacks.checkpoint=null",
    "callbacks.progress=null", "callbacks.reward_margin=null", "trainer.enable_progress_bar=false",
    "model.config.num_layers=2", "model.config.embed_dim=32", "model.config.intermediate_dim=64", "model.dtype=float64",
]


def train(tmp, name, *extra):
    out = tmp / name
    log = tmp / f"{name}.log"
    rc = run([*COMMON, f"output_dir={out}", *extra], tmp, log)
    assert rc == 0, tail(log)
    return out


PARTITIONED = ["partition=redundancy_free", "partition.budget_tokens=48"]
CP = ["trainer.strategy.context_parallel_degree=2"]


@pytest.mark.parametrize("kind,how", [
    ("shared", []),
    pytest.param("separate", [], marks=pytest.mark.slow),
    pytest.param("shared", PARTITIONED, id="shared-partitioned"),  # default suite: ~22 s at load 6 on 2 cores
    pytest.param("separate", PARTITIONED, marks=pytest.mark.slow, id="separate-partitioned"),
    pytest.param("shared", CP, marks=pytest.mark.slow, id="shared-cp"),
    pytest.param("separate", CP + PARTITIONED[:1] + ["partition.budget_tokens=24"], marks=pytest.mark.slow,
                 id="separate-cp-partitioned"),
])
def test_fsdp2_critic_equals_one_process(tmp_path, kind, how):
    extra = [f"critic={kind}"] + (["critic.model=policy"] if kind == "separate" else [])
    one = train(tmp_path, "single", *extra)
    two = train(tmp_path, "fsdp2", "trainer=fsdp2_cpu", *extra, *how)
    a = treelit.load_hf_checkpoint(one / "hf_checkpoint").state_dict()
    b = treelit.load_hf_checkpoint(two / "hf_checkpoint").state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-9, atol=1e-12, msg=k)
    ma = json.loads((one / "summary.json").read_text())["metrics"]
    mb = json.loads((two / "summary.json").read_text())["metrics"]
    assert ma["critic/value_loss"] > 0
    for key in ("loss", "grad_norm", "critic/value_loss", "critic/values_mean", "critic/returns_mean",
                "critic/explained_variance", "reward/mean"):
        assert mb[key] == pytest.approx(ma[key], rel=1e-6, abs=1e-9), key
    if "partition=redundancy_free" in how:
        assert mb["partitions"] > mb["micro_batches"], mb  # the budget cut the rows
