"""transformers' hybrid checkpoints (``model=hf_auto``) under FSDP2 per block on two CPU processes
(gloo): one update's loss and every parameter gradient equal one process's, float64 <= 1e-9 with
transformers' float32 upcasts kept in float64 on both sides (``hybrid_cases``), partitioned with
the memory planner (the recurrent states and convolution contexts relayed across partitions while
the blocks' parameters - ``A_log``, ``dt_bias``, the convolution weights among them - are
sharded), with activation checkpointing, the RL objectives, DPO and the router loss. And
``treelit-train model=hf_auto trainer=fsdp2_cpu`` reaches the weights of a one-process run.

The default suite runs a Gated DeltaNet family (Qwen3.5) and a Mamba2 family (Nemotron-H) in
one launch; the other families and objectives are marked slow (process start-up and the tiny
models' passes on two shared cores take about a minute per launch).
"""

from __future__ import annotations

import json

import pytest
import torch

from cli import run, tail
from harness import launch
from hybrid_cases import exact_steps_float64
from test_fsdp_exact import check

pytest.importorskip("transformers")

from models.test_hf_hybrid import HYBRID  # noqa: E402  (the tiny configs of every hybrid family)
from hf_oracle import hf_from_pretrained  # noqa: E402

DEFAULT = [
    dict(family="qwen3_5", objective="sft", limits=[50000, 80000], n_trees=4),
    dict(family="nemotron_h", objective="grpo", data="rl", rollout=True, limits=[45000, 60000], n_trees=4,
         aggregation="seq-mean-token-mean"),
]
SLOW = [
    # the router loss per branch (``micro_batch`` depends on how trees are grouped into micro-batches)
    dict(family="qwen3_next", objective="dpo", data="dpo", options=dict(beta=0.5), limits=[60000, 45000],
         router_coef=0.05, router_definition="sequence"),
    dict(family="lfm2", objective="gspo", data="rl", options=dict(clip_low=0.5, clip_high=0.5),
         limits=[45000, 70000]),
    dict(family="kimi_linear", objective="sft", limits=[50000, 50000], aggregation="seq-mean-token-sum"),
    dict(family="falcon_h1", objective="ppo", data="rl", limits=[60000, 40000],
         options=dict(kl_coef=0.1, reference="initial", entropy_coef=0.01)),  # the frozen reference sharded too
    dict(family="granitemoehybrid", objective="sft", limits=[40000, 90000]),
    # activation checkpointing recomputes outside KeepFloat64 (hybrid_cases): float32
    dict(family="nemotron_h", objective="sft", dtype=torch.float32, limits=[50000, 50000], checkpointing=True),
    dict(family="qwen3_5", objective="grpo", data="rl", dtype=torch.float32, limits=[40000, 60000],
         checkpointing=True),
]


def _checkpoints(tmp_path_factory, specs):
    from hf_oracle import random_hf_checkpoint

    out = []
    for spec in specs:
        path = tmp_path_factory.mktemp(spec["family"])
        model_type, cfg = HYBRID[spec["family"]]
        random_hf_checkpoint(path, model_type, **cfg)
        out.append(dict(spec, family=f"hf:{path}"))
    return out


def _check(res, spec):
    check(res, spec, 2)
    assert len(set(res["partitions"])) > 1 or max(res["partitions"]) > 1, f"{spec['family']}: nothing partitioned"


def test_hybrids_sharded_per_block_equal_one_process(tmp_path_factory):
    results = launch(exact_steps_float64, 2, _checkpoints(tmp_path_factory, DEFAULT), deadline=600)
    for res, spec in zip(results, DEFAULT):
        _check(res, spec)


@pytest.mark.slow
def test_every_hybrid_family_sharded_per_block_equals_one_process(tmp_path_factory):
    results = launch(exact_steps_float64, 2, _checkpoints(tmp_path_factory, SLOW), deadline=900)
    for res, spec in zip(results, SLOW):
        _check(res, spec)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_treelit_train_fsdp2_on_a_hybrid_checkpoint_equals_one_process(tmp_path, family):
    """``treelit-train model=hf_auto trainer=fsdp2_cpu`` (two processes, partitioned): two SGD
    steps reach the exported weights of the same run on one process (float64)."""
    import transformers

    from hf_oracle import random_hf_checkpoint

    model_type, cfg = HYBRID[family]
    ckpt = tmp_path / "ckpt"
    random_hf_checkpoint(ckpt, model_type, std=0.1, **cfg)
    with (tmp_path / "trees.jsonl").open("w") as f:
        for t in range(6):  # trees of different sizes: the ranks get different shares
            prefix = [1 + (5 * i + t) % 11 for i in range(3 + 2 * t)]
            branches = [{"input_ids": prefix + [1 + (3 * b + 7 * i + t) % 11 for i in range(2 + (b + t) % 5)],
                         "loss_mask": [0] * len(prefix) + [1] * (2 + (b + t) % 5), "weight": 1.0 + 0.5 * (b % 3)}
                        for b in range(2 + t % 3)]
            f.write(json.dumps({"id": f"t{t}", "branches": branches}) + "\n")
    common = ["model=hf_auto", f"model.hf_checkpoint={ckpt}", "model.dtype=float64", "data=jsonl",
              f"data.train_path={tmp_path / 'trees.jsonl'}", "data.shuffle=false", "data.micro_batch_tokens=120",
              "data.micro_batches_per_step=4", "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=2",
              "logger=none", "callbacks.checkpoint=null", "callbacks.progress=null",
              "trainer.enable_progress_bar=false", "partition=redundancy_free", "partition.budget_tokens=40"]
    weights = {}
    for name, extra in (("single", []), ("fsdp2", ["trainer=fsdp2_cpu"])):
        out, log = tmp_path / name, tmp_path / f"{name}.log"
        rc = run([*common, f"output_dir={out}", *extra], tmp_path, log, timeout=600)
        assert rc == 0, tail(log)
        weights[name] = hf_from_pretrained(out / "hf_checkpoint",
                                                                          dtype=torch.float64).state_dict()
    start = hf_from_pretrained(ckpt, dtype=torch.float64).state_dict()
    assert weights["single"].keys() == weights["fsdp2"].keys() == start.keys()
    assert any(not torch.equal(weights["single"][k], start[k]) for k in start), "nothing trained"
    for k, v in weights["single"].items():
        torch.testing.assert_close(weights["fsdp2"][k], v, rtol=1e-9, atol=1e-12, msg=k)
