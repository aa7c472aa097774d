"""``on_error=skip`` on errors found while a unit (records sharing a tree or an advantage group)
is built: only the records at fault are skipped, the rest is built again with its advantages
computed over what remains; an error of the whole unit skips every record of it, each named.
Also: an error about two disagreeing records names both lines."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pipeline import run, write
from treelit.builders.assemble import Assembler
from treelit.builders.base import make_tree_builder
from treelit.data.records import DataError, ReadStats, Record


def br(ids, group, reward, old=None):
    out = {"input_ids": ids, "group": group, "reward": reward}
    if old is not None:
        out["old_logprobs"] = old
    return out


# record a: its two branches disagree on the old log-prob of a token only they have
A = {"id": "a", "branches": [br([1, 2, 3], "g", 1.0, [None, -1, -2]), br([1, 2, 3, 4], "g", 0.0, [None, -1, -2.5, -1])]}
B = {"id": "b", "branches": [br([5, 6], "g", 1.0, [None, -1]), br([5, 7], "g", 0.0, [None, -1]),
                             br([5, 8], "g", 0.5, [None, -1])]}
C = {"id": "c", "branches": [br([8, 9], "h", 1.0, [None, -1]), br([8, 10], "h", 0.0, [None, -1])]}


def grpo(tmp_path, recs, name="d.jsonl", builder="sequences", **opts):
    return run(write(tmp_path / name, recs), builder=builder, on_error="skip", objective="grpo",
               builder_options={"advantage": "grpo", **opts})


def advantages(dm):
    return {t.id: np.asarray(t.tree.branch_adv).tolist() for t in dm.trees}


def test_issue_minimal_case_skips_only_the_bad_record(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        dm = grpo(tmp_path, [A, B, C])
    assert [t.id for t in dm.trees] == ["b", "c"]
    assert dm.read_stats.skipped == 1
    assert "d.jsonl:1: branches[1].old_logprobs[2]" in caplog.text
    # b's advantages are those of its group without a (as if a had never been in the file)
    clean = grpo(tmp_path, [B, C], name="clean.jsonl")
    assert advantages(dm) == advantages(clean)
    assert dm.read_stats.errors and all("d.jsonl:2" not in e and "d.jsonl:3" not in e for e in dm.read_stats.errors)


def test_two_disagreeing_records_are_skipped_and_the_rest_of_the_group_kept(tmp_path, caplog):
    x = {"id": "x", "branches": [br([1, 2, 3], "g", 1.0, [None, -1, -2])]}
    y = {"id": "y", "branches": [br([1, 2, 3, 4], "g", 0.0, [None, -1, -2.5, -1])]}
    d = {"id": "d", "branches": [br([5, 6], "g", 1.0), br([5, 7], "g", 0.0)]}
    with caplog.at_level(logging.WARNING):
        dm = grpo(tmp_path, [x, y, d, C], builder="groups")
    assert dm.read_stats.skipped == 2
    assert "d.jsonl:2: branches[0].old_logprobs[2]" in caplog.text and "d.jsonl:1 branches[0]" in caplog.text
    clean = grpo(tmp_path, [d, C], name="clean.jsonl", builder="groups")
    assert advantages(dm) == advantages(clean)


def test_a_group_error_left_after_the_bad_record_skips_the_group_naming_every_record(tmp_path, caplog):
    """With eps=0, the records left in g have equal rewards: 0/0 is an error of the group."""
    b1 = {"id": "b1", "branches": [br([5, 6], "g", 1.0)]}
    b2 = {"id": "b2", "branches": [br([5, 7], "g", 1.0)]}
    a = {"id": "a", "branches": [br([1, 2, 3], "g", 0.0, [None, -1, -2]), br([1, 2, 3, 4], "g", 0.0, [None, -1, -2.5, -1])]}
    with caplog.at_level(logging.WARNING):
        dm = grpo(tmp_path, [b1, a, b2, C], eps=0.0)
    assert [t.id for t in dm.trees] == ["c"] and dm.read_stats.skipped == 3
    assert "d.jsonl:2: branches[1].old_logprobs[2]" in caplog.text
    group_msg = [e for e in dm.read_stats.errors if "non-finite advantage" in e]
    assert len(group_msg) == 1 and "d.jsonl:1" in group_msg[0] and "d.jsonl:3" in group_msg[0]
    assert "all 2 records of its unit" in group_msg[0]


def _records(recs, name="d.jsonl"):
    return [Record(r, f"{name}:{i + 1}", position=i) for i, r in enumerate(recs)]


def test_removing_a_record_that_joined_two_groups_builds_them_as_separate_units(tmp_path):
    """a has branches in g and h (one unit); skipping it leaves two units, each rebuilt from its
    own records' positions (as a stream resumes) to the same trees."""
    a = {"id": "a", "branches": [br([1, 2, 3], "g", 1.0, [None, -1, -2]), br([1, 2, 3, 4], "h", 0.0, [None, -1, -2.5, -1])]}
    g2 = {"id": "g2", "branches": [br([5, 6], "g", 0.0)]}
    h1 = {"id": "h1", "branches": [br([7, 6], "h", 1.0)]}
    g3 = {"id": "g3", "branches": [br([5, 7], "g", 1.0)]}
    h2 = {"id": "h2", "branches": [br([7, 8], "h", 0.0)]}
    recs = _records([g2, h1, a, g3, h2])
    builder = make_tree_builder("sequences", advantage="grpo")
    stats = ReadStats()
    asm = Assembler(builder, on_error="skip", stats=stats)
    trees = [t for r in recs for t in asm.add(r)] + asm.flush()
    assert stats.skipped == 1 and sorted(t.id for t in trees) == ["g2", "g3", "h1", "h2"]
    units = {tuple(t.unit) for t in trees}
    assert units == {(0, 3), (1, 4)}
    for t in trees:
        again = Assembler(builder)
        rebuilt = [x for p in t.unit for x in again.add(recs[p])] + again.flush()
        assert rebuilt[t.unit_index].id == t.id
        assert np.asarray(rebuilt[t.unit_index].tree.branch_adv).tolist() == np.asarray(t.tree.branch_adv).tolist()


