"""Recorded MoE routing (``routed_experts``) under ``model.moe.routing=live``: not used, said once
for the whole data (it was once ignored without a word), and an expert id the model does not have
is an error naming the record and the field under either routing mode."""

from __future__ import annotations

import json
import logging

import pytest

from app_helpers import SMALL
from treelit.cli.config import compose
from treelit.cli.train import run
from treelit.data.records import DataError

COMMON = [*SMALL, "model=qwen3_moe_tiny", "model.config.vocab_size=16", "data=jsonl", "trainer.max_steps=1",
          "logger=none"]  # qwen3_moe_tiny: 2 MoE layers of 8 experts, top 2


def _write(path, bad_expert=None):
    """Three records, two branches each, every token routed to experts (0, 1) in both MoE layers;
    ``bad_expert``: the second record's second branch names this expert at its third token."""
    lines = []
    for i in range(3):
        branches = []
        for j, ids in enumerate(([1, 2, 3 + i, 4], [1, 2, 5 + i])):
            routing = [[[0, 1], [0, 1]] for _ in ids]
            if bad_expert is not None and (i, j) == (1, 1):
                routing[2][1] = [0, bad_expert]
            branches.append({"input_ids": ids, "routed_experts": routing})
        lines.append(json.dumps({"id": f"r{i}", "branches": branches}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_live_routing_says_once_that_the_recorded_routing_is_not_used(tmp_path, caplog):
    data = _write(tmp_path / "data.jsonl")
    with caplog.at_level(logging.WARNING):
        summary = run(compose([f"output_dir={tmp_path / 'out'}", *COMMON, f"data.train_path={data}"]))
    assert summary["global_step"] == 1
    said = [r.getMessage() for r in caplog.records if "routed_experts" in r.getMessage()]
    assert said == [f"{data}:1: branches[0].routed_experts: the records' recorded MoE routing is not used under "
                    "model.moe.routing=live (each MoE layer routes by its own router); set model.moe.routing=replay "
                    "to train on the sampler's experts (said once for the whole data)"], said


@pytest.mark.parametrize("routing", ["live", "replay"])
def test_an_expert_id_outside_the_model_is_an_error_under_either_mode(tmp_path, routing):
    data = _write(tmp_path / "data.jsonl", bad_expert=8)
    with pytest.raises(DataError, match=rf"^{data}:2: branches\[1\].routed_experts: expert id 8 at token 2, MoE "
                                        r"layer 1 is out of range \(the model has 8 experts: 0..7\)$"):
        run(compose([f"output_dir={tmp_path / 'out'}", *COMMON, f"data.train_path={data}",
                     f"model.moe.routing={routing}"]))


def test_live_routing_skips_a_record_with_an_expert_outside_the_model(tmp_path):
    data = _write(tmp_path / "data.jsonl", bad_expert=8)
    summary = run(compose([f"output_dir={tmp_path / 'out'}", *COMMON, f"data.train_path={data}",
                           "data.on_error=skip"]))
    assert summary["data"]["records_skipped"] == 1 and summary["global_step"] == 1
