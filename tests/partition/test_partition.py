"""Partitioned == unpartitioned: loss and every gradient, every token forwarded once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treelit
from helpers import FAMILIES, RECURRENT, assert_equivalent, cached_model, has_attention, ssm_chunk_size
from strategies import examples, forests
from treelit.partition import BudgetError, PartitionStats, plan_partitions, tree_backward


def chains_ok(plan, batch):
    """Every chain of partitions fits the budget; partitions are connected and cover the row once."""
    sizes = {p.index: p.size for p in plan.partitions}
    par = {p.index: p.parent for p in plan.partitions}
    for p in plan.partitions:
        total, q = 0, p.index
        while q >= 0:
            total += sizes[q]
            q = par[q]
        assert total <= plan.budget
    allt = np.sort(np.concatenate([p.tokens for p in plan.partitions]))
    assert np.array_equal(allt, np.arange(batch.num_tokens))
    parent = batch.parent.numpy()
    owner = np.empty(batch.num_tokens, dtype=int)
    for p in plan.partitions:
        owner[p.tokens] = p.index
    for p in plan.partitions:
        inside = [t for t in p.tokens if parent[t] < 0 or owner[parent[t]] != p.index]
        assert len(inside) == 1, "a partition is connected: exactly one token has its parent outside"


# (model, attention backend of the partitioned run); models without attention layers run one
MODELS_BACKENDS = [(m, a) for m in FAMILIES + RECURRENT for a in ("segment", "sdpa_dense") if a == "segment" or has_attention(m)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("family,attention", MODELS_BACKENDS)
@settings(max_examples=examples(3))
@given(data=forests(max_branches=7, max_len=12), extra=st.integers(0, 40))
def test_partitioned_equals_unpartitioned(family, attention, aggregation, dtype, data, extra):
    branches, masks, weights = data
    model = cached_model(family, dtype)
    batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
    budget = max(len(b) for b in branches) + extra  # from the tightest feasible budget up to the whole tree
    plan = plan_partitions(batch, budget)
    chains_ok(plan, batch)
    stats = PartitionStats()

    def partitioned():
        value = tree_backward(model, batch, aggregation, "redundancy_free", budget, attention=attention, stats=stats)
        return torch.tensor(value, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(
        model, partitioned, lambda: treelit.tree_loss(model, batch, aggregation, "sdpa_dense"), dtype, "partitioned",
        forest=data,
    )
    assert stats.token_forwards == batch.num_tokens, "every tree token forwarded exactly once"
    assert stats.partitions == (1 if budget >= batch.num_tokens else len(plan))


def test_tight_budget_makes_many_partitions_and_stays_exact():
    model = cached_model("llama3_2_tiny", torch.float64)
    prefix = [1, 2, 3, 4]
    branches = [prefix + [5 + i % 3, 6, (7 + i) % 11] + [8] * (i % 4) for i in range(10)]
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    longest = max(map(len, branches))
    stats = PartitionStats()

    def partitioned():
        v = tree_backward(model, batch, "token-mean", budget_tokens=longest, stats=stats)
        return torch.tensor(v, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(model, partitioned, lambda: treelit.linear_loss(model, branches), torch.float64, "tight")
    assert stats.partitions > 3 and stats.token_forwards == batch.num_tokens
    assert stats.max_chain_tokens <= longest


def test_budget_below_the_longest_branch_is_refused():
    batch = treelit.TokenTree.from_branches([[1] * 10, [1, 2, 3]]).to_batch()
    with pytest.raises(BudgetError, match="longest branch has 10 tokens; use a budget of at least 10"):
        plan_partitions(batch, 9)


@pytest.mark.parametrize("chunk", [1, 2, 64])
@pytest.mark.parametrize("name", ["gdn_tiny", "mamba2_tiny", "hybrid_tiny", "qwen2_tiny"])
def test_every_split_budget_reproduces_the_unsplit_step(name, chunk):
    """Budgets from the longest branch up to the whole tree: each cuts the tree at different
    segments, and the boundary states/contexts fed to the children reproduce the unsplit
    loss and gradients."""
    model = cached_model(name, torch.float64)
    branches = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8], [1, 2, 9], [1, 2, 3, 4, 10, 1, 2], [1, 3], [4, 5, 6]]
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    longest = max(map(len, branches))
    seen = set()
    for budget in range(longest, batch.num_tokens + 1):
        stats = PartitionStats()

        def partitioned():
            v = tree_backward(model, batch, budget_tokens=budget, stats=stats)
            return torch.tensor(v, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

        def unsplit():
            with ssm_chunk_size(model, 1):  # the reference scan
                return treelit.tree_loss(model, batch)

        with ssm_chunk_size(model, chunk):  # boundary states from / into blocks of `chunk` tokens
            assert_equivalent(model, partitioned, unsplit, torch.float64, f"budget {budget}")
        assert stats.token_forwards == batch.num_tokens
        seen.add(stats.partitions)
    assert len(seen) >= 3, seen  # the budgets really produced different cuts
