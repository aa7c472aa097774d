"""Gated DeltaNet, Mamba2 and hybrid models in tree mode == per-branch, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treelit
from helpers import RECURRENT, assert_equivalent, cached_model, ssm_chunk_size
from strategies import forests
from treelit.loss.tree import tree_hidden
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=forests(max_branches=6, max_len=10), name=st.sampled_from(RECURRENT),
       aggregation=st.sampled_from(treelit.AGGREGATIONS), dtype=st.sampled_from([torch.float64, torch.float32]),
       chunk=st.sampled_from([1, 2, 3, 64]))
def test_loss_and_gradients_match_per_branch(data, name, aggregation, dtype, chunk):
    """Tree mode with the scan in blocks of ``chunk`` tokens (1: step by step) against
    per-branch training with the token-by-token reference scan."""
    branches, masks, weights = data
    model = cached_model(name, dtype)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)

    def tree_mode():
        with ssm_chunk_size(model, chunk):
            return treelit.tree_loss(model, tree, aggregation, attention="segment")

    def per_branch():
        with ssm_chunk_size(model, 1):
            return treelit.linear_loss(model, branches, masks, weights, aggregation)

    assert_equivalent(model, tree_mode, per_branch, dtype, f"{name}/{aggregation}/chunk {chunk}")


@pytest.mark.parametrize("name", RECURRENT)
@pytest.mark.parametrize("chunk", [2, 5, 16, 64])
def test_chunked_scan_equals_step_scan_on_long_segments(name, chunk):
    """Segments much longer than a block, siblings of different lengths ending inside a
    block, one-token segments: the chunked scan gives the reference scan's loss and
    gradients (float64)."""
    model = cached_model(name, torch.float64)
    trunk = [1 + (7 * i) % 9 for i in range(40)]
    branches = [trunk, trunk[:25] + [2, 3], trunk[:25] + [4], trunk[:3] + [5] * 30, trunk[:3] + [6], [7, 8] * 12]
    tree = treelit.TokenTree.from_branches(branches)

    def run(c):
        def fn():
            with ssm_chunk_size(model, c):
                return treelit.tree_loss(model, tree)
        return fn

    assert_equivalent(model, run(chunk), run(1), torch.float64, f"chunk {chunk}")


def test_bad_chunk_size():
    from treelit.ssm.layout import causal_layout
    from treelit.ssm.scan import chunked_scan

    from treelit.ssm import set_ssm_backend

    model = set_ssm_backend(treelit.build_model("gdn_tiny"), "torch", chunk_size=8)
    assert {m.chunk_size for m in model.modules() if hasattr(m, "reset_tree_parameters")} == {8}
    with pytest.raises(ValueError, match="ssm.chunk_size must be >= 1, got 0"):
        set_ssm_backend(model, "torch", chunk_size=0)
    with pytest.raises(ValueError, match="ssm chunk_size must be >= 1, got 0"):
        chunked_scan(None, causal_layout(1, 2, None, 4, "cpu"), (1,), (1,), torch.zeros(1), chunk_size=0)


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
