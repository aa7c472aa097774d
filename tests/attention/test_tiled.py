"""``segment``'s math path (CUDA, or CPU with ``merged.MATH_ON_CPU``): a layer as one batch of tiles.

Exactness against ``sdpa_dense`` (float64, outputs and q, k, v gradients to 1e-10; a model's loss
and every parameter gradient) on random trees with the nasty cases, external keys visible to
parts of the row, sliding windows, grouped query heads, tiny blocks (many tiles per block and
blocks that cross segments) and tiles split over several calls; and the launches of one layer,
forward and backward, counted on CPU: the same number whatever the tree.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treelit
from helpers import FAMILIES, assert_equivalent, cached_model
from strategies import examples, forests
from test_backends import compare, random_layout
from test_segment_batched import agent_tree, layout_of
from treelit.attention import merged, tiled
from treelit.attention.segment import SegmentAttention
from treelit.attention.tiled import TiledPlan
from treelit.utils.dispatch import DispatchCounter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from segment_math_launches import fanout, grpo, turns  # noqa: E402


@contextlib.contextmanager
def math_path(block_q=None, block_k=None, chunk_bytes=None):
    """CPU tensors down the CUDA path, with other block sizes / call budget for the duration."""
    saved = merged.MATH_ON_CPU, tiled.BLOCK_Q, tiled.BLOCK_K, tiled.CHUNK_BYTES
    merged.MATH_ON_CPU = True
    tiled.BLOCK_Q, tiled.BLOCK_K = block_q or tiled.BLOCK_Q, block_k or tiled.BLOCK_K
    tiled.CHUNK_BYTES = chunk_bytes
    try:
        yield
    finally:
        merged.MATH_ON_CPU, tiled.BLOCK_Q, tiled.BLOCK_K, tiled.CHUNK_BYTES = saved


BLOCKS = st.sampled_from([(1, 1), (2, 3), (3, 8), (8, 4), (64, 128)])
HEADS = st.sampled_from([(4, 2), (3, 3), (6, 1)])


@settings(max_examples=examples(40), deadline=None)
@given(data=forests(max_branches=8, max_len=12), n_ext=st.integers(0, 3), blocks=BLOCKS, heads=HEADS,
       split=st.booleans(), seed=st.integers(0, 10))
def test_random_trees_match_dense(data, n_ext, blocks, heads, split, seed):
    """Duplicates, prefixes, one-token segments, external keys each visible to a random subtree."""
    batch = treelit.TokenTree.from_branches(data[0]).to_batch()
    layout = random_layout(batch, n_ext, torch.Generator().manual_seed(seed))
    with math_path(*blocks, chunk_bytes=1 if split else None):
        plan = SegmentAttention().plan(layout)
        assert isinstance(plan, TiledPlan)
        compare(SegmentAttention(), layout, torch.float64, Hq=heads[0], Hkv=heads[1], seed=seed)


@settings(max_examples=examples(20), deadline=None)
@given(depth=st.integers(1, 3), k=st.integers(2, 3), lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       seed=st.integers(0, 50), n_ext=st.integers(0, 3), partial=st.booleans(),
       window=st.sampled_from([None, 1, 2, 5, 17]), blocks=BLOCKS)
def test_agent_trees_external_keys_and_windows_match_dense(depth, k, lengths, seed, n_ext, partial, window, blocks):
    layout = layout_of(agent_tree(depth, k, lengths, seed), n_ext=n_ext, window=window, partial=partial and n_ext > 0)
    with math_path(*blocks):
        compare(SegmentAttention(), layout, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_and_several_calls(dtype):
    """float32 to 1e-4 against float64 dense; bfloat16 finite, computed in float32 (outputs and
    gradients within a few bfloat16 ulps), and the same with the tiles split over several calls."""
    layout = layout_of(agent_tree(3, 3, [1, 6, 20], seed=7), n_ext=2)
    N, E = layout.num_queries, layout.num_external
    g = torch.Generator().manual_seed(0)
    q, probe = (torch.randn(1, 4, N, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, E + N, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dense = treelit.attention.get_backend("sdpa_dense")

    def run(backend, *xs):
        xs = [x.detach().requires_grad_() for x in xs]
        out = backend(*xs, backend.plan(layout))
        return (out,) + torch.autograd.grad((out * probe.to(out.dtype)).sum(), xs)

    ref = run(dense, q, k, v)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for chunk in (None, 1):
        with math_path(chunk_bytes=chunk):
            got = run(SegmentAttention(), *(x.to(dtype) for x in (q, k, v)))
        for a, b in zip(got, ref):
            assert a.dtype == dtype and torch.isfinite(a.float()).all()
            assert ((a.double() - b).norm() / b.norm()).item() < tol


@pytest.mark.parametrize("family", FAMILIES[:2])
@settings(max_examples=examples(10), deadline=None)
@given(data=forests())
def test_model_loss_and_gradients_match_dense(family, data):
    """A tiny model on the math path with small tiles: loss and every parameter gradient equal
    ``sdpa_dense`` (float64)."""
    branches, masks, weights = data
    model = cached_model(family, torch.float64)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)

    def on_math_path():
        with math_path(3, 5):
            return treelit.tree_loss(model, tree, attention=SegmentAttention())

    assert_equivalent(model, on_math_path, lambda: treelit.tree_loss(model, tree, attention="sdpa_dense"),
                      torch.float64, f"{family} math path", forest=data)


# --- launches ------------------------------------------------------------------------------------


TREES = {
    "grpo_4": lambda: grpo(4), "grpo_64": lambda: grpo(64),
    "turns_8": lambda: turns(8), "turns_64": lambda: turns(64),
    "fanout_depth_2": lambda: fanout(2, seed=2), "fanout_depth_4": lambda: fanout(4, seed=4),
}


def layer_counts(branches, dtype=torch.float32):
    """What one layer's attention dispatches, forward and backward, on the math path (the plan,
    built once per forward for every layer, is not counted here)."""
    layout = layout_of(branches, n_ext=3)
    N, E = layout.num_queries, layout.num_external
    with math_path():
        backend = SegmentAttention()
        with DispatchCounter() as planning:
            plan = backend.plan(layout)
        q = torch.randn(1, 4, N, 16, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, 2, E + N, 16, dtype=dtype, requires_grad=True) for _ in range(2))
        g = torch.randn(1, 4, N, 16, dtype=dtype)
        with DispatchCounter() as layer:
            torch.autograd.grad(backend(q, k, v, plan), (q, k, v), g)
    return layer.counts, planning.counts, layout.batch.num_segments


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launches_per_layer_do_not_grow_with_the_tree(dtype):
    """GRPO with 4 and 64 completions, a branch at every turn over 8 and 64 turns, agent trees of
    depth 2 and 4 (5 to 128 segments): one layer's forward and backward dispatch the same
    operators, and ask the host nothing; the plan uploads its indices once."""
    counts = {name: layer_counts(make(), dtype) for name, make in TREES.items()}
    segments = sorted(s for _, _, s in counts.values())
    assert segments[0] <= 5 and segments[-1] >= 120
    first = next(iter(counts.values()))[0]
    assert first.launches <= (55 if dtype == torch.float32 else 67), first.ops
    for name, (layer, planning, _) in counts.items():
        assert layer.ops == first.ops, name
        assert layer.syncs == 0 and layer.uploads == 0, (name, layer.as_dict())
        assert planning.uploads == 1 and planning.syncs <= 2, (name, planning.as_dict())


def test_traces_into_one_graph_with_equal_gradients():
    """``torch.compile`` (``fullgraph``, the ``aot_eager`` backend: tracing and functionalization,
    no code generation) traces a layer's forward and backward without a break, and its gradients
    equal eager ones exactly (float64): the layer updates no permuted view in place."""
    layout = layout_of(turns(8), n_ext=2)
    N, E = layout.num_queries, layout.num_external
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, N, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, E + N, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    with math_path():
        backend = SegmentAttention()
        plan = backend.plan(layout)

        def loss(q, k, v):
            return backend(q, k, v, plan).square().sum()

        ref = torch.autograd.grad(loss(q, k, v), (q, k, v))
        torch._dynamo.reset()
        got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
