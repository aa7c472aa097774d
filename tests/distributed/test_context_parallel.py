"""Context parallelism (:mod:`treelit.partition.context_parallel`): one tree row split over C
gloo processes equals one process, float64, loss and every parameter gradient (the ranks'
gradients summed). Cases: a one-token-segment forest, a tree with fewer tokens than C, a
single-segment tree, a branch point exactly at a rank boundary, sliding windows with GQA,
the RL objectives (a reference model included), the router load-balancing loss of a
mixture-of-experts model (both definitions), and hybrid / recurrent-only models (Gated
DeltaNet and Mamba2 states and convolution contexts crossing ranks)."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import treelit
from helpers import grad_floor, max_rel_grad_diff, negligible_grad, tiny_model
from treelit.loss.router import router_normalizer_contribution
from treelit.models.factory import set_router_aux_loss
from treelit.partition.context_parallel import cp_micro_batch, cp_plan, cp_ranges, token_costs

ONE_TOKEN = ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 7], [1, 2, 3, 4, 8, 9], [1, 2, 3, 4, 8, 10], [3, 5]],
             [[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1], [1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1]],
             [1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 1.0])
TINY = ([[1, 2]], [[1, 1]], [1.0])                     # fewer tokens than C = 4
CHAIN = ([[(3 * i) % 10 + 1 for i in range(13)]], [[1] * 13], [1.0])      # one segment
# a branch point (token index 5) exactly at the rank boundary of C = 2 (unit costs, see _worker)
FORK = ([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 9, 3]], [[1] * 9, [1] * 9], [1.0, 1.0])
ROUTER_COEF = 0.3  # the MoE router loss's coefficient in the router cases (large: its gradient is plain to see)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _objective(name):
    from treelit.objectives import make_objective

    return {"sft": lambda: make_objective("sft"),
            "grpo": lambda: make_objective("grpo", kl_coef=0.1, reference="initial"),
            "gspo": lambda: make_objective("gspo"),
            "ppo": lambda: make_objective("ppo", entropy_coef=0.01)}[name]()


def _tree(forest, rl: bool):
    branches, masks, weights = forest
    if not rl:
        return treelit.TokenTree.from_branches(branches, masks, weights)
    gen = np.random.default_rng(1)
    per = {}
    for ids in branches:
        for t in range(1, len(ids)):
            per.setdefault(tuple(ids[: t + 1]), -0.2 - gen.random())
    old = [[None] + [per[tuple(ids[: t + 1])] for t in range(1, len(ids))] for ids in branches]
    adv = [float(a) for a in gen.standard_normal(len(branches))]
    return treelit.TokenTree.from_branches(branches, masks, weights, advantages=adv, old_logprobs=old)


def _model(name, window, checkpointing=False, router=None):
    kw = dict(sliding_window=3, sliding_window_layers=[0]) if window else {}
    model = tiny_model(name, torch.float64, **kw)
    model.activation_checkpointing = checkpointing  # recompute each layer (and its exchanges) in the backward
    if router is not None:  # an MoE model's router load-balancing loss: its definition
        set_router_aux_loss(model, ROUTER_COEF, router)
    return model


def _router_normalizer(model, batch):
    """One micro-batch's step: its own router-loss normaliser (None without the loss)."""
    return router_normalizer_contribution(model, batch) or None


def _worker(rank, C, port, case, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=C)
    try:
        name, forest, objective, window, *ckpt = case
        model = _model(name, window, *ckpt)
        batch = _tree(forest, objective != "sft").to_batch()
        obj = _objective(objective)
        Z = obj.norm_contribution(batch, "token-mean")
        # FORK: unit costs put the cut right after the branch token (index 5): both children start rank 1
        costs = np.ones(batch.num_tokens) if forest is FORK else None
        value, metrics, plan = cp_micro_batch(model, obj, batch, None, aggregation="token-mean", normalizer=Z,
                                              attention="sdpa_dense", costs=costs,
                                              router_normalizer=_router_normalizer(model, batch))
        if forest is FORK and C == 2:
            assert plan.ranges == [(0, 6), (6, 12)] and int(batch.parent[6]) == int(batch.parent[9]) == 5
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        for g in grads:
            dist.all_reduce(g)
        # every rank reports the whole loss and the same metrics
        everyone = [None] * C
        dist.all_gather_object(everyone, (value, metrics))
        assert all(e == everyone[0] for e in everyone), everyone
        if rank == 0:
            torch.save({"value": value, "grads": [g.clone() for g in grads], "imbalance": plan.imbalance,
                        "metrics": metrics}, out)
    finally:
        dist.destroy_process_group()


