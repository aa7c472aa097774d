"""The group rules as the README states them, each with its minimal case: a chat record is one
sample of its advantage group however many conversations it holds; with ``groups`` a branch
whose key is missing or null takes its record's; with ``sequences`` a record's branches without
a ``group`` form one group."""

from __future__ import annotations

import numpy as np
import pytest

from treelit.builders.base import make_tree_builder
from treelit.data.records import Record

U = {"role": "user", "content": "hi"}


def A(text):
    return {"role": "assistant", "content": text}


def recs(*data):
    return [Record(d, f"d.jsonl:{i + 1}", position=i) for i, d in enumerate(data)]


def adv(trees):
    return {t.id: np.round(np.asarray(t.tree.branch_adv, dtype=float), 6).tolist() for t in trees}


def test_chat_record_is_one_sample_however_many_conversations():
    from treelit.data.tokenizers import qwen_tokenizer_dir

    b = make_tree_builder("chat", tokenizer_path=qwen_tokenizer_dir(), advantage="grpo", export="trajectory")
    two = {"id": "two", "group": "g", "reward": 1.0, "branches": [{"messages": [U, A("yes")]}, {"messages": [U, A("no")]}]}
    one = {"id": "one", "group": "g", "reward": 0.0, "messages": [U, A("maybe")]}
    (tree,) = b(recs(two, one))
    a = np.asarray(tree.tree.branch_adv, dtype=float)
    # two samples (1.0 and 0.0): +-1/sqrt(2) over (std + eps); three would give other values
    expect = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6)
    assert sorted(np.round(a, 6).tolist()) == pytest.approx(sorted([expect, expect, -expect]), abs=1e-6)


def test_groups_branch_with_null_key_takes_its_records_key():
    b = make_tree_builder("groups", advantage="grpo")
    r1 = {"id": "r1", "group": "g", "branches": [{"input_ids": [1, 2], "reward": 1.0, "group": None},
                                                 {"input_ids": [1, 3], "reward": 0.0}]}
    r2 = {"id": "r2", "group": "g", "branches": [{"input_ids": [1, 4], "reward": 0.5}]}
    r3 = {"id": "r3", "branches": [{"input_ids": [5, 6], "reward": 1.0}, {"input_ids": [5, 7], "reward": 0.0, "group": None}]}
    trees = b(recs(r1, r2, r3))
    assert sorted(t.id for t in trees) == ["group='g'", "r3"]
    assert sorted(len(t.tree.branches()) for t in trees) == [2, 3]


def test_sequences_keyless_branches_form_their_records_group():
    b = make_tree_builder("sequences", advantage="grpo")
    r1 = {"id": "r1", "branches": [{"input_ids": [1, 2], "reward": 1.0}, {"input_ids": [1, 3], "reward": 0.0, "group": None},
                                   {"input_ids": [1, 4], "reward": 0.0, "group": "h"}]}
    r2 = {"id": "r2", "branches": [{"input_ids": [5, 6], "reward": 1.0, "group": "h"}]}
    got = adv(b(recs(r1, r2)))
    e = round(0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6), 6)
    assert got == {"r1": [e, -e, -e], "r2": [e]}
