"""``segment``'s batched prefix units: the sibling groups of different parents (and single
chains under different prefixes) in one padded pair of calls, against ``sdpa_dense`` on
outputs and every gradient - with one-token segments, external keys and windows."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treelit
from strategies import examples
from treelit.attention import get_backend
from treelit.attention.segment import SegmentAttention, _bucket_units
from treelit.models.context import TreeLayout


def agent_tree(depth: int, k: int, lengths, seed: int = 0):
    """``k ** depth`` leaves: every node has ``k`` children; segment lengths drawn from ``lengths``."""
    rng = random.Random(seed)
    token = iter(range(10, 10**6))
    paths = [[next(token) for _ in range(rng.choice(lengths))]]
    for _ in range(depth):
        paths = [p + [next(token) for _ in range(rng.choice(lengths))] for p in paths for _ in range(k)]
    return paths


def layout_of(branches, n_ext: int = 0, window=None, partial: bool = False):
    """The row's keys after ``n_ext`` external keys (an ancestor path above the row, visible to every
    query; with ``partial`` the last one is visible only to the subtree of the second segment)."""
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    N = batch.num_tokens
    idx = torch.arange(N)
    if not n_ext:
        layout = TreeLayout(batch, idx, batch.subtree_end, 0)
        return layout if window is None else layout.with_window(window)
    pos = batch.position_ids + n_ext
    batch = treelit.TreeBatch(**{**batch.__dict__, "position_ids": pos})
    lo = torch.zeros(n_ext, dtype=torch.long)
    hi = torch.full((n_ext,), N, dtype=torch.long)
    if partial:
        s = int(batch.seg_start[1])
        lo[-1], hi[-1] = s, int(batch.subtree_end[s])
    kv_pos = torch.cat([torch.arange(n_ext), pos])
    layout = TreeLayout(batch, torch.cat([lo, idx]), torch.cat([hi, batch.subtree_end]), n_ext, kv_pos)
    return layout if window is None else layout.with_window(window)


def compare(backend, layout, dtype=torch.float64, Hq=4, Hkv=2, D=8):
    g = torch.Generator().manual_seed(0)
    N, E = layout.num_queries, layout.num_external
    q = torch.randn(1, Hq, N, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(1, Hkv, E + N, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(1, Hkv, E + N, D, generator=g, dtype=dtype, requires_grad=True)
    probe = torch.randn(1, Hq, N, D, generator=g, dtype=dtype)
    dense = get_backend("sdpa_dense")
    ref = dense(q, k, v, dense.plan(layout))
    gref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    out = backend(q, k, v, backend.plan(layout))
    gout = torch.autograd.grad((out * probe).sum(), (q, k, v))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip("qkv", gout, gref):
        torch.testing.assert_close(a, b, **tol, msg=f"grad {name}")


def batched(plan):
    return [g for g in plan.groups if g.units]


def test_sibling_groups_of_one_level_share_one_call():
    """A 3-level tree with 27 leaves of equal segment lengths: the sibling pairs under the nine
    level-2 nodes (different prefixes) run as one batched call, and the calls number the
    levels, not the 13 sibling groups."""
    branches = agent_tree(3, 3, [6])
    layout = layout_of(branches)
    plan = SegmentAttention().plan(layout)
    units = sorted(g.units for g in batched(plan))
    assert units == [1, 3, 9]  # one call per level: 1, 3 and 9 sibling groups
    assert len(plan.groups) == 4  # and the chain of first children, on slices
    assert plan.cost == plan.exact_cost  # equal lengths: no padding
    compare(SegmentAttention(), layout)
    compare(SegmentAttention(), layout, torch.float32)


@pytest.mark.parametrize("lengths", [[1], [1, 2], [1, 5, 9]], ids=["one", "one_two", "mixed"])
@pytest.mark.parametrize("backend", [{}, {"batch_below": 3}, {"share_prefixes": False}], ids=["default", "below3", "noshare"])
def test_one_token_segments_and_padding(lengths, backend):
    layout = layout_of(agent_tree(3, 3, lengths, seed=len(lengths)))
    compare(SegmentAttention(**backend), layout)
    compare(SegmentAttention(**backend), layout, torch.float32)


@pytest.mark.parametrize("partial", [False, True], ids=["regular", "partial"])
@pytest.mark.parametrize("n_ext", [1, 3])
def test_external_keys(n_ext, partial):
    """External keys join every unit's prefix (padded prefixes of different lengths in one
    call); a key visible to part of the row sends those chains to the masked path."""
    layout = layout_of(agent_tree(2, 3, [1, 4, 7], seed=3), n_ext=n_ext, partial=partial)
    backend = SegmentAttention(bucket_waste=1.5)
    assert any(g.units > 1 for g in batched(backend.plan(layout)))
    compare(backend, layout)
    compare(SegmentAttention(), layout)


@pytest.mark.parametrize("window", [2, 5, 10**6])
def test_windows(window):
    """A window that can act takes the banded plan; one that cannot (10**6) leaves the batched
    units in place; both equal the dense windowed reference."""
    layout = layout_of(agent_tree(2, 3, [1, 3, 6], seed=4), n_ext=2, window=window)
    if window == 10**6:
        assert layout.window is None and batched(SegmentAttention().plan(layout))
    compare(SegmentAttention(window_block=3), layout)


def test_padded_slots_are_finite_in_half_precision():
    """Padded slots (they read real queries; in the backward pass their gradient is zero and
    their log-sum-exp +inf) keep every output and gradient finite in bfloat16."""
    layout = layout_of(agent_tree(2, 3, [1, 2, 9], seed=5))
    g = torch.Generator().manual_seed(0)
    N = layout.num_queries
    q, k, v = (torch.randn(1, h, N, 8, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    backend = SegmentAttention()
    out = backend(q, k, v, backend.plan(layout))
    out.float().sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t.float()).all()


@pytest.mark.parametrize("waste", [1.5, None], ids=["1.5", "default"])
def test_buckets_keep_padding_within_the_waste_factor(waste):
    """Every bucket's padded work stays within the factor (the default: 1.1), and every unit
    lands in exactly one bucket."""
    units = [[(0, n, list(range(p)))] for n, p in [(4, 100), (5, 90), (40, 100), (4, 10), (30, 300), (5, 95), (6, 88)]]
    buckets = _bucket_units(units) if waste is None else _bucket_units(units, waste=waste)
    for bucket in buckets:
        A = max(sum(b - a for a, b, _ in u) for u in bucket)
        P = max(len(u[0][2]) for u in bucket)
        L = max(b - a for u in bucket for a, b, _ in u)
        real = sum((b - a) * len(p) + (b - a) * (b - a + 1) // 2 for u in bucket for a, b, p in u)
        chains = sum(len(u) for u in bucket)
        assert len(bucket) * A * P + chains * L * (L + 1) // 2 <= (waste or 1.1) * real or len(bucket) == 1
    assert sorted(id(u) for b in buckets for u in b) == sorted(id(u) for u in units)
    assert any(len(b) > 1 for b in buckets)  # similar units still share a call


@settings(max_examples=examples(15), deadline=None)
@given(depth=st.integers(1, 3), k=st.integers(2, 3), lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       seed=st.integers(0, 100), n_ext=st.integers(0, 2))
def test_random_agent_trees(depth, k, lengths, seed, n_ext):
    compare(SegmentAttention(), layout_of(agent_tree(depth, k, lengths, seed), n_ext=n_ext))


def grpo_group(prompt: int, completions: int, length: int, under=()):
    """``completions`` branches of ``length`` tokens under one ``prompt``-token prefix, itself
    below the token paths ``under`` (branches off the prompt's first token; longer ones come first)."""
    token = iter(range(10, 10**6))
    head = [next(token) for _ in range(prompt)]
    grp = [head + [next(token) for _ in range(length)] for _ in range(completions)]
    other = [[head[0]] + [next(token) for _ in range(n)] for n in under]
    return other + grp


@pytest.mark.parametrize("prompt,completions,length,under,n_ext", [
    (5, 6, 4, (), 0),
    (3, 5, 1, (), 0),  # one-token completions
    (1, 4, 3, (), 0),  # one-token prompt
    (4, 6, 2, (), 3),  # external keys before the prompt
    (4, 3, 3, (20,), 0),  # the group under a second child: a prefix that is not one run of the row
    (4, 3, 3, (20,), 2),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grpo_group_reads_views_of_the_row(prompt, completions, length, under, n_ext, dtype):
    """A GRPO group's completions after the first (equal lengths, in row order) form one unit
    with no padded slot: its queries and own keys are a range of the row, its prefix a range when
    the prompt's path is one run, and outputs and every gradient equal ``sdpa_dense``."""
    layout = layout_of(grpo_group(prompt, completions, length, under), n_ext)
    backend = SegmentAttention()
    plan = backend.plan(layout)
    (g,) = [g for g in plan.groups if g.units and g.n == completions - 1]
    assert g.q_range is not None and g.q_idx is None and g.pre_slots is None
    assert g.lq == length and g.lp == n_ext + prompt
    assert (g.pre_range is not None) == (not under)
    compare(backend, layout, dtype=dtype)


def test_unequal_completions_keep_the_padded_path():
    """Completions of different lengths need padded slots: the gathered path, still exact."""
    branches = grpo_group(4, 4, 3)
    branches[-1], branches[-2] = branches[-1] + [998], branches[-2] + [999]  # the first child takes one
    layout = layout_of(branches)
    backend = SegmentAttention()
    (g,) = [g for g in backend.plan(layout).groups if g.units]
    assert g.q_range is None and g.pre_slots is not None
    compare(backend, layout)


@pytest.mark.parametrize("n_ext,partial", [(0, False), (2, False), (2, True)], ids=["plain", "external", "irregular"])
def test_every_read_of_q_k_v_goes_through_one_node(n_ext, partial):
    """All groups of a layer read q, k and v through one autograd node, so the backward adds
    every read's gradient into one buffer per tensor: no per-read full-row zero gradient and
    no sum of them. The row has all kinds of groups (a chain on slices, batched units, padded
    roots of a packed row, and with ``partial`` a masked group); the result still equals the
    dense reference."""
    layout = layout_of(agent_tree(3, 3, [1, 4, 9], seed=6) + [[1, 2], [3], [4, 5, 6]], n_ext=n_ext, partial=partial)
    backend = SegmentAttention(batch_below=3)
    plan = backend.plan(layout)
    kinds = {"units" if g.units else "mask" if g.mask is not None else "slice" if g.q_slice else "padded"
             for g in plan.groups}
    # the roots are padded together, unless external keys give them a prefix (then: units)
    assert kinds == {"units", "slice"} | ({"mask"} if partial else set()) | (set() if n_ext else {"padded"})
    N, E = layout.num_queries, layout.num_external
    q, k, v = (torch.randn(1, h, n, 8, dtype=torch.float64, requires_grad=True) for h, n in ((4, N), (2, E + N), (2, E + N)))
    out = backend(q, k, v, plan)
    readers = {id(t): [] for t in (q, k, v)}
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            leaf = getattr(nxt, "variable", None)
            if leaf is not None and id(leaf) in readers:
                readers[id(leaf)].append(type(node).__name__)
            stack.append(nxt)
    assert all(r == ["_SegmentLayerBackward"] for r in readers.values()), readers
    compare(backend, layout)


@pytest.mark.parametrize("partial", [False, True], ids=["units", "masked"])
def test_padded_slots_stay_exact_with_large_scores(partial):
    """Padded query slots read real queries. With scores far beyond exp's range (queries x 2000),
    a padded slot's probabilities must still be exactly 0 in the backward pass (log-sum-exp
    +inf), not inf x 0: outputs and every gradient equal the dense reference (float64)."""
    branches = grpo_group(5, 4, 3)
    branches[-1], branches[-2] = branches[-1] + [998, 997], branches[-2] + [999]  # unequal: padded slots
    layout = layout_of(branches, n_ext=2, partial=partial)
    backend = SegmentAttention()
    plan = backend.plan(layout)
    assert any((g.units and g.q_range is None) or g.mask is not None for g in plan.groups)
    N, E = layout.num_queries, layout.num_external
    g = torch.Generator().manual_seed(3)
    q = (2000 * torch.randn(1, 4, N, 8, generator=g, dtype=torch.float64)).requires_grad_()
    k, v = (torch.randn(1, 2, E + N, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    probe = torch.randn(1, 4, N, 8, generator=g, dtype=torch.float64)
    ref_backend = get_backend("sdpa_dense")
    ref = ref_backend(q, k, v, ref_backend.plan(layout))
    gref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    out = backend(q, k, v, plan)
    got = torch.autograd.grad((out * probe).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(got, gref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_output_is_token_major():
    """The output is a view of a ``[tokens, heads, D]`` buffer (the layout the output
    projection reads), so ``transpose(1, 2).reshape(1, N, H * D)`` copies nothing; the
    gradients come back in the inputs' shapes."""
    layout = layout_of(agent_tree(2, 3, [1, 4, 7], seed=2))
    N = layout.num_queries
    backend = SegmentAttention()
    q, k, v = (torch.randn(1, n, h, 8, requires_grad=True) for h, n in ((4, N), (2, N), (2, N)))
    out = backend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend.plan(layout))
    assert out.shape == (1, 4, N, 8) and out.transpose(1, 2).is_contiguous()
    flat = out.transpose(1, 2).reshape(1, N, 32)
    assert flat.data_ptr() == out.data_ptr()
    flat.square().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


@pytest.mark.parametrize("n_ext,window", [(0, None), (2, None), (0, 3)], ids=["plain", "external", "window"])
def test_layers_ask_the_host_nothing(n_ext, window):
    """The groups' index tensors are made with the plan, once per forward: no layer, the first
    included, reads an index back to the host or uploads one (before, the first layer did both,
    once per group); and the plan's own index tensors are the layer's."""
    from treelit.utils.dispatch import DispatchCounter

    layout = layout_of(agent_tree(3, 3, [1, 4, 9], seed=6) + [[1, 2], [3], [4, 5, 6]], n_ext=n_ext, window=window)
    backend = SegmentAttention(batch_below=3)
    plan = backend.plan(layout)
    N, E = layout.num_queries, layout.num_external
    q, k, v = (torch.randn(1, h, n, 8, dtype=torch.float64, requires_grad=True) for h, n in ((4, N), (2, E + N), (2, E + N)))
    for _ in range(2):  # the first layer and a later one
        with DispatchCounter() as c:
            torch.autograd.grad(backend(q, k, v, plan), (q, k, v), torch.ones(1, 4, N, 8, dtype=torch.float64))
        assert c.counts.syncs == 0 and c.counts.uploads == 0, c.counts.as_dict()
    assert plan._works[0] == (N, E)
    compare(backend, layout)
