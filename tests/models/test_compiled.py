"""``compile=true`` (:mod:`treelit.models.compiled`): the attention layers of a model run one
compiled graph whatever the tree - no graph break inside a layer, at most two recompiles over
twenty different trees - and the loss and every gradient equal the eager model's; recurrent
blocks compile one graph per kind around their opaque mixer.

The default suite compiles with the ``aot_eager`` backend (dynamo's trace and AOT autograd's
forward/backward split, without inductor's code generation, which takes a minute on two shared
cores); the inductor case is marked slow."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import treelit
from treelit.models import compiled as compiled_mod
from treelit.models.compiled import CompiledLayers, compile_layers, compile_line
from treelit.tree.token_tree import TokenTree


def _model():
    torch.manual_seed(0)
    return treelit.build_decoder(family="qwen2", vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 embed_dim=32, intermediate_dim=64, max_seq_len=512)


def _trees(n: int, seed: int = 0):
    """``n`` trees of different sizes and shapes: a shared prompt, 2-6 completions, some of them
    branching again."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, 60) for _ in range(rng.randint(3, 12))]
        branches = [prompt + [rng.randrange(1, 60) for _ in range(rng.randint(2, 10))]
                    for _ in range(rng.randint(2, 6))]
        if rng.random() < 0.5:  # a branch at a later turn
            branches.append(branches[0][:-1] + [rng.randrange(1, 60) for _ in range(rng.randint(1, 5))])
        out.append(branches)
    return out


def _step(model, batch, attention):
    model.zero_grad(set_to_none=True)
    loss = treelit.tree_loss(model, batch, attention=attention)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(eager, compiled, trees, attention):
    for branches in trees:
        batch = TokenTree.from_branches(branches).to_batch()
        loss, grads = _step(eager, batch, attention)
        loss_c, grads_c = _step(compiled, batch, attention)
        torch.testing.assert_close(loss_c, loss, rtol=0, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-6, msg=f"grad {name}")


def test_compiled_layers_one_graph_over_twenty_trees_and_eager_gradients():
    torch._dynamo.reset()
    counters.clear()
    eager = _model()
    model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    model.compiled_layers = CompiledLayers(counter)
    _compare(eager, model, _trees(20), "segment")
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert 1 <= counter.frame_count <= 3, f"{counter.frame_count} compiles (at most 2 recompiles)"
    # both layers share the graph: the attention op appears in the one compiled graph
    assert counter.op_count > 0
    # per-branch passes (causal rows of varying number and length) and the reference backend
    _compare(eager, model, _trees(2, seed=1), "sdpa_dense")
    branches = _trees(1, seed=2)[0]
    for m in (eager, model):
        m.zero_grad(set_to_none=True)
    losses = [treelit.linear_loss(m, branches) for m in (eager, model)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for (n, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=f"linear grad {n}")
    # activation checkpointing recomputes the compiled layer in the backward
    model.activation_checkpointing = True
    _compare(eager, model, _trees(2, seed=3), "segment")
    # without gradients (old log-probs, evaluation) nothing is kept for a backward
    with torch.no_grad():
        treelit.tree_loss(model, TokenTree.from_branches(branches).to_batch(), attention="segment")
    assert compiled_mod._CALLS == {} and compiled_mod._RECORDS == {}


def test_compiled_hybrid_layers_one_graph_per_kind_and_eager_gradients():
    """GDN, attention, Mamba2 and GDN blocks: the recurrent mixers run opaque inside their compiled
    blocks, and their parameters' gradients come back through the operator."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = treelit.build_model("hybrid_tiny", num_layers=4, embed_dim=32, intermediate_dim=64)
    model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    model.compiled_layers = CompiledLayers(counter)
    _compare(eager, model, _trees(5, seed=4), "segment")
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    kinds = {type(x.mixer).__name__ if hasattr(x, "mixer") else "attention" for x in model.layers}
    assert counter.frame_count == len(kinds), (counter.frame_count, kinds)
    assert compiled_mod._CALLS == {} and compiled_mod._RECORDS == {}


def test_compile_layers_refuses_moe_and_sets_the_backend():
    model = compile_layers(_model(), "aot_eager")
    assert model.compiled_layers.backend == "aot_eager"
    assert compile_line(model) == "compile=aot_eager: 2 layers run compiled; the first step compiles"
    hybrid = compile_layers(treelit.build_model("hybrid_tiny"), True)
    assert " attention and " in compile_line(hybrid) and "recurrent layers (the recurrent mixers opaque)" \
        in compile_line(hybrid), compile_line(hybrid)
    assert compile_layers(model, False).compiled_layers is None
    with pytest.raises(ValueError, match=r"^compile=max is not a choice"):
        compile_layers(_model(), "max")
    moe = treelit.build_model("qwen3_moe_tiny")
    with pytest.raises(ValueError, match=r"^compile=true: mixture-of-experts layers .* set compile=false$"):
        compile_layers(moe, True)


@pytest.mark.slow
def test_inductor_compiled_layers_equal_eager():
    torch._dynamo.reset()
    counters.clear()
    eager = _model()
    model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("inductor")
    model.compiled_layers = CompiledLayers(counter)
    _compare(eager, model, _trees(6), "segment")
    assert dict(counters["graph_break"]) == {}
    assert counter.frame_count <= 3
    torch.manual_seed(0)
    eager = treelit.build_model("hybrid_tiny", num_layers=4, embed_dim=32, intermediate_dim=64)
    model = copy.deepcopy(eager)
    model.compiled_layers = CompiledLayers("inductor")
    _compare(eager, model, _trees(2, seed=4), "segment")
    assert dict(counters["graph_break"]) == {}
