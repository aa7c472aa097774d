"""``model.moe.routing=replay`` in the trainer: records with ``routed_experts`` (compact form),
one SGD step the same in tree mode, per-branch mode and partitioned tree mode (router loss on,
several micro-batches per step), and different from live routing; bad options refused."""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from app_helpers import SMALL
from routing_oracle import routing_for
from treelit.cli.config import ConfigError, compose
from treelit.cli.train import run
from treelit.data.records import DataError
from treelit.tree.routing import encode_routing

TREES = [[[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]], [[2, 9, 10, 3], [2, 9, 4]], [[5, 6, 7, 8, 9, 10, 11], [5, 6, 1]]]
COMMON = [*SMALL, "model=qwen3_moe_tiny", "model.config.vocab_size=16", "model.router_aux_loss_coef=0.5",
          "model.dtype=float64", "data=jsonl", "data.micro_batch_tokens=10", "data.micro_batches_per_step=3",
          "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=1", "grad_clip=0"]


# a branch a prefix of another (one token short of it) in each tree
PREFIX_TREES = [[[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]], [[2, 9, 10, 3, 4], [2, 9, 10, 3], [2, 9, 4]]]


def write_data(path, layers=2, k=2, experts=8, last=True, trees=TREES):
    lines = []
    for i, t in enumerate(trees):
        branches = []
        for b in t:
            r = routing_for(b, layers, k, experts)
            branches.append({"input_ids": b, "routed_experts": encode_routing(r if last else r[:-1])})
        lines.append(json.dumps({"id": f"t{i}", "branches": branches}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("definition", ["micro_batch", "sequence"])
def test_replay_step_is_the_same_in_tree_linear_and_partitioned_mode(tmp_path, definition):
    data = write_data(tmp_path / "data.jsonl")
    common = [*COMMON, f"model.router_aux_loss={definition}", f"data.train_path={data}"]
    runs = {"tree": [], "linear": ["mode=linear"],
            "partitioned": ["partition=redundancy_free", "partition.budget_tokens=7"]}
    states = {}
    for name, extra in runs.items():
        out = tmp_path / name
        summary = run(compose([f"output_dir={out}", *common, "model.moe.routing=replay", *extra]))
        assert summary["metrics"]["router_aux_loss"] > 0
        states[name] = treelit.load_hf_checkpoint(out / "hf_checkpoint", dtype=torch.float64).state_dict()
    for name in ("linear", "partitioned"):
        for k, v in states["tree"].items():
            torch.testing.assert_close(states[name][k], v, rtol=1e-9, atol=1e-12, msg=f"{name}: {k}")
    out = tmp_path / "live"
    run(compose([f"output_dir={out}", *common]))
    live = treelit.load_hf_checkpoint(out / "hf_checkpoint", dtype=torch.float64).state_dict()
    assert any(not torch.allclose(live[k], v, rtol=1e-6) for k, v in states["tree"].items())


def test_a_prefix_branch_with_short_records_steps_the_same_in_tree_and_linear_mode(tmp_path):
    """Records one token short (as samplers return them), a branch a prefix of another, router
    loss on: per-branch mode routes the shorter branch's final token as the longer branch recorded
    it, as the tree does, so one SGD step is the same in both modes."""
    data = write_data(tmp_path / "data.jsonl", last=False, trees=PREFIX_TREES)
    states = {}
    for name, extra in {"tree": [], "linear": ["mode=linear"]}.items():
        out = tmp_path / name
        summary = run(compose([f"output_dir={out}", *COMMON, f"data.train_path={data}", "model.moe.routing=replay",
                               *extra]))
        assert summary["metrics"]["router_aux_loss"] > 0
        states[name] = treelit.load_hf_checkpoint(out / "hf_checkpoint", dtype=torch.float64).state_dict()
    for k, v in states["tree"].items():
        torch.testing.assert_close(states["linear"][k], v, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


def test_replay_options_and_data_are_checked_before_training(tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    # (judged from the options, before the model is built: the preset's defaults name no experts)
    with pytest.raises(ConfigError, match=r"model.moe.routing=replay needs a mixture-of-experts model; "
                                          r"model.preset=qwen3_tiny has no MoE layers"):
        run(compose([f"output_dir={tmp_path / 'a'}", *SMALL, "model=qwen3_tiny", "model.moe.routing=replay",
                     "data=jsonl", f"data.train_path={data}"]))
    wrong = write_data(tmp_path / "wrong.jsonl", layers=3)
    with pytest.raises(DataError,
                       match=rf"^{wrong}:1: branches\[0\].routed_experts: routing for 3 MoE layers; the model has 2$"):
        run(compose([f"output_dir={tmp_path / 'b'}", *COMMON, f"data.train_path={wrong}", "model.moe.routing=replay"]))
