"""Sliding windows in every attention backend, against the definition.

A query at depth d sees key j iff j is its ancestor-or-self (or a visible external key) and
``d - depth(j) < window``. The dense backend's windowed mask is checked against that
definition written out pair by pair; ``segment`` (banded blocks) against dense on outputs and
every gradient, with external ancestor keys and several block sizes; ``flex``'s windowed block
mask in FlexAttention's (unfused) CPU forward.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treelit
from strategies import examples, forests
from treelit.attention import get_backend
from treelit.attention.segment import SegmentAttention
from treelit.models.context import TreeLayout


def _layout(batch, window, n_ext=0):
    """Row keys, plus ``n_ext`` external keys standing for an ancestor path above the row (depths
    -n_ext..-1 relative to the row's roots, visible to every row query)."""
    N = batch.num_tokens
    idx = torch.arange(N)
    pos = batch.position_ids + n_ext
    batch = treelit.TreeBatch(**{**batch.__dict__, "position_ids": pos})
    if n_ext:
        lo = torch.cat([torch.zeros(n_ext, dtype=torch.long), idx])
        hi = torch.cat([torch.full((n_ext,), N, dtype=torch.long), batch.subtree_end])
        kv_pos = torch.cat([torch.arange(n_ext), pos])
    else:
        lo, hi, kv_pos = idx, batch.subtree_end, pos
    return TreeLayout(batch, lo, hi, n_ext, kv_pos).with_window(window)


def _definition_mask(layout, window):
    b = layout.batch
    N, E = b.num_tokens, layout.num_external
    parent = b.parent.tolist()
    mask = torch.zeros(N, E + N, dtype=torch.bool)
    for q in range(N):
        j = q
        while j >= 0:  # ancestors-or-self
            if int(b.position_ids[q] - b.position_ids[j]) < window:
                mask[q, E + j] = True
            j = parent[j]
        for e in range(E):
            if int(b.position_ids[q] - layout.kv_pos[e]) < window:
                mask[q, e] = True
    return mask


@settings(max_examples=examples(20), deadline=None)
@given(data=forests(max_branches=5, max_len=12, train_every_tree=False), window=st.integers(1, 6),
       n_ext=st.integers(0, 3))
def test_dense_windowed_mask_is_the_definition(data, window, n_ext):
    batch = treelit.TokenTree.from_branches(data[0]).to_batch()
    layout = _layout(batch, window, n_ext)
    if layout.window is None:  # the window cannot act on this row
        assert int(layout.q_pos.max() - layout.kv_pos.min()) < window
        return
    assert torch.equal(layout.dense_mask(), _definition_mask(layout, window))


@pytest.mark.parametrize("block", [1, 2, 5, 128])
@settings(max_examples=examples(10), deadline=None)
@given(data=forests(max_branches=6, max_len=14, train_every_tree=False), window=st.integers(1, 7),
       n_ext=st.integers(0, 3))
def test_segment_windowed_equals_dense(block, data, window, n_ext):
    batch = treelit.TokenTree.from_branches(data[0]).to_batch()
    layout = _layout(batch, window, n_ext)
    g = torch.Generator().manual_seed(0)
    N, E = layout.num_queries, layout.num_external
    q = torch.randn(1, 4, N, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, E + N, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, E + N, 8, generator=g, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(1, 4, N, 8, generator=g, dtype=torch.float64)
    dense = get_backend("sdpa_dense")
    ref = dense(q, k, v, dense.plan(layout))
    gref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    seg = SegmentAttention(window_block=block)
    out = seg(q, k, v, seg.plan(layout))
    gout = torch.autograd.grad((out * probe).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(gout, gref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [1, 3, 7, 40])
def test_flex_windowed_block_mask_forward_on_cpu(window):
    """FlexAttention's unfused CPU forward (its backward needs CUDA) with treelit's windowed
    BlockMask, 16-token blocks so that skipped, full and partial blocks all occur."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    from treelit.attention.flex import tree_block_mask

    branches = [list(range(1, 37)), list(range(1, 10)) + [40, 41], [1, 2, 3, 42], [2, 3, 4, 5, 6]]
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    layout = _layout(batch, window, 2)
    torch.manual_seed(0)
    N, E = layout.num_queries, layout.num_external
    q, k, v = torch.randn(1, 4, N, 8), torch.randn(1, 2, E + N, 8), torch.randn(1, 2, E + N, 8)
    w = layout.window
    bm = tree_block_mask(layout.kv_lo, layout.kv_hi, N, 16, q_pos=layout.q_pos if w else None,
                         kv_pos=layout.kv_pos if w else None, window=w)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    ref = get_backend("sdpa_dense")(q, k, v, layout.dense_mask())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
