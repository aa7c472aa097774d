"""Streaming sources: a streamed epoch is exactly the in-memory trees, every tree once; memory is
bounded by the buffer; state/load resumes the exact stream mid-shard; Hugging Face datasets
stream like files; bad records are reported with file and line, or skipped and counted."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from pipeline import shard_records, write
from treelit.builders.base import make_tree_builder
from treelit.data.records import DataError, ReadStats
from treelit.data.sources import make_data_source
from treelit.data.stream import TreeStream
from treelit.lightning.data import build_trees
from treelit.lightning.streaming import StreamingTreeDataModule
from treelit.objectives import make_objective


def canon(trees):
    out = []
    for t in trees:
        tr = t.tree
        adv = None if tr.branch_adv is None else tuple(np.round(tr.branch_adv, 9))
        out.append((tuple(tuple(b) for b in tr.branches()), tuple(tuple(tr.loss_mask(b)) for b in range(tr.num_branches)), adv))
    return sorted(out, key=repr)


@pytest.fixture
def shards(tmp_path):
    paths = []
    for f, recs in enumerate(shard_records()):
        fmt = ["jsonl", "jsonl.gz", "parquet", "json"][f]
        paths.append(str(write(tmp_path / f"part{f}.{fmt}", recs)))
    return paths


def one_epoch(stream):
    got = []
    while True:
        t = stream.next_tree()
        if stream.epoch > 0:
            return got
        got.append(t)


def in_memory(paths, builder):
    return [t for p in paths for t in build_trees(p, builder)]


@pytest.mark.parametrize("builder_name,options", [("sequences", {}), ("groups", {"advantage": "grpo"}),
                                                  ("sequences", {"advantage": "rloo"})])
@pytest.mark.parametrize("readers", [1, 3])
def test_a_streamed_epoch_is_the_in_memory_trees_once(shards, builder_name, options, readers):
    builder = make_tree_builder(builder_name, **options)
    expect = canon(in_memory(shards, builder))
    src = make_data_source("files", paths=shards)
    n = len(expect)
    for epoch in range(2):
        streams = [TreeStream(src, list(range(r, 4, readers)), builder, buffer_size=7, group_window=50, seed=epoch,
                               reader=r) for r in range(readers)]
        got = [t for s in streams for t in one_epoch(s)]
        assert canon(got) == expect
        assert len(got) == n


def test_epochs_follow_each_other_and_memory_stays_in_the_buffer(shards):
    builder = make_tree_builder("groups", advantage="grpo")
    n = len(in_memory(shards, builder))
    s = TreeStream(make_data_source("files", paths=shards), [0, 1, 2, 3], builder, buffer_size=5, group_window=4)
    first = [s.next_tree() for _ in range(n)]
    assert s.epoch == 0 and len(s.buffer) == 0
    second = [s.next_tree() for _ in range(n)]
    assert canon(first) == canon(second)
    assert [repr(t.tree.branches()) for t in first] != [repr(t.tree.branches()) for t in second]  # reshuffled
    peak_trees = peak_records = 0
    for _ in range(3 * n):
        s.next_tree()
        peak_trees = max(peak_trees, len(s.buffer))
        peak_records = max(peak_records, sum(len(u.encs) for u in s.asm.units.values()))
    # the buffer (plus the trees of groups completed together), and the records of the open groups
    # within the window (plus one group): never the data (120 records)
    assert peak_trees <= 5 + 7 and peak_records <= 4 + 3, (peak_trees, peak_records)


@pytest.mark.parametrize("cut", [1, 9, 23, 40])
def test_state_and_load_resume_the_exact_stream_mid_shard(shards, cut):
    builder = make_tree_builder("groups", advantage="grpo")
    src = make_data_source("files", paths=shards)
    a = TreeStream(src, [0, 1, 2, 3], builder, buffer_size=6, group_window=4, seed=3)
    for _ in range(cut):
        a.next_tree()
    state = json.loads(json.dumps(a.state()))  # plain data: it goes into a checkpoint
    rest = [a.next_tree() for _ in range(60)]
    b = TreeStream(src, [0, 1, 2, 3], builder, buffer_size=6, group_window=4, seed=3)
    b.load(state)
    again = [b.next_tree() for _ in range(60)]
    assert [canon([t]) for t in again] == [canon([t]) for t in rest]


def test_datamodule_state_resumes_the_same_steps(shards):
    def dm():
        m = StreamingTreeDataModule(make_data_source("files", paths=shards), make_tree_builder("groups", advantage="grpo"),
                                    micro_batch_tokens=60, micro_batches_per_step=2, shuffle_buffer=8, num_readers=2)
        m.check_against(600, 64, make_objective("grpo"))
        return m

    a = dm()
    for _ in range(5):
        a.next_step()
    a.next_step()  # prefetched: produced, not trained
    a.consumed_steps = 5
    state = a.state_dict()
    b = dm()
    b.load_state_dict(state)
    c = dm()
    for _ in range(5):
        c.next_step()
    for _ in range(4):
        x, y = b.next_step(), c.next_step()
        assert x.index == y.index
        assert [mb.input_ids.tolist() for mb in x.micro_batches] == [mb.input_ids.tolist() for mb in y.micro_batches]


def test_hf_dataset_streams_like_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    recs = [r for f in shard_records(n_files=3)[2:] for r in f]  # string group keys: one Arrow type
    path = write(tmp_path / "all.jsonl", recs)
    builder = make_tree_builder("sequences")
    expect = canon(build_trees(str(path), builder))
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "ds"))
    for src in (make_data_source("hf_dataset", path=str(tmp_path / "ds"), num_shards=3),
                make_data_source("hf_dataset", data_files=str(path), format="json")):
        k = len(src.shards())
        s = [TreeStream(src, [i], builder, buffer_size=4, reader=i) for i in range(k)]
        got = [t for st in s for t in one_epoch(st)]
        assert canon(got) == expect


def test_bad_records_on_a_stream_name_file_and_line_or_are_skipped(tmp_path, caplog):
    p = tmp_path / "s.jsonl"
    good = json.dumps({"branches": [{"input_ids": [1, 2, 3]}]})
    p.write_text("\n".join([good, '{"branches": [{"input_ids": [1, 900]}]}', "{oops", good]) + "\n")
    src = make_data_source("files", paths=str(p))

    def stream(on_error, stats=None):
        from treelit.builders.assemble import Limits

        return TreeStream(src, [0], make_tree_builder("sequences"), limits=Limits(600, 64), on_error=on_error,
                          stats=stats, buffer_size=2)

    with pytest.raises(DataError, match=r"s.jsonl:2: branches\[0\].input_ids\[1\]: token id 900"):
        stream("raise").next_tree()
    stats = ReadStats()
    with caplog.at_level(logging.WARNING):
        s = stream("skip", stats)
        trees = [s.next_tree(), s.next_tree()]
    assert stats.skipped == 2 and len(trees) == 2 and "s.jsonl:3: invalid JSON" in caplog.text


def test_a_group_split_across_files_or_beyond_the_window_is_an_error(tmp_path):
    a = write(tmp_path / "a.jsonl", [{"branches": [{"input_ids": [1, 2], "group": "g", "reward": 1.0}]}])
    b = write(tmp_path / "b.jsonl", [{"branches": [{"input_ids": [1, 3], "group": "g", "reward": 0.0}]}])
    s = TreeStream(make_data_source("files", paths=[str(a), str(b)]), [0, 1], make_tree_builder("groups"),
                   buffer_size=4, shuffle=False)
    with pytest.raises(DataError, match=r"b.jsonl:1: group: group 'g' was already complete \(its last record was .*a.jsonl:1\)"):
        s.next_tree()


def test_batch_scoped_estimators_are_refused_on_a_stream(shards):
    with pytest.raises(DataError, match="reinforce_pp normalises over the whole batch"):
        TreeStream(make_data_source("files", paths=shards), [0], make_tree_builder("sequences", advantage="reinforce_pp"))


def test_more_readers_than_shards_is_refused(shards):
    m = StreamingTreeDataModule(make_data_source("files", paths=shards[:2]), num_readers=3)
    with pytest.raises(DataError, match="data.num_readers=3 but the data source has 2 shard"):
        m.setup()