def test_streamed_like_in_memory(tmp_path):
    recs = _records([A, B, C])
    out = {}
    for window in (None, 1):
        stats = ReadStats()
        asm = Assembler(make_tree_builder("sequences", advantage="grpo"), on_error="skip", window=window, stats=stats)
        trees = [t for r in recs for t in asm.add(r)] + asm.flush()
        out[window] = ([t.id for t in trees], [np.asarray(t.tree.branch_adv).tolist() for t in trees], stats.skipped)
    assert out[None] == out[1] and out[None][0] == ["b", "c"] and out[None][2] == 1


# item 3: a missing advantage names both lines ------------------------------------------------------


MISSING = [{"branches": [{"input_ids": [1, 2, 3], "group": "g", "advantage": 1.0}]},
           {"branches": [{"input_ids": [1, 2, 4], "group": "g"}]},
           {"branches": [{"input_ids": [5, 6], "group": "h", "advantage": 0.5}]}]


def test_missing_advantage_names_both_lines():
    with pytest.raises(DataError) as err:
        make_tree_builder("groups")(_records(MISSING))
    msg = str(err.value)
    assert msg.startswith("d.jsonl:2: branches[0].advantage: missing while d.jsonl:1 branches[0]"), msg


def test_missing_advantage_under_skip_skips_the_record_without_one():
    stats = ReadStats()
    asm = Assembler(make_tree_builder("groups"), on_error="skip", stats=stats)
    trees = [t for r in _records(MISSING) for t in asm.add(r)] + asm.flush()
    assert stats.skipped == 1 and "d.jsonl:2" in stats.errors[0] and "d.jsonl:1" in stats.errors[0]
    assert [t.tree.branches() for t in trees] == [[[1, 2, 3]], [[5, 6]]]
