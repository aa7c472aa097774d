"""Gated DeltaNet, Mamba2 and hybrid models in tree mode == per-branch, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import treelit
from helpers import RECURRENT, assert_equivalent, cached_model, ssm_chunk_size
from strategies import examples, forests
from treelit.loss.tree import tree_hidden
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("name", RECURRENT)
@settings(max_examples=examples(3))
@given(data=forests(max_branches=6, max_len=10))
def test_loss_and_gradients_match_per_branch(name, aggregation, dtype, chunk, data):
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

    assert_equivalent(model, tree_mode, per_branch, dtype, f"{name}/{aggregation}/chunk {chunk}", forest=data)


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


def _scan_inputs(T=70, H=2, K=4, V=3, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    gdn = dict(q=r(T, H, K), k=torch.nn.functional.normalize(r(T, H, K), dim=-1), v=r(T, H, V),
               beta=torch.rand(T, H, generator=gen, dtype=torch.float64), g=-3 * torch.rand(T, H, generator=gen, dtype=torch.float64))
    ssd = dict(x=r(T, H, V), dt=torch.rand(T, H, generator=gen, dtype=torch.float64) * 2, A=-torch.rand(H, dtype=torch.float64) * 3,
               Bh=r(T, H, K), Ch=r(T, H, K), D=r(H))
    cast = lambda d: {n: t.to(dtype) for n, t in d.items()}  # noqa: E731
    return cast(gdn), cast(ssd)


def _run_scans(gdn, ssd, T, chunk_size):
    from treelit.ssm.layout import causal_layout
    from treelit.ssm.scan import chunked_scan, gdn_chunk, gdn_step, segment_scan, ssd_chunk, ssd_step

    lay = causal_layout(1, T, None, 1, "cpu")
    H, K, V = gdn["q"].shape[1], gdn["q"].shape[2], gdn["v"].shape[2]
    gargs = (gdn["q"], gdn["k"], gdn["v"], gdn["beta"], gdn["g"], K**-0.5)
    sargs = tuple(ssd[n] for n in ("x", "dt", "A", "Bh", "Ch", "D"))
    if chunk_size == 1:
        o_g, _ = segment_scan(gdn_step(*gargs), lay, (H, K, V), (H, V), gdn["q"])
        o_s, _ = segment_scan(ssd_step(*sargs), lay, (H, V, K), (H, V), ssd["x"])
    else:
        o_g, _ = chunked_scan(gdn_chunk(*gargs), lay, (H, K, V), (H, V), gdn["q"], None, chunk_size)
        o_s, _ = chunked_scan(ssd_chunk(*sargs), lay, (H, V, K), (H, V), ssd["x"], None, chunk_size)
    return o_g, o_s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_scan_in_half_precision(dtype):
    """bf16/fp16 inputs (triangular solves have no half kernels; blocks run in float32):
    outputs keep the dtype and are at least as close to float64 as the step scan's."""
    T = 70
    ref = _run_scans(*_scan_inputs(T), T, 1)
    low = _scan_inputs(T, dtype=dtype)
    step, chunked = _run_scans(*low, T, 1), _run_scans(*low, T, 64)
    for r, a, b in zip(ref, step, chunked):
        assert b.dtype == dtype
        err_step = ((a.double() - r).norm() / r.norm()).item()
        err_chunk = ((b.double() - r).norm() / r.norm()).item()
        assert err_chunk <= 2 * err_step + 1e-3, (err_chunk, err_step)


def test_infinite_decay_stays_finite():
    """A log-decay of -inf (an overflowed exp) zeroes the state in both scans; the chunked
    one must not turn it into inf - inf."""
    T = 20
    gdn, ssd = _scan_inputs(T)
    gdn["g"][5] = float("-inf")  # one token forgets everything before it
    ssd["A"][0] = float("-inf")  # head 0 keeps no state from one token to the next
    step, chunked = _run_scans(gdn, ssd, T, 1), _run_scans(gdn, ssd, T, 8)
    for a, b in zip(step, chunked):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


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
@settings(max_examples=examples(15))
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


@pytest.mark.parametrize("chunk", [1, 2, 64])
def test_roots_continue_their_own_external_slot(chunk):
    """external_layout (context parallelism): roots continuing different external slots start from
    their own slot's state, a root without one from zero; the captured state is the one after its
    token (its segment cut there)."""
    import numpy as np

    from treelit.ssm.layout import external_layout
    from treelit.ssm.scan import chunked_scan, gdn_chunk, gdn_step

    T = 7
    gdn, _ = _scan_inputs(T=T)
    H, K, V = gdn["q"].shape[1], gdn["q"].shape[2], gdn["v"].shape[2]
    args = (gdn["q"], gdn["k"], gdn["v"], gdn["beta"], gdn["g"], K**-0.5)
    parent = np.array([-1, 0, 1, -1, -1, 4, 5])   # 0 -> 1 -> 2 | 3 | 4 -> 5 -> 6
    root_slot = np.array([1, -1, -1, 0, -1, -1, -1])  # token 0 continues slot 1, token 3 slot 0, token 4 none
    lay = external_layout(parent, root_slot, np.zeros((T, 0), np.int64), 0, 1, np.array([1]), "cpu")
    init = torch.randn(2, H, K, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out, cap = chunked_scan(gdn_chunk(*args), lay, (H, K, V), (H, V), gdn["q"], init, chunk)
    step = gdn_step(*args)

    def chain(tokens, S):
        outs, states = [], []
        for t in tokens:
            S, o = step(S[None], torch.tensor([t]))
            S = S[0]
            outs.append(o[0])
            states.append(S)
        return outs, states

    a, sa = chain([0, 1, 2], init[1])
    b, _ = chain([3], init[0])
    c, _ = chain([4, 5, 6], torch.zeros(H, K, V, dtype=torch.float64))
    torch.testing.assert_close(out, torch.stack(a + b + c), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cap, sa[1][None], rtol=1e-12, atol=1e-12)
