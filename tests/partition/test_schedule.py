"""The pass schedules of partition plans, and their alignment across ranks (FSDP2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treelit.partition.schedule import BACKWARD, FORWARD, align, decode, dfs_word, encode


@st.composite
def plan_parents(draw, max_parts=8):
    """Parent indices of a partition plan in DFS order (parents before children)."""
    n = draw(st.integers(1, max_parts))
    parents = [-1]
    stack = [0]
    for i in range(1, n):
        # the next partition hangs below some partition on the current DFS chain, or is a new root
        depth = draw(st.integers(0, len(stack)))
        stack = stack[:depth]
        parents.append(stack[-1] if stack else -1)
        stack.append(i)
    return parents


def test_dfs_word_of_a_root_with_two_children():
    assert dfs_word([-1, 0, 0]) == [(FORWARD, 0), (FORWARD, 1), (BACKWARD, 1), (FORWARD, 2), (BACKWARD, 2),
                                    (BACKWARD, 0)]
    assert decode(encode(dfs_word([-1, 0, 1, -1]))) == dfs_word([-1, 0, 1, -1])


@settings(max_examples=200, deadline=None)
@given(plans=st.lists(plan_parents(), min_size=1, max_size=4))
def test_aligned_schedules_run_the_same_kinds_and_keep_each_ranks_order(plans):
    words = [dfs_word(p) for p in plans]
    ops = align(words)
    kinds = [[k for k, _ in o] for o in ops]
    assert all(k == kinds[0] for k in kinds), "every rank runs the same sequence of forwards and backwards"
    for word, o in zip(words, ops):
        assert [x for x in o if x[1] >= 0] == word, "a rank's own passes keep their order"
        pending = 0
        for kind, i in o:
            if i < 0:
                pending += 1 if kind == FORWARD else -1
                assert pending >= 0, "an empty backward needs an empty forward before it"
        assert pending == 0, "every empty forward is backwarded"
    longest = max(len(w) for w in words)
    assert len(ops[0]) <= sum(len(w) for w in words) + longest, "no runaway padding"


def test_unbalanced_word_is_refused():
    with pytest.raises(ValueError, match="rank 1"):
        align([dfs_word([-1]), [(FORWARD, 0)]])
