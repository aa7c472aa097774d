"""Every tree attention backend against ``sdpa_dense``: outputs and all gradients,
with GQA and with externally supplied ancestor keys/values."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treelit
from strategies import examples, forests
from treelit.attention import get_backend
from treelit.attention.segment import SegmentAttention
from treelit.models.context import TreeLayout

CPU_BACKENDS = {
    "segment": lambda: SegmentAttention(),  # short chains batched with padding
    "segment_unbatched": lambda: SegmentAttention(batch_below=0),  # every chain on its own
    "segment_batch3": lambda: SegmentAttention(batch_below=3),  # mixed
    "segment_noshare": lambda: SegmentAttention(share_prefixes=False),  # siblings not merged
}


def random_layout(batch, n_ext: int, gen: torch.Generator):
    """Row keys plus ``n_ext`` external keys, each visible to a random subtree of the row."""
    N = batch.num_tokens
    idx = torch.arange(N)
    if n_ext == 0:
        return TreeLayout(batch, idx, batch.subtree_end, 0)
    roots = torch.randint(0, N, (n_ext,), generator=gen)
    # visible to a subtree starting at a segment start, or to the whole row
    starts = batch.seg_start[torch.randint(0, batch.num_segments, (n_ext,), generator=gen)]
    whole = torch.rand(n_ext, generator=gen) < 0.5
    lo = torch.where(whole, torch.zeros_like(starts), starts)
    hi = torch.where(whole, torch.full_like(starts, N), batch.subtree_end[starts])
    del roots
    return TreeLayout(batch, torch.cat([lo, idx]), torch.cat([hi, batch.subtree_end]), n_ext)


def compare(backend, layout, dtype, Hq=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, E = layout.num_queries, layout.num_external
    q = torch.randn(1, Hq, N, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(1, Hkv, E + N, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(1, Hkv, E + N, D, generator=g, dtype=dtype, requires_grad=True)
    probe = torch.randn(1, Hq, N, D, generator=g, dtype=dtype)
    ref_backend = get_backend("sdpa_dense")
    ref = ref_backend(q, k, v, ref_backend.plan(layout))
    gref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    out = backend(q, k, v, backend.plan(layout))
    gout = torch.autograd.grad((out * probe).sum(), (q, k, v))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip("qkv", gout, gref):
        torch.testing.assert_close(a, b, **tol, msg=f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", sorted(CPU_BACKENDS))
@settings(max_examples=examples(20))
@given(data=forests(max_branches=6, max_len=12), n_ext=st.integers(0, 4))
def test_matches_dense_on_random_forests(name, dtype, data, n_ext):
    batch = treelit.TokenTree.from_branches(data[0]).to_batch()
    layout = random_layout(batch, n_ext, torch.Generator().manual_seed(n_ext))
    compare(CPU_BACKENDS[name](), layout, dtype)


@pytest.mark.parametrize("name", sorted(CPU_BACKENDS))
def test_matches_dense_on_a_packed_row(name):
    trees = [treelit.TokenTree.from_branches([[1, 2, 3, 4], [1, 2, 5]]), treelit.TokenTree.from_branches([[7] * 9, [7, 8]])]
    batch = treelit.TreeBatch.pack([t.to_batch() for t in trees])
    compare(CPU_BACKENDS[name](), TreeLayout(batch, torch.arange(batch.num_tokens), batch.subtree_end, 0), torch.float64)


def test_segment_cost_follows_segments_not_rows():
    """16 branches of 64 tokens under a 32-token prefix: the computed pairs stay close to
    the per-branch causal cost, far below the dense N x N."""
    prefix = list(range(32))
    branches = [prefix + [100 + b] * 1 + list(range(200, 263)) for b in range(16)]
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    layout = TreeLayout(batch, torch.arange(batch.num_tokens), batch.subtree_end, 0)
    plan = SegmentAttention().plan(layout)
    N = batch.num_tokens
    causal_branches = sum(len(b) * (len(b) + 1) // 2 for b in branches)
    assert plan.exact_cost <= causal_branches
    assert plan.cost < 0.5 * N * N


def test_siblings_share_one_prefix_call():
    """A fan-out plans its sibling chains as shared-prefix groups (one prefix call), split
    where lengths differ a lot; outputs and gradients still match the dense reference."""
    prefix = list(range(40))
    branches = [prefix + [100 + b] + [300 + b] * 20 for b in range(4)]
    branches += [prefix + [200 + b] + [400 + b] * 2 for b in range(4)]  # much shorter siblings
    branches.append(prefix + [99] + [500] * 120)  # one long sibling
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    layout = TreeLayout(batch, torch.arange(batch.num_tokens), batch.subtree_end, 0)
    backend = SegmentAttention()
    plan = backend.plan(layout)
    shared = sorted((g.n, g.lq) for g in plan.groups if g.shared)
    assert shared == [(2, 3), (6, 21)]  # padding within 1.5x; the long one alone
    assert not any(g.shared for g in SegmentAttention(share_prefixes=False).plan(layout).groups)
    compare(backend, layout, torch.float64)
    compare(backend, layout, torch.float32)


@pytest.mark.parametrize("name", sorted(CPU_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_dtype_and_matches_float32(name, dtype):
    """bf16/fp16 inputs: outputs and gradients keep the dtype and agree with the float32
    dense reference to the precision of the format."""
    branches = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8], [1, 2, 3, 9], [1, 2, 10, 11]]
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    layout = random_layout(batch, 2, torch.Generator().manual_seed(1))
    N, E = layout.num_queries, layout.num_external
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, h, n, 8, generator=g) for h, n in ((4, N), (2, E + N), (2, E + N))]
    probe = torch.randn(1, 4, N, 8, generator=g)

    def run(backend, dt):
        q, k, v = (t.to(dt).requires_grad_() for t in base)
        out = backend(q, k, v, backend.plan(layout))
        (out.float() * probe).sum().backward()
        return [out, q.grad, k.grad, v.grad]

    got = run(CPU_BACKENDS[name](), dtype)
    ref = run(get_backend("sdpa_dense"), torch.float32)
    atol = 5e-2 if dtype == torch.bfloat16 else 5e-3
    for what, a, b in zip(["out", "dq", "dk", "dv"], got, ref):
        assert a.dtype == dtype, what
        torch.testing.assert_close(a.float(), b, rtol=0, atol=atol * b.abs().max().item(), msg=what)


def test_bad_option():
    with pytest.raises(ValueError, match="batch_below must be >= 0"):
        SegmentAttention(batch_below=-1)
    for bad in (0.5, float("nan")):
        with pytest.raises(ValueError, match="bucket_waste must be >= 1"):
            SegmentAttention(bucket_waste=bad)


@pytest.mark.parametrize("name", ["segment", "flex"])
def test_config_group_lists_every_option_with_the_backends_default(name):
    """``conf/attention/<name>.yaml`` names each constructor option with its default, so
    ``attention.<option>=...`` needs no ``+`` and the file cannot drift from the code."""
    import inspect

    from omegaconf import OmegaConf

    from treelit.attention import ATTENTION
    from treelit.cli.config import CONF_DIR

    node = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF_DIR, "attention", f"{name}.yaml")))
    options = {k: v for k, v in node.items() if k not in ("_target_", "name")}
    defaults = {k: p.default for k, p in inspect.signature(ATTENTION.get(name)).parameters.items()}
    assert options == defaults


def test_segment_options_from_the_command_line_reach_the_backend():
    from treelit.cli.config import compose
    from treelit.cli.train import build

    backend = build(compose(["attention=segment", "attention.bucket_waste=1.3", "attention.batch_below=64"]).attention)
    assert isinstance(backend, SegmentAttention)
    assert (backend.bucket_waste, backend.batch_below, backend.share_prefixes) == (1.3, 64, True)
    with pytest.raises(ValueError, match="bucket_waste must be >= 1"):
        build(compose(["attention=segment", "attention.bucket_waste=0.5"]).attention)


def test_unknown_backend_options_are_refused_by_name():
    from treelit.cli.config import compose
    from treelit.cli.train import build

    with pytest.raises(ValueError, match=r"attention=segment has no option attention\.bucket_wast; "
                                         r"its options: batch_below, share_prefixes, window_block, bucket_waste"):
        build(compose(["attention=segment", "+attention.bucket_wast=1.3"]).attention)
    with pytest.raises(ValueError, match=r"attention=sdpa_dense has no option attention\.block_size; it takes no options"):
        get_backend("sdpa_dense", block_size=64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merged_math_fallback_matches_cpu_kernels(dtype):
    """The non-CPU fallback of the prefix/causal merge computes what the CPU kernels do."""
    from treelit.attention import merged

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=dtype)
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=dtype)
    bias = torch.zeros(2, 1, 1, 9, dtype=dtype)
    bias[1, ..., 7:] = torch.finfo(dtype).min
    go = torch.randn(2, 4, 6, 8, generator=g, dtype=dtype)
    for causal, b, kk, vv in [(False, bias, k, v), (True, None, k[:, :, :6], v[:, :, :6])]:
        o_ref, l_ref = merged._cpu_fwd(q, kk, vv, 0.0, causal, attn_mask=b)
        o, l = merged._math_fwd(q, kk, vv, causal, b)
        torch.testing.assert_close(o, o_ref)
        torch.testing.assert_close(l, l_ref)
        ref = merged._cpu_bwd(go, q, kk, vv, o_ref, l_ref, 0.0, causal, attn_mask=b)
        for a, r in zip(merged._math_bwd(go, q, kk, vv, o_ref, l_ref, causal, b), ref):
            torch.testing.assert_close(a, r)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("queries", [1, 5, 256, 257])
def test_grouped_query_prefix_fold_matches_the_kernels_and_the_math(dtype, queries):
    """A prefix part with grouped query heads and at most ``FOLD_BELOW`` queries runs as one
    longer block per key/value head; its output, log-sum-exp and all three gradients equal the
    unfolded kernel call and the plain math (float64 1e-10). Causal parts, per-query biases and
    longer blocks are not folded."""
    from treelit.attention import merged

    g = torch.Generator().manual_seed(queries)
    q = torch.randn(3, 8, queries, 16, generator=g, dtype=dtype)
    k = torch.randn(3, 2, 11, 16, generator=g, dtype=dtype)
    v = torch.randn(3, 2, 11, 16, generator=g, dtype=dtype)
    bias = torch.zeros(3, 1, 1, 11, dtype=dtype)
    bias[1, ..., 6:] = torch.finfo(dtype).min
    bias[2, ..., 1:] = torch.finfo(dtype).min  # one visible key
    go = torch.randn(3, 8, queries, 16, generator=g, dtype=dtype)
    assert merged._foldable(q, k, False, bias) == (queries <= merged.FOLD_BELOW)
    assert not merged._foldable(q, k, True, None)
    if queries > 1:  # a bias per query
        assert not merged._foldable(q, k, False, torch.zeros(3, 1, queries, 11, dtype=dtype))
    assert not merged._foldable(q, k[:, :1].expand(3, 8, 11, 16), False, None)  # no grouping
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for b in (bias, None):
        o, lse = merged._fwd(q, k, v, False, b)
        o_ref, l_ref = merged._cpu_fwd(q, k, v, 0.0, False, attn_mask=b)[:2]
        o_math, l_math = merged._math_fwd(q, k, v, False, b)
        for a, r in ((o, o_ref), (lse, l_ref), (o, o_math), (lse, l_math)):
            torch.testing.assert_close(a, r, **tol)
        grads = merged._bwd(go, q, k, v, o_ref, l_ref, False, b)
        ref = merged._cpu_bwd(go, q, k, v, o_ref, l_ref, 0.0, False, attn_mask=b)
        math = merged._math_bwd(go, q, k, v, o_ref, l_ref, False, b)
        for name, a, r, m in zip("qkv", grads, ref, math):
            assert a.shape == r.shape
            torch.testing.assert_close(a, r, **tol, msg=f"d{name} vs kernel")
            torch.testing.assert_close(a, m, **tol, msg=f"d{name} vs math")
            assert a.abs().sum() > 0


# --- flex -------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("block_size", [16, 32])
@settings(max_examples=examples(15))
@given(data=forests(max_branches=8, max_len=12), n_ext=st.integers(0, 4))
def test_flex_block_mask_is_the_ancestor_mask(block_size, data, n_ext):
    """On CPU the BlockMask (block classification + mask_mod) is checked by expanding it:
    it must equal the dense ancestor mask exactly. No N x N tensor is used to build it."""
    from torch.nn.attention.flex_attention import create_mask  # noqa: F401  (API presence)

    from treelit.attention.flex import tree_block_mask

    batch = treelit.TokenTree.from_branches(data[0]).to_batch()
    layout = random_layout(batch, n_ext, torch.Generator().manual_seed(n_ext))
    bm = tree_block_mask(layout.kv_lo, layout.kv_hi, layout.num_queries, block_size)
    dense = bm.to_dense()  # [1, 1, Qb, Kb] block-level view
    Qb, Kb = dense.shape[-2:]
    ref = layout.dense_mask()
    N, KV = ref.shape
    for qb in range(Qb):
        for kb in range(Kb):
            block = ref[qb * block_size : (qb + 1) * block_size, kb * block_size : (kb + 1) * block_size]
            if block.any():
                assert dense[0, 0, qb, kb], "a block with visible pairs must not be skipped"
    full_num = bm.full_kv_num_blocks[0, 0]
    for qb in range(Qb):
        for kb in bm.full_kv_indices[0, 0, qb, : int(full_num[qb])].tolist():
            block = ref[qb * block_size : (qb + 1) * block_size, kb * block_size : (kb + 1) * block_size]
            assert block.all(), "a block marked full must be entirely visible"
    # element level: mask_mod over the visited blocks equals the reference
    qi = torch.arange(N)[:, None]
    ki = torch.arange(KV)[None, :]
    assert torch.equal(bm.mask_mod(0, 0, qi, ki), ref)


def test_flex_forward_on_cpu_matches_dense():
    """FlexAttention's unfused CPU forward with our BlockMask equals sdpa_dense."""
    from treelit.attention.flex import FlexTreeAttention

    batch = treelit.TokenTree.from_branches([[1, 2, 3] * 20, [1, 2, 4] * 15, [5] * 40]).to_batch()
    layout = random_layout(batch, 3, torch.Generator().manual_seed(0))
    backend = FlexTreeAttention(block_size=16, compile=False)
    g = torch.Generator().manual_seed(0)
    N, E = layout.num_queries, layout.num_external
    q = torch.randn(1, 4, N, 8, generator=g)
    k = torch.randn(1, 2, E + N, 8, generator=g)
    v = torch.randn(1, 2, E + N, 8, generator=g)
    ref = get_backend("sdpa_dense")
    torch.testing.assert_close(backend(q, k, v, backend.plan(layout)), ref(q, k, v, ref.plan(layout)), rtol=1e-5, atol=1e-5)


