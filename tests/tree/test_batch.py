"""Folded loss weights and packing against direct per-branch sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

import treelit
from strategies import forests
from treelit.tree.batch import global_normalizer


def brute_weights(branches, masks, weights):
    """Per distinct prefix: sum_b w_b m_b and sum_b w_b m_b / n_b (first token never a target)."""
    ws, wm, n_targets, n_seq = {}, {}, 0, 0
    for br, m, w in zip(branches, masks, weights):
        n = sum(bool(x) for x in m[1:])
        n_targets += n
        n_seq += n > 0
        for t in range(1, len(br)):
            if m[t]:
                key = tuple(br[: t + 1])
                ws[key] = ws.get(key, 0.0) + w
                wm[key] = wm.get(key, 0.0) + w / n
    return ws, wm, n_targets, n_seq


def prefix_of_tokens(batch):
    pre = []
    for i in range(batch.num_tokens):
        p = int(batch.parent[i])
        pre.append((() if p < 0 else pre[p]) + (int(batch.input_ids[i]),))
    return pre


@settings(max_examples=150, deadline=None)
@given(forests())
def test_folded_weights(data):
    branches, masks, weights = data
    batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
    ws, wm, n_targets, n_seq = brute_weights(branches, masks, weights)
    pre = prefix_of_tokens(batch)
    for i, key in enumerate(pre):
        assert batch.target_weight_sum[i].item() == pytest.approx(ws.get(key, 0.0), rel=1e-12, abs=1e-12)
        assert batch.target_weight_mean[i].item() == pytest.approx(wm.get(key, 0.0), rel=1e-12, abs=1e-12)
    assert batch.num_targets == n_targets and batch.num_sequences == n_seq
    assert global_normalizer([batch], "token-mean") == n_targets
    assert global_normalizer([batch], "seq-mean-token-mean") == n_seq
    assert global_normalizer([batch], "sum") == 1.0


@settings(max_examples=60, deadline=None)
@given(forests(), forests(), forests())
def test_packing_keeps_trees_independent(a, b, c):
    trees = [treelit.TokenTree.from_branches(*x) for x in (a, b, c)]
    packed = treelit.TreeBatch.pack([t.to_batch() for t in trees])
    off = 0
    for t in trees:
        one = t.to_batch()
        n = one.num_tokens
        assert torch.equal(packed.input_ids[off : off + n], one.input_ids)
        assert torch.equal(packed.position_ids[off : off + n], one.position_ids)
        assert torch.equal(packed.subtree_end[off : off + n], one.subtree_end + off)
        assert torch.equal(packed.target_weight_sum[off : off + n], one.target_weight_sum)
        off += n
    assert packed.num_trees == 3 and packed.num_branches == sum(t.num_branches for t in trees)
    for bi in range(packed.num_branches):
        tree_i = int(packed.branch_tree[bi])
        local = bi - sum(t.num_branches for t in trees[:tree_i])
        assert packed.branch_token_ids(bi).tolist() == trees[tree_i].branch(local).tolist()


def test_pack_trees_respects_budget():
    trees = [treelit.TokenTree.from_branches([[i, 1, 2, 3]]) for i in range(5)]
    rows = treelit.pack_trees(trees, max_tokens=9)
    assert [r.num_tokens for r in rows] == [8, 8, 4]
    big = treelit.TokenTree.from_branches([list(range(20))])
    rows = treelit.pack_trees([trees[0], big, trees[1]], max_tokens=9)
    assert [r.num_tokens for r in rows] == [4, 20, 4]
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        treelit.pack_trees(trees, 0)


def test_unknown_aggregation():
    batch = treelit.TokenTree.from_branches([[1, 2]]).to_batch()
    with pytest.raises(ValueError, match="unknown aggregation 'mean'.*token-mean"):
        batch.token_weights("mean")


def test_first_token_is_never_a_target():
    batch = treelit.TokenTree.from_branches([[3, 4]], loss_masks=[[1, 1]]).to_batch()
    assert batch.target_weight_sum.tolist() == [0.0, 1.0]
    assert np.isclose(batch.num_targets, 1)
