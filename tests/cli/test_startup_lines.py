"""What is on says so at start-up: MoE routing replay, context parallelism (degree, the ranks of
each group) and images (distinct, shared); the summary repeats the image counts. A run with any
of them once printed nothing about it."""

from __future__ import annotations

import logging

from treelit.cli.startup_lines import cp_line, images_line, routing_line
from treelit.cli.summary import format_summary


def test_routing_replay_says_so():
    assert routing_line(None) == ""
    assert routing_line((2, 8, 2)) == (
        "moe: routing replay (model.moe.routing=replay): each of the 2 MoE layers routes every token to the top-2 "
        "of its 8 experts the records' routed_experts name; the combine weights are the current router's")


def test_context_parallelism_names_its_degree_and_groups_of_ranks():
    assert cp_line(1, 4) == ""
    assert cp_line(2, 4) == ("context parallelism: degree 2, each tree row split over 2 ranks; 4 processes, "
                             "2 groups of ranks: [0, 1], [2, 3]")
    assert cp_line(2, None) == "context parallelism: degree 2, each tree row split over 2 ranks (groups of 2 " \
                               "consecutive ranks)"
    assert cp_line(2, 16).endswith("8 groups of ranks: [0, 1], [2, 3], [4, 5], [6, 7], ... (8 groups)")


def test_images_name_distinct_and_shared_counts_at_start_and_in_the_summary():
    assert images_line({"trees": 3}) == ""
    stats = {"trees": 4, "branches": 24, "flat_tokens": 4042, "tree_tokens": 1628, "por": 0.6, "ideal_speedup": 2.48,
             "images": 48, "distinct_images": 20, "shared_images": 12}
    assert images_line(stats) == ("images: 20 distinct in the trees (each encoded once), 12 of them shared by several "
                                  "branches; 48 shown over the branches")
    out = format_summary({"global_step": 2, "wall_seconds": 3.0, "data": stats, "config": "c.yaml"})
    assert "  images      20 distinct in the trees, 12 of them shared by several branches (48 shown over the " \
           "branches)" in out
    assert "images" not in format_summary({"global_step": 2, "wall_seconds": 3.0, "data": {**stats, "images": 0},
                                           "config": "c.yaml"})


def test_a_replay_run_prints_its_line_before_training(tmp_path, caplog):
    import json

    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run

    data = tmp_path / "d.jsonl"
    rows = [{"id": f"r{i}", "branches": [{"input_ids": [1, 2, 3 + i], "routed_experts": [[[0, 1], [2, 3]]] * 3}]}
            for i in range(2)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with caplog.at_level(logging.INFO):
        run(compose([*SMALL, f"output_dir={tmp_path / 'out'}", "logger=none", "model=qwen3_moe_tiny",
                     "model.config.vocab_size=16", "model.moe.routing=replay", "data=jsonl",
                     f"data.train_path={data}", "trainer.max_steps=1"]))
    said = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("moe: routing replay (model.moe.routing=replay): each of the 2 MoE layers") for m in said) == 1
    assert not any(m.startswith(("context parallelism:", "images:")) for m in said)
