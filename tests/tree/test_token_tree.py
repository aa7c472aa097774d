"""TokenTree structure against a brute-force trie of prefixes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import treelit
from strategies import forests
from treelit.tree.token_tree import TreeInputError


def brute_force(branches):
    """Map every distinct prefix (a tuple) to the set of branches containing it."""
    prefixes = {}
    for b, br in enumerate(branches):
        for t in range(len(br)):
            prefixes.setdefault(tuple(br[: t + 1]), set()).add(b)
    return prefixes


def check_structure(branches, tree):
    prefixes = brute_force(branches)
    N = tree.num_tokens
    assert N == len(prefixes)
    # Reconstruct each tree token's prefix from the parent chain.
    pre = [None] * N
    for i in range(N):
        p = tree.parent[i]
        assert p < i, "parents precede children in DFS order"
        pre[i] = (() if p < 0 else pre[p]) + (int(tree.input_ids[i]),)
        assert tree.depth[i] == len(pre[i]) - 1
    assert set(pre) == set(prefixes), "every distinct prefix appears exactly once"
    # Ancestor relation <=> interval test.
    for kv in range(N):
        for q in range(N):
            is_anc = pre[q][: len(pre[kv])] == pre[kv]
            assert is_anc == (kv <= q < tree.subtree_end[kv]), (kv, q)
    # Branch paths.
    for b, br in enumerate(branches):
        path = tree.branch_tokens[tree.branch_ptr[b] : tree.branch_ptr[b + 1]]
        assert [pre[i] for i in path] == [tuple(br[: t + 1]) for t in range(len(br))]
        assert tree.branch(b).tolist() == list(br)
    # Segments: maximal chains without branching.
    children = np.bincount(tree.parent[tree.parent >= 0], minlength=N)
    seg_of = np.repeat(np.arange(len(tree.seg_start)), tree.seg_len)
    assert seg_of.shape[0] == N
    for i in range(N - 1):
        same = seg_of[i] == seg_of[i + 1]
        assert same == (children[i] == 1 and tree.parent[i + 1] == i), i
    for s in range(len(tree.seg_start)):
        first = tree.seg_start[s]
        ps = tree.seg_parent[s]
        assert tree.parent[first] == (-1 if ps < 0 else tree.seg_start[ps] + tree.seg_len[ps] - 1)


@settings(max_examples=150, deadline=None)
@given(forests())
def test_structure_matches_brute_force(data):
    branches, masks, weights = data
    check_structure(branches, treelit.TokenTree.from_branches(branches, masks, weights))


@pytest.mark.parametrize(
    "branches",
    [
        [[1]],
        [[1, 2, 3]],
        [[1, 2, 3], [1, 2, 3]],  # duplicates
        [[1, 2, 3, 4], [1, 2]],  # prefix inserted after the longer branch
        [[1, 2], [1, 2, 3, 4]],  # prefix inserted first
        [[1, 2, 3], [1, 2, 4]],  # differ only in the last token
        [[1], [2], [3]],  # forest of one-token trees
        [[1, 2], [1, 3], [1, 2, 5], [1, 3, 6], [1, 3, 7]],  # one-token segments
        [[5, 1, 2, 3], [5, 1, 9], [5, 1, 2, 3, 4], [5, 1]],  # a later branch splits an older segment twice
    ],
)
def test_nasty_cases(branches):
    check_structure(branches, treelit.TokenTree.from_branches(branches))


def test_stats():
    tree = treelit.TokenTree.from_branches([[1, 2, 3, 4], [1, 2, 5, 6], [7]])
    s = tree.stats()
    assert s["flat_tokens"] == 9 and s["tree_tokens"] == 7
    assert s["por"] == pytest.approx(1 - 7 / 9) and s["ideal_speedup"] == pytest.approx(9 / 7)
    assert s["depth"] == 4 and s["segments"] == 4 and s["leaves"] == 3 and s["roots"] == 2


def test_dfs_order_heaviest_child_first():
    tree = treelit.TokenTree.from_branches([[1, 2, 9], [1, 3], [1, 2, 8], [5], [1, 3, 4, 4, 4]])
    # roots in insertion order; under 1, the child 3 (4 tokens below) precedes 2 (3 tokens)
    assert tree.input_ids.tolist() == [1, 3, 4, 4, 4, 2, 9, 8, 5]
    assert tree.parent.tolist() == [-1, 0, 1, 2, 3, 0, 5, 5, -1]
    assert tree.subtree_end.tolist() == [8, 5, 5, 5, 5, 8, 7, 8, 9]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(branches=[]), "at least one branch"),
        (dict(branches=[[1, 2], []]), "branch 1 is empty"),
        (dict(branches=[[1, -2]]), "negative token id -2"),
        (dict(branches=[[1, 2.5]]), "must be integers"),
        (dict(branches=[[1, 2]], loss_masks=[[1]]), "loss_mask has length 1, but the branch has 2"),
        (dict(branches=[[1, 2]], loss_masks=[[1, 2]]), "0/1"),
        (dict(branches=[[1], [2]], weights=[1.0]), "1 weights for 2 branches"),
        (dict(branches=[[1], [2]], weights=[1.0, -1.0]), "branch 1: weight -1.0"),
        (dict(branches=[[1], [2]], weights=[float("nan"), 1.0]), "branch 0: weight nan"),
        (dict(branches=[[1], [2]], weights=[1.0, float("inf")]), "branch 1: weight inf"),
    ],
)
def test_bad_input_is_rejected(kwargs, message):
    with pytest.raises(TreeInputError, match=message):
        treelit.TokenTree.from_branches(**kwargs)
