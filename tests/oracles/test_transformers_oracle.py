"""Strict independent oracle: tree mode == ``transformers`` run branch by branch, float64, 1e-10.

The checkpoint treelit writes is loaded by ``transformers`` (``sdpa`` attention) and run on
each branch alone, with the per-branch loss written from its definition
(:mod:`hf_oracle`). transformers computes RMSNorm and rotary angles through float32 even in
a float64 model, which alone puts it ~1e-7 away from any exact float64 computation;
:func:`hf_oracle.make_exact` rebinds (test-only, on the oracle's instance) those forwards
to the same formulas in float64.

Compared at <= 1e-10 relative on the loss and on every parameter gradient (mapped to the
checkpoint's names): every family, every CPU attention backend, every aggregation,
unpartitioned and partitioned at two budgets (the loss ``tree_backward`` returns included),
on hypothesis forests that train something in every tree. A family added to
``helpers.FAMILIES`` is covered here without changes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings

import treelit
from helpers import FAMILIES, TEST_VOCAB, assert_trains, max_rel_grad_diff, tiny_model
from hf_oracle import hf_branch_loss, hf_grads, load_hf_oracle
from strategies import examples, forests
from treelit.attention.segment import SegmentAttention
from treelit.models.hf import tune_to_hf_state_dict
from treelit.partition import PartitionStats, tree_backward

pytest.importorskip("transformers")

TOL = 1e-10
# A gradient at or below 1e-4 of the largest one counts as mathematically zero and may differ by
# 1e-4 x TOL x scale = 1e-14 x scale (~45 eps; 5 eps of rounding was measured on q/k of a query
# that sees a single key); every larger gradient is held to TOL relative to its own norm.
FLOOR = 1e-4
BACKENDS = {
    "sdpa_dense": lambda: "sdpa_dense",
    "segment": lambda: SegmentAttention(),
    "segment_unbatched_noshare": lambda: SegmentAttention(batch_below=0, share_prefixes=False),
}


FIXED_BRANCHES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 10, 2]]
FIXED_MASKS = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1], [0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]]
FIXED_WEIGHTS = [1.0, 0.0, 2.0, 0.5, 1.5]

_MODELS = {}


def models(family, tmp_path_factory):
    """(treelit model, transformers model) with the same float64 weights, built once per family."""
    if family not in _MODELS:
        path = tmp_path_factory.mktemp(family)
        src = tiny_model(family, torch.float64)
        treelit.save_hf_checkpoint(src, path)
        ours = treelit.load_hf_checkpoint(path, dtype=torch.float64)
        hf = load_hf_oracle(path, dtype=torch.float64, exact=True)
        assert all(p.dtype == torch.float64 for p in hf.parameters())
        _MODELS[family] = (ours, hf)
    return _MODELS[family]


def grads_in_hf_names(model, config):
    g = tune_to_hf_state_dict({n: p.grad.detach().clone() for n, p in model.named_parameters()}, config)
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("aggregation", treelit.AGGREGATIONS)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=examples(3))
@given(data=forests(max_branches=6, max_len=14))
@example(data=(FIXED_BRANCHES, FIXED_MASKS, FIXED_WEIGHTS))  # cut into several partitions at both budgets
@example(data=([[2, 1], [2, 2]], [[False, True], [False, False]], [0.5, 0.0]))  # q/k gradients exactly zero
def test_tree_mode_equals_transformers_branch_by_branch_float64(family, aggregation, data, tmp_path_factory):
    branches, masks, weights = data
    assert_trains(branches, masks, weights)
    ours, hf = models(family, tmp_path_factory)
    assert max(max(b) for b in branches) < TEST_VOCAB

    hf.zero_grad(set_to_none=True)
    ref = hf_branch_loss(hf, branches, masks, weights, aggregation)
    ref.backward()
    ref_grads = {n: g.detach().clone() for n, g in hf_grads(hf, ours.config.tie_word_embeddings).items()}
    hf.zero_grad(set_to_none=True)
    assert ref.item() > 0 and any(g.abs().sum() > 0 for g in ref_grads.values()), "the forest trains nothing"

    batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
    longest = max(len(b) for b in branches)
    budgets = sorted({longest, (longest + batch.num_tokens) // 2})  # tightest, and half way to the whole tree
    for backend_name, backend in BACKENDS.items():
        runs = {"tree_loss": None, **{f"partitioned(budget={b})": b for b in budgets}}
        for run, budget in runs.items():
            stats = PartitionStats()
            ours.zero_grad(set_to_none=True)
            if budget is None:
                loss = treelit.tree_loss(ours, batch, aggregation, attention=backend())
                loss.backward()
                value = loss.item()
            else:
                value = tree_backward(ours, batch, aggregation, "redundancy_free", budget, attention=backend(), stats=stats)
                assert stats.token_forwards == batch.num_tokens
                if branches is FIXED_BRANCHES:
                    assert stats.partitions > 1, f"budget {budget} did not cut the fixed forest"
            grads = grads_in_hf_names(ours, ours.config)
            if ours.config.tie_word_embeddings:
                grads.pop("lm_head.weight", None)
            what = f"{family}/{aggregation}/{backend_name}/{run}"
            assert grads.keys() == ref_grads.keys(), what
            rel = abs(value - ref.item()) / abs(ref.item())
            assert rel <= TOL, f"{what}: loss {value!r} vs transformers {ref.item()!r} (rel {rel:.2e})"
            err = max_rel_grad_diff(grads, ref_grads, floor=FLOOR, negligible=FLOOR)
            assert err <= TOL, f"{what}: max relative gradient difference {err:.2e}"
