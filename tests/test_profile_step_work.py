"""``profile_step.py``'s work-ratio row: per-branch work over tree work per column, so that
each part's measured ratio can be read against the ratio its work allows."""

import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import treelit  # noqa: E402
from bench_models import attention_model, compute_weighted_ideal, cost_model  # noqa: E402
from profile_step import work_ratios  # noqa: E402


def test_ratios_count_tokens_pairs_and_targets_of_a_small_tree():
    # [1, 2, 3, 4] and [1, 2, 5]: the tree holds 1, 2, 3, 4, 5 at depths 0, 1, 2, 3, 2
    branches, masks = [[1, 2, 3, 4], [1, 2, 5]], [[1, 1, 1, 1], [1, 1, 1]]
    case = SimpleNamespace(branches=branches, masks=masks)
    batch = treelit.TokenTree.from_branches(branches, masks).to_batch()
    model = attention_model(dim=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=16, max_seq_len=16)
    total, pairs, targets, tokens = work_ratios(model, case, batch)
    assert tokens == pytest.approx(7 / 5)
    assert pairs == pytest.approx((10 + 6) / (1 + 2 + 3 + 4 + 3))  # L(L+1)/2 per branch; depth + 1 per tree token
    assert targets == pytest.approx((3 + 2) / 4)  # every token but a branch's first is a target
    assert total == pytest.approx(compute_weighted_ideal(cost_model(model), branches, masks, batch)["ideal_compute"])
    # the compute-weighted ideal lies between its parts' ratios
    assert min(pairs, targets, tokens) < total < max(pairs, targets, tokens)


def test_parity_efficiency_weights_each_part_by_its_time():
    from profile_step import parity_efficiency

    # parts that shrink exactly by the ideal reach it
    assert parity_efficiency((12.0, 2.0, 4.0, 6.0), (3.0, 3.0, 3.0, 3.0)) == pytest.approx(1.0)
    # each part's work ratio, weighted by the part's time: here that blend equals the ideal of 3x
    eff = parity_efficiency((12.0, 4.0, 4.0, 4.0), (3.0, 2.0, 4.0, 4.0))
    assert eff == pytest.approx(12.0 / (4.0 / 2 + 4.0 / 4 + 4.0 / 4) / 3.0)
    assert eff == pytest.approx(1.0)
    # attention (the part that shrinks least) takes more of the time: parity falls below the ideal
    assert parity_efficiency((12.0, 6.0, 3.0, 3.0), (3.0, 2.0, 4.0, 4.0)) < 1.0
    # a part with no time (no attention layer: nan pairs) drops out
    assert parity_efficiency((8.0, 0.0, 4.0, 4.0), (4.0, float("nan"), 4.0, 4.0)) == pytest.approx(1.0)
