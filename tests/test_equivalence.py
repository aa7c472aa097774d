"""Tree mode == per-branch (linearized) training: loss and every parameter gradient.

float64 to 1e-9 relative, float32 to 1e-4 (max over parameters of ||dg|| / ||g||),
for every model family and aggregation mode, on random forests with the nasty
cases (duplicates, prefixes, last-token variants, one-token branches, masks that
differ on shared tokens), packed rows and gradient accumulation. Family, backend,
dtype and aggregation are parametrized, so every combination gets its own forests;
every forest trains something in every tree.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treelit
from helpers import FAMILIES, assert_equivalent, cached_model
from strategies import examples, forests
from treelit.attention.segment import SegmentAttention

DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["f64", "f32"]
BACKENDS = ["sdpa_dense", "segment"]


def backend(name):
    """Backends under test; ``segment`` batching chains of up to 3 tokens, so that both
    its batched and its per-chain paths run."""
    return SegmentAttention(batch_below=3) if name == "segment" else name


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=examples(8))
@given(data=forests())
def test_random_forests(family, aggregation, dtype, attention, data):
    branches, masks, weights = data
    model = cached_model(family, dtype)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, tree, aggregation, attention=backend(attention)),
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation),
        dtype,
        f"{family}/{aggregation}/{dtype}/{attention}",
        forest=data,
    )


NASTY = {
    "single_branch": ([[1, 2, 3, 4]], None, None),
    "duplicates": ([[1, 2, 3], [1, 2, 3], [1, 2, 3, 4]], None, [1.0, 2.0, 0.5]),
    "prefix_of_another": ([[1, 2, 3, 4, 5], [1, 2, 3]], [[1, 1, 1, 0, 1], [0, 1, 1]], None),
    "differ_in_last_token": ([[4, 3, 2, 1], [4, 3, 2, 0], [4, 3, 2, 5]], None, None),
    "one_token_branches": ([[1], [2], [1, 3], [3]], None, None),
    "one_token_segments": ([[1, 2], [1, 3], [1, 2, 4], [1, 2, 5], [1, 3, 6, 7]], None, None),
    "masks_differ_on_shared": (
        [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]],
        [[0, 1, 0, 1], [0, 0, 1, 1], [1, 1, 1]],
        [1.0, 3.0, 0.5],
    ),
    "zero_weights": ([[1, 2, 3], [1, 2, 4]], None, [0.0, 1.0]),
    "no_targets": ([[1, 2, 3]], [[0, 0, 0]], None),
}


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("case", sorted(NASTY))
def test_nasty_cases(family, case, aggregation, dtype, attention):
    branches, masks, weights = NASTY[case]
    model = cached_model(family, dtype)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, tree, aggregation, attention=backend(attention)),
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation),
        dtype,
        case,
        require_grad=case != "no_targets",  # the one case that checks an untrained tree gives 0
    )


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=examples(4))
@given(parts=st.lists(forests(max_branches=4), min_size=2, max_size=4))
def test_several_trees_packed_in_one_row(family, aggregation, attention, parts):
    model = cached_model(family, torch.float64)
    packed = treelit.TreeBatch.pack([treelit.TokenTree.from_branches(*p).to_batch() for p in parts])
    branches = [b for p in parts for b in p[0]]
    masks = [m for p in parts for m in p[1]]
    weights = [w for p in parts for w in p[2]]
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, packed, aggregation, attention=backend(attention)),
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation),
        torch.float64,
        "packed",
        forest=parts,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=examples(4))
@given(parts=st.lists(forests(max_branches=4), min_size=2, max_size=4))
def test_gradient_accumulation_over_micro_batches(family, aggregation, dtype, parts):
    """Micro-batches backward separately with the step-global normaliser == one big step."""
    model = cached_model(family, dtype)
    batches = [treelit.TokenTree.from_branches(*p).to_batch() for p in parts]
    Z = treelit.global_normalizer(batches, aggregation)
    branches = [b for p in parts for b in p[0]]
    masks = [m for p in parts for m in p[1]]
    weights = [w for p in parts for w in p[2]]

    def accumulated():
        total = 0.0
        for b in batches:
            loss = treelit.tree_loss(model, b, aggregation, attention="sdpa_dense", normalizer=Z)
            loss.backward()
            total = total + loss.detach()
        # the helper calls backward on what we return: return a zero-gradient carrier
        return total + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(
        model,
        accumulated,
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation),
        dtype,
        "accumulated",
        forest=parts,
    )


def test_linear_backward_matches_linear_loss(family):
    model = cached_model(family, torch.float64)
    branches, masks, weights = NASTY["masks_differ_on_shared"]

    def via_backward():
        value = treelit.linear_backward(model, branches, masks, weights, "token-mean", max_tokens=4)
        return torch.tensor(value, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(
        model, via_backward, lambda: treelit.linear_loss(model, branches, masks, weights), torch.float64, "mb"
    )


class _PlanSpy(SegmentAttention):
    """``segment`` that keeps the plans it builds."""

    def __init__(self) -> None:
        super().__init__()
        self.plans = []

    def plan(self, layout):
        self.plans.append(super().plan(layout))
        return self.plans[-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("length", [1, 3])
def test_grpo_group_read_as_views(family, aggregation, dtype, length):
    """A GRPO group (equal completions under one prompt, prompt untrained, one weight per
    completion) takes ``segment``'s view path for the completions after the first; loss and
    every parameter gradient equal per-branch training."""
    prompt = [1, 2, 3, 4, 5]
    branches = [prompt + [(6 + 3 * i + j) % 11 for j in range(length)] for i in range(5)]  # vocabulary 11
    masks = [[0] * len(prompt) + [1] * length for _ in branches]
    weights = [1.0, 0.5, 2.0, 0.25, 3.0]
    model = cached_model(family, dtype)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)
    spy = _PlanSpy()
    assert_equivalent(
        model,
        lambda: treelit.tree_loss(model, tree, aggregation, attention=spy),
        lambda: treelit.linear_loss(model, branches, masks, weights, aggregation),
        dtype,
        f"grpo length {length}",
        forest=(branches, masks, weights),
    )
    views = [g for p in spy.plans for g in p.groups if g.q_range is not None]
    assert views and all(g.n == 4 and g.lq == length and g.pre_range == (0, len(prompt)) for g in views)
