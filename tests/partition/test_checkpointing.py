"""Activation checkpointing (``model.activation_checkpointing``): each layer is recomputed in
the backward pass; loss and every gradient stay those of per-branch training, in tree mode,
partitioned and not, for every layer type; the unpartitioned peak memory goes down.
(Multi-process runs with checkpointing: tests/distributed/test_fsdp_exact.py.)"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treelit
from helpers import FAMILIES, RECURRENT, assert_equivalent, tiny_model
from strategies import forests
from treelit.objectives import make_objective
from treelit.partition import tree_backward
from treelit.utils.blocks import recomputing
from treelit.utils.memory import track_peak

NASTY = (
    [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 6, 7, 8, 9], [1, 2, 6, 7, 3], [4], [4, 5, 6, 1, 2, 3, 9]],
    [[1, 1, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1], [1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1], [1], [1, 1, 1, 1, 1, 1, 1]],
    [1.0, 0.5, 2.0, 1.0, 1.0, 1.0, 2.5],
)

_MODELS = {}


def model_for(family, dtype=torch.float64):
    if (family, dtype) not in _MODELS:
        _MODELS[(family, dtype)] = tiny_model(family, dtype)
    return _MODELS[(family, dtype)]


@contextlib.contextmanager
def checkpointing(model, on=True):
    before = getattr(model, "activation_checkpointing", False)
    model.activation_checkpointing = on
    try:
        yield
    finally:
        model.activation_checkpointing = before


@pytest.mark.parametrize("partitioned", [False, True], ids=["whole", "partitioned"])
@pytest.mark.parametrize("family", FAMILIES + RECURRENT)
def test_checkpointed_equals_per_branch(family, partitioned):
    model = model_for(family)
    branches, masks, weights = NASTY
    batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
    budget = max(map(len, branches))

    def checkpointed():
        with checkpointing(model):
            if not partitioned:
                return treelit.tree_loss(model, batch, "token-mean", "segment")
            v = tree_backward(model, batch, "token-mean", budget_tokens=budget, attention="segment")
            return torch.tensor(v, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(model, checkpointed, lambda: treelit.linear_loss(model, branches, masks, weights),
                      torch.float64, f"{family} checkpointed", forest=NASTY)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=forests(max_branches=6, max_len=10), extra=st.integers(0, 20),
       family=st.sampled_from(["qwen3_moe_tiny", "hybrid_tiny", "llama3_2_tiny"]),
       objective=st.sampled_from(["grpo", "gspo"]), seed=st.integers(0, 9))
def test_checkpointed_partitioned_rl_equals_unpartitioned(data, extra, family, objective, seed):
    import numpy as np

    branches, masks, weights = data
    model = model_for(family)
    adv = [float(a) for a in np.random.default_rng(seed).normal(0, 1, len(branches))]
    batch = treelit.TokenTree.from_branches(branches, masks, weights, advantages=adv).to_batch()
    obj = make_objective(objective, **({"clip_low": 0.5, "clip_high": 0.5} if objective == "gspo" else {}))
    budget = max(map(len, branches)) + extra

    def checkpointed():
        with checkpointing(model):
            v = tree_backward(model, batch, "token-mean", budget_tokens=budget, attention="segment", objective=obj)
        return torch.tensor(v, dtype=torch.float64) + 0.0 * sum(p.sum() for p in model.parameters())

    assert_equivalent(model, checkpointed,
                      lambda: obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None, attention="sdpa_dense")[0],
                      torch.float64, f"{objective}/{family} checkpointed, budget {budget}", forest=data)


def test_recomputation_is_visible_to_blocks():
    """Blocks can tell the backward recomputation from the forward (to skip side effects)."""
    model = tiny_model("qwen2_tiny", torch.float64)
    seen = []
    layer = model.layers[0]
    layer.register_forward_pre_hook(lambda m, a: None)  # an ordinary hook stays harmless
    real = layer.mlp.forward

    def spy(x):
        seen.append(recomputing())
        return real(x)

    layer.mlp.forward = spy
    batch = treelit.TokenTree.from_branches([[1, 2, 3, 4], [1, 2, 5]]).to_batch()
    with checkpointing(model):
        treelit.tree_loss(model, batch).backward()
    assert seen == [False, True]


def test_checkpointing_lowers_the_unpartitioned_peak():
    """Tensor memory of one unpartitioned tree step (forward + backward) on a deeper model."""
    model = tiny_model("qwen2_tiny", torch.float32, num_layers=6, embed_dim=64, intermediate_dim=256, max_seq_len=512)
    prefix = [1 + i % 9 for i in range(96)]
    branches = [prefix + [1 + (3 * b + i) % 10 for i in range(64)] for b in range(6)]
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    peaks, grads = {}, {}
    for on in (False, True):
        model.zero_grad(set_to_none=True)
        with checkpointing(model, on), track_peak() as m:
            treelit.tree_loss(model, batch, "token-mean", "segment").backward()
        peaks[on] = m["peak"]
        grads[on] = [p.grad.clone() for p in model.parameters()]
    assert peaks[True] < 0.75 * peaks[False], peaks
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
