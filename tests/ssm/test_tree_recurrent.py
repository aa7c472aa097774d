"""Gated DeltaNet, Mamba2 and hybrid models in tree mode == per-branch, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treelit
from helpers import RECURRENT, assert_equivalent, cached_model
from strategies import forests
from treelit.loss.tree import tree_hidden
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=forests(max_branches=6, max_len=10), name=st.sampled_from(RECURRENT),
       aggregation=st.sampled_from(treelit.AGGREGATIONS), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_loss_and_gradients_match_per_branch(data, name, aggregation, dtype):
    branches, masks, weights = data
    model = cached_model(name, dtype)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, tree, aggregation, attention="segment"),
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation),
        dtype,
        f"{name}/{aggregation}",
    )


@pytest.mark.parametrize("name", RECURRENT)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=forests(max_branches=6, max_len=10))
def test_every_token_output_equals_its_branch_output(name, data):
    """Layer outputs: the final hidden state of every tree token equals the one the token has
    when its branch runs alone (one-token segments, segments shorter than the kernel, ...)."""
    model = cached_model(name, torch.float64)
    branches = data[0]
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    with torch.no_grad():
        h_tree, _ = tree_hidden(model, batch, "segment")
        for b, br in enumerate(branches):
            ids = torch.tensor([br])
            h = decoder_hidden(model, ids, torch.arange(len(br))[None], CausalContext())[0]
            path = batch.branch_tokens[batch.branch_ptr[b] : batch.branch_ptr[b + 1]]
            torch.testing.assert_close(h_tree[path], h, rtol=1e-10, atol=1e-10)


NASTY = {
    # a long chain of one-token segments: every token branches
    "one_token_chain": [[1, 2, 3, 4, 5, 6, 7], [1, 9], [1, 2, 9], [1, 2, 3, 9], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 9]],
    # segments shorter than the convolution kernel (4): the kernel reaches across several of them
    "short_segments": [[1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 6, 7], [1, 8], [1, 2, 4, 6, 9, 10]],
    "duplicates_and_prefixes": [[3, 4, 5, 6], [3, 4, 5, 6], [3, 4], [3, 4, 5, 6, 7, 8]],
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", sorted(NASTY))
@pytest.mark.parametrize("name", RECURRENT)
def test_nasty_trees(name, case, dtype):
    model = cached_model(name, dtype)
    branches = NASTY[case]
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, treelit.TokenTree.from_branches(branches)),
        lambda: treelit.linear_loss(model, branches),
        dtype,
        case,
    )


@pytest.mark.parametrize("name", RECURRENT)
def test_several_trees_in_one_row(name):
    model = cached_model(name, torch.float64)
    parts = [[[1, 2, 3], [1, 2, 4, 5]], [[6, 7, 8, 9], [6, 10]], [[2], [2, 3, 4, 5, 6]]]
    packed = treelit.TreeBatch.pack([treelit.TokenTree.from_branches(p).to_batch() for p in parts])
    flat = [b for p in parts for b in p]
    assert_equivalent(
        model, lambda: treelit.tree_loss(model, packed), lambda: treelit.linear_loss(model, flat), torch.float64, "packed"
    )