def one_process_result(case):
    """``run_micro_batch`` on one process: its result and every parameter's gradient."""
    name, forest, objective, window, *ckpt = case
    from treelit.partition.engine import run_micro_batch

    model = _model(name, window, *ckpt)
    batch = _tree(forest, objective != "sft").to_batch()
    obj = _objective(objective)
    res = run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=obj.norm_contribution(batch, "token-mean"),
                          attention="sdpa_dense", router_normalizer=_router_normalizer(model, batch))
    return res, [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def one_process(case):
    res, grads = one_process_result(case)
    return res.loss, grads


def compare(case, C, tmp_path):
    out = tmp_path / f"cp{C}.pt"
    mp.spawn(_worker, args=(C, _port(), case, str(out)), nprocs=C, join=True)
    got = torch.load(out, weights_only=True)
    res, grads = one_process_result(case)
    value = res.loss
    assert abs(got["value"] - value) <= 1e-9 * abs(value), (got["value"], value)
    assert any(g.abs().max() > 0 for g in grads), "the case must train something"
    names = [str(i) for i in range(len(grads))]
    err = max_rel_grad_diff(dict(zip(names, got["grads"])), dict(zip(names, grads)), grad_floor(torch.float64),
                            negligible_grad(torch.float64))
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"
    for k, v in res.metrics.items():  # an MoE model's router loss and expert loads
        if k.startswith(("router_", "moe/")):
            assert got["metrics"][k] == pytest.approx(v, rel=1e-9), (k, got["metrics"][k], v)
    return got


def test_ranges_balance_cost_and_fetch_only_the_path():
    batch = treelit.TokenTree.from_branches(*ONE_TOKEN).to_batch()
    costs = token_costs(batch)
    for C in (2, 3, 4):
        ranges = cp_ranges(costs, C)
        assert ranges[0][0] == 0 and ranges[-1][1] == batch.num_tokens
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
        parent = batch.parent.numpy()
        for r in range(C):
            plan = cp_plan(batch, C, r, costs)
            s = ranges[r][0]
            anc, a = [], parent[s]
            while a >= 0:
                anc.append(a)
                a = parent[a]
            assert sorted(plan.path.tolist()) == sorted(anc)  # the path to the range's first token, nothing else
    assert cp_ranges(np.ones(2), 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("C,forest,window", [(2, ONE_TOKEN, False), (2, FORK, True)], ids=["one-token", "fork-window"])
def test_context_parallel_equals_one_process(C, forest, window, tmp_path):
    compare(("qwen2_5_tiny", forest, "sft", window), C, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "grpo", "gspo", "ppo"])
@pytest.mark.parametrize("C", [2, 4])
@pytest.mark.parametrize("forest", [ONE_TOKEN, TINY, CHAIN, FORK], ids=["one-token", "tiny", "chain", "fork"])
def test_context_parallel_objectives_and_degrees(C, forest, objective, tmp_path):
    if forest in (TINY, CHAIN) and objective != "sft":
        pytest.skip("one branch: its clipped RL surrogate trains nothing")
    compare(("qwen2_5_tiny", forest, objective, False), C, tmp_path)


@pytest.mark.slow
def test_context_parallel_moe_without_router_loss(tmp_path):
    compare(("qwen3_moe_tiny", ONE_TOKEN, "sft", False), 2, tmp_path)


def _gate_grads(got):
    names = [n for n, _ in tiny_model("qwen3_moe_tiny", torch.float64).named_parameters()]
    return {n: g for n, g in zip(names, got) if n.endswith("mlp.gate.weight")}


def test_context_parallel_moe_router_loss(tmp_path):
    """The router load-balancing loss (micro_batch) under C = 2: the routing counts of the two
    ranges summed over the group, each rank adding its own tokens' share; loss, gradients and
    the router metrics equal one process's, and the routers' gradients are not those without it."""
    got = compare(("qwen3_moe_tiny", ONE_TOKEN, "sft", False, False, "micro_batch"), 2, tmp_path)
    assert got["metrics"]["router_aux_loss"] > 0 and got["metrics"]["moe/load_max_over_mean"] >= 1.0
    with_loss = _gate_grads(got["grads"])
    _, plain = one_process(("qwen3_moe_tiny", ONE_TOKEN, "sft", False))
    without = _gate_grads(plain)
    assert with_loss and with_loss.keys() == without.keys()
    for n in with_loss:
        d = (with_loss[n] - without[n]).norm() / without[n].norm()
        assert d > 1e-3, (n, float(d))  # the router term is there


@pytest.mark.slow
@pytest.mark.parametrize("forest,objective", [(ONE_TOKEN, "sft"), (ONE_TOKEN, "grpo"), (TINY, "sft")],
                         ids=["one-token-sft", "one-token-grpo", "tiny-sft"])
def test_context_parallel_moe_router_loss_sequence(forest, objective, tmp_path):
    """The per-branch (``sequence``) definition under C = 4, grpo with its reference model, and
    a tree with fewer tokens than C (ranks with empty ranges add nothing but take part)."""
    got = compare(("qwen3_moe_tiny", forest, objective, False, False, "sequence"), 4, tmp_path)
    assert got["metrics"]["router_aux_loss"] > 0


def _recurrent_grads_nonzero(name, got):
    names = [n for n, _ in tiny_model(name, torch.float64).named_parameters()]
    mixers = {n: g for n, g in zip(names, got["grads"]) if ".mixer." in n}
    assert mixers and all(g.abs().max() > 0 for g in mixers.values()), \
        [n for n, g in mixers.items() if not g.abs().max() > 0]


@pytest.mark.parametrize("forest", [ONE_TOKEN, FORK], ids=["one-token", "fork"])
def test_hybrid_context_parallel_equals_one_process(forest, tmp_path):
    """Gated DeltaNet, Mamba2 and their convolutions across a rank boundary: one-token segments
    (a rank whose roots continue several points of one path) and a branch point exactly at the
    boundary (both children start the second rank from the same state)."""
    _recurrent_grads_nonzero("hybrid_tiny", compare(("hybrid_tiny", forest, "sft", False), 2, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "grpo"])
@pytest.mark.parametrize("C", [2, 4])
@pytest.mark.parametrize("forest", [ONE_TOKEN, TINY, CHAIN, FORK], ids=["one-token", "tiny", "chain", "fork"])
def test_hybrid_context_parallel_objectives_and_degrees(C, forest, objective, tmp_path):
    if forest in (TINY, CHAIN) and objective != "sft":
        pytest.skip("one branch: its clipped RL surrogate trains nothing")
    compare(("hybrid_tiny", forest, objective, False), C, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("C", [2, 4])
def test_hybrid_context_parallel_with_activation_checkpointing(C, tmp_path):
    """Each layer recomputed in the backward: its K/V, convolution rows and states are exchanged again."""
    compare(("hybrid_tiny", ONE_TOKEN, "sft", False, True), C, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gdn_tiny", "mamba2_tiny"])
def test_recurrent_only_context_parallel(name, tmp_path):
    _recurrent_grads_nonzero(name, compare((name, ONE_TOKEN, "sft", False), 3, tmp_path))


def test_transformers_hybrid_layers_are_refused():
    from types import SimpleNamespace

    from treelit.partition.context_parallel import check_cp_model

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0]._treelit_forward = True  # what the transformers adapter marks its hybrid mixers with
    model.config = SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="does not cover the recurrent layers of transformers hybrid models"):
        check_cp_model(model)
    check_cp_model(tiny_model("hybrid_tiny", torch.float64))  # native recurrent layers are covered
