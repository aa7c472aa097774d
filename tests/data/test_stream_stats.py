"""``treelit stats`` streams: the statistics equal those of the in-memory trees, on files of
every format, with a progress bar; bad records are named or counted."""

from __future__ import annotations

import json

import pytest

from pipeline import shard_records, write
from treelit.builders.base import make_tree_builder
from treelit.cli.config import bundled_path
from treelit.data.records import DataError
from treelit.data.stats import stream_stats
from treelit.lightning.data import TreeDataModule, build_trees


@pytest.mark.parametrize("builder", ["sequences", "groups"])
def test_streamed_statistics_equal_the_in_memory_trees(tmp_path, builder):
    paths = [str(write(tmp_path / f"p{f}.{fmt}", recs))
             for f, (recs, fmt) in enumerate(zip(shard_records(), ["jsonl", "jsonl.gz", "parquet", "json"]))]
    b = make_tree_builder(builder)
    trees = [t for p in paths for t in build_trees(p, b)]
    s = stream_stats(str(tmp_path), b, group_window=10)
    assert s["trees"] == len(trees)
    assert s["flat_tokens"] == sum(t.tree.stats()["flat_tokens"] for t in trees)
    assert s["tree_tokens"] == sum(t.tree.stats()["tree_tokens"] for t in trees)
    assert s["branches"] == sum(t.tree.num_branches for t in trees)
    assert s["por"] == pytest.approx(1 - s["tree_tokens"] / s["flat_tokens"])
    assert s["records"] == sum(len(r) for r in shard_records()) and s["records_skipped"] == 0


def test_bundled_file_and_progress_bar(capsys):
    path = bundled_path("synthetic_agentic.jsonl.gz")
    s = stream_stats(path, make_tree_builder("sequences"), progress=True)
    ref = TreeDataModule(path).stats()
    for k in ("trees", "branches", "flat_tokens", "tree_tokens"):
        assert s[k] == ref[k], k
    assert "records" in capsys.readouterr().err  # the bar (on stderr)


def test_bad_records_are_named_or_counted(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"branches": [{"input_ids": [1, 2]}]}) + "\n{bad\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        stream_stats(str(p), make_tree_builder("sequences"))
    s = stream_stats(str(p), make_tree_builder("sequences"), on_error="skip")
    assert s["trees"] == 1 and s["records_skipped"] == 1


def test_treelit_stats_command_streams(capsys):
    from treelit.cli.main import main

    assert main(["stats", "synthetic_rollouts.jsonl.gz", "--builder", "groups"]) == 0
    out = capsys.readouterr().out
    assert "tree_tokens" in out and "por" in out