def test_flex_on_cpu_fails_at_configuration():
    from treelit.attention import resolve_backend

    with pytest.raises(ValueError, match="'flex' needs a CUDA device.*segment"):
        resolve_backend("flex", "cpu")


@cuda
@pytest.mark.cuda
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=forests(max_branches=8, max_len=40), n_ext=st.integers(0, 4))
def test_flex_matches_dense_on_cuda(data, n_ext):
    from treelit.attention.flex import FlexTreeAttention

    batch = treelit.TokenTree.from_branches(data[0]).to_batch().to("cuda")
    layout = random_layout(batch.to("cpu"), n_ext, torch.Generator().manual_seed(n_ext))
    layout = TreeLayout(batch, layout.kv_lo.cuda(), layout.kv_hi.cuda(), n_ext)
    compare_on(FlexTreeAttention(), layout, torch.float32, "cuda")


def compare_on(backend, layout, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    N, E = layout.num_queries, layout.num_external
    q = torch.randn(1, 4, N, 16, generator=g, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(1, 2, E + N, 16, generator=g, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(1, 2, E + N, 16, generator=g, dtype=dtype, device=device, requires_grad=True)
    ref_backend = get_backend("sdpa_dense")
    ref = ref_backend(q, k, v, ref_backend.plan(layout))
    gref = torch.autograd.grad(ref.sum(), (q, k, v))
    out = backend(q, k, v, backend.plan(layout))
    gout = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(gout, gref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
