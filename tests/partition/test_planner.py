"""The memory planner: budgets under a simulated memory limit, and out-of-memory retries."""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from app_helpers import SMALL
from treelit.cli.config import compose
from treelit.cli.train import run


@pytest.fixture
def wide_trees(tmp_path):
    path = tmp_path / "wide.jsonl"
    prefix = list(range(1, 41))
    with path.open("w") as f:
        for t in range(4):
            branches = [{"input_ids": prefix + [(7 * b + t) % 400 + 50] * 30} for b in range(12)]
            f.write(json.dumps({"id": f"t{t}", "branches": branches}) + "\n")
    return path


def planner_run(tmp_path, data, name, *extra):
    cfg = compose([f"output_dir={tmp_path / name}", *SMALL, "callbacks=planner", "callbacks.progress=null",
                   "callbacks.checkpoint=null", "partition=redundancy_free", "data=jsonl", f"data.train_path={data}",
                   "data.shuffle=false", "trainer.max_steps=3", "optimizer=sgd", "optimizer.lr=0.1", *extra])
    return run(cfg), tmp_path / name


def test_budgets_keep_peak_memory_below_the_limit(tmp_path, wide_trees):
    limit = 4 * 2**20
    summary, _ = planner_run(tmp_path, wide_trees, "limit", f"callbacks.memory_planner.memory_limit_bytes={limit}",
                             "callbacks.memory_planner.initial_bytes_per_token=20000")
    m = summary["metrics"]
    assert m["planner/peak_bytes"] < limit
    assert m["budget_tokens"] < 400 and m["partitions"] > 1  # a 400-token tree does not fit in one pass
    assert m["token_forwards"] == m["tree_tokens"]


def test_out_of_memory_retries_with_a_smaller_budget_and_same_result(tmp_path, wide_trees, monkeypatch):
    """A block that runs out of memory on rows above 150 tokens (a device too small for the
    first budgets): the update is retried with smaller budgets and equals an undisturbed run."""
    import treelit.models.decoder as dec

    real = dec._layer_forward
    calls = {"oom": 0}

    def flaky(layer, i, pos, ctx, h):
        if h.shape[1] > 150:
            calls["oom"] += 1
            raise torch.OutOfMemoryError("simulated")
        return real(layer, i, pos, ctx, h)

    limit = 64 * 2**20
    common = [f"callbacks.memory_planner.memory_limit_bytes={limit}", "callbacks.memory_planner.initial_bytes_per_token=150000"]
    _, out_ref = planner_run(tmp_path, wide_trees, "ref", "partition.budget_tokens=100", "callbacks.memory_planner=null")
    monkeypatch.setattr(dec, "_layer_forward", flaky)
    summary, out = planner_run(tmp_path, wide_trees, "oom", *common)
    assert calls["oom"] >= 1
    first = int(limit * 0.9 / (150000 * 1.1))  # the budget before the first out-of-memory error
    assert summary["metrics"]["budget_tokens"] <= first // 2, "later steps keep the lesson"
    a = treelit.load_hf_checkpoint(out / "hf_checkpoint").state_dict()
    b = treelit.load_hf_checkpoint(out_ref / "hf_checkpoint").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_memory_limit_per_rank_and_single_process_budget(tmp_path, wide_trees):
    """A list of limits is read per rank (here rank 0 of one process)."""
    summary, _ = planner_run(tmp_path, wide_trees, "list", "callbacks.memory_planner.memory_limit_bytes=[4194304,1]",
                             "callbacks.memory_planner.initial_bytes_per_token=20000", "trainer.max_steps=1")
    m = summary["metrics"]
    # 20000 bytes per token and a row of the head's logits per target (a small vocabulary: far below a chunk)
    assert m["planner/head_bytes"] > 0
    assert m["budget_tokens"] == int(4194304 * 0.9 / 1.1 / (20000 + m["planner/head_bytes"]))
