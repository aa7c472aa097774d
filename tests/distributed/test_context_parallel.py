"""Context parallelism (:mod:`treelit.partition.context_parallel`): one tree row split over C
gloo processes equals one process, float64, loss and every parameter gradient (the ranks'
gradients summed). Cases: a one-token-segment forest, a tree with fewer tokens than C, a
single-segment tree, a branch point exactly at a rank boundary, sliding windows with GQA,
the RL objectives (a reference model included), the router load-balancing loss of a
mixture-of-experts model (both definitions), hybrid / recurrent-only models (Gated
DeltaNet and Mamba2 states and convolution contexts crossing ranks), and transformers hybrid
checkpoints through the adapter (its tree kernels' states and convolution contexts crossing
ranks through the same hooks)."""

from __future__ import annotations

import contextlib
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import treelit
import treelit.partition.context_parallel as context_parallel
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad, tiny_model
from cases import with_routing
from hf_oracle import random_hf_checkpoint
from treelit.loss.router import router_normalizer_contribution
from treelit.models.factory import set_moe_routing, set_router_aux_loss
from treelit.partition.context_parallel import cp_micro_batch, cp_plan, cp_ranges, token_costs
from harness import end_rank  # noqa: E402

ONE_TOKEN = ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 7], [1, 2, 3, 4, 8, 9], [1, 2, 3, 4, 8, 10], [3, 5]],
             [[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1], [1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1]],
             [1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 1.0])
TINY = ([[1, 2]], [[1, 1]], [1.0])                     # fewer tokens than C = 4
CHAIN = ([[(3 * i) % 10 + 1 for i in range(13)]], [[1] * 13], [1.0])      # one segment
# a branch point (token index 5) exactly at the rank boundary of C = 2 (unit costs, see _worker)
FORK = ([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 9, 3]], [[1] * 9, [1] * 9], [1.0, 1.0])
# the second range of C = 2 (unit costs: tokens 5-10) holds three roots continuing the path 0-1-2 at
# three points (parents 2, 1 and 0), each with a child whose log-prob it computes
SLOTS = ([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8, 9], [1, 10, 11]], [[1] * 5, [1] * 5, [1] * 4, [1] * 3],
         [1.0, 0.5, 2.0, 1.0])
ROUTER_COEF = 0.3  # the MoE router loss's coefficient in the router cases (large: its gradient is plain to see)
UNIT_COSTS = (FORK, SLOTS)  # cut where the comments above say (model costs may cut elsewhere)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _objective(name):
    from treelit.objectives import make_objective

    return {"sft": lambda: make_objective("sft"),
            "grpo": lambda: make_objective("grpo", kl_coef=0.1, reference="initial"),
            "gspo": lambda: make_objective("gspo"),
            "ppo": lambda: make_objective("ppo", entropy_coef=0.01),
            "dpo": lambda: make_objective("dpo", beta=0.5)}[name]()


def _rl(objective):
    return "dpo" if objective == "dpo" else objective != "sft"


def _tree(forest, rl):
    """The forest as a tree: plain (``rl`` false), with advantages and old log-probs, or (``rl ==
    "dpo"``) as preference pairs of consecutive branches (an odd last branch dropped) with
    reference log-probs."""
    branches, masks, weights = forest
    if not rl:
        return treelit.TokenTree.from_branches(branches, masks, weights)
    gen = np.random.default_rng(1)
    per = {}
    for ids in branches:
        for t in range(1, len(ids)):
            per.setdefault(tuple(ids[: t + 1]), -0.2 - gen.random())
    old = [[None] + [per[tuple(ids[: t + 1])] for t in range(1, len(ids))] for ids in branches]
    if rl == "dpo":
        n = len(branches) - len(branches) % 2
        fields = {"pair": [b // 2 for b in range(n)], "chosen": [b % 2 == 0 for b in range(n)]}
        return treelit.TokenTree.from_branches(branches[:n], masks[:n], weights[:n], ref_logprobs=old[:n],
                                               branch_fields=fields)
    adv = [float(a) for a in gen.standard_normal(len(branches))]
    return treelit.TokenTree.from_branches(branches, masks, weights, advantages=adv, old_logprobs=old)


# transformers hybrid families through the adapter (tiny random configs, as tests/models/test_hf_hybrid.py's)
HF_BASE = dict(vocab_size=12, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, max_position_embeddings=64)
HF_HYBRID = {
    "qwen3_5": ("qwen3_5_text", dict(HF_BASE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                     linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_conv_kernel_dim=3)),
    "nemotron_h": ("nemotron_h", dict(HF_BASE, layers_block_type=["mamba", "attention", "moe", "mamba"],
                                      ssm_state_size=4, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, conv_kernel=3,
                                      chunk_size=4, use_conv_bias=True, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=8, moe_shared_expert_intermediate_size=8)),
    "kimi_linear": ("kimi_linear", dict(HF_BASE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                        linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
                                        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=1)),
    "lfm2": ("lfm2", dict(HF_BASE, num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3,
                          conv_bias=True, block_auto_adjust_ff_dim=False)),
    "falcon_h1": ("falcon_h1", dict(HF_BASE, num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                                    mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4, mamba_d_ssm=64,
                                    lm_head_multiplier=0.6, embedding_multiplier=1.5)),
}


def hf_case(family, tmp_path):
    """The model name of a case: ``hf:DIR``, a random checkpoint of ``family`` written once in ``tmp_path``
    (each process builds its model from it)."""
    path = tmp_path / family
    if not path.exists():
        model_type, cfg = HF_HYBRID[family]
        random_hf_checkpoint(path, model_type, **cfg)
    return f"hf:{path}"


def _batch(forest, objective, replay=False):
    """The case's row; ``replay``: every branch with recorded MoE routing (qwen3_moe_tiny's 2 MoE
    layers, top-2 of 8), a function of its prefix."""
    tree = _tree(forest, _rl(objective))
    return (with_routing([tree], (2, 2, 8))[0] if replay else tree).to_batch()


def _model(name, window, checkpointing=False, router=None, replay=False):
    if name.startswith("hf:"):
        model = treelit.load_hf_model(name[3:], dtype=torch.float64)
    else:
        kw = dict(sliding_window=3, sliding_window_layers=[0]) if window else {}
        model = tiny_model(name, torch.float64, **kw)
    model.activation_checkpointing = checkpointing  # recompute each layer (and its exchanges) in the backward
    if router is not None:  # an MoE model's router load-balancing loss: its definition
        set_router_aux_loss(model, ROUTER_COEF, router)
    if replay:  # MoE routing replay (the row carries routed_experts, see _batch)
        set_moe_routing(model, "replay")
    return model


def _router_normalizer(model, batch):
    """One micro-batch's step: its own router-loss normaliser (None without the loss)."""
    return router_normalizer_contribution(model, batch) or None


def _exact(name):
    """transformers' float32 upcasts kept in float64 (adapter models), so that 1e-9 can hold."""
    return KeepFloat64() if name.startswith("hf:") else contextlib.nullcontext()


def _recurrent_names(model):
    """The parameters of the adapter's hybrid (tree-kernel) layers."""
    return [f"{m}.{p}" if m else p for m, mod in model.named_modules() if hasattr(mod, "_treelit_forward")
            for p, _ in mod.named_parameters()]


@contextlib.contextmanager
def _broken(what):
    """A deliberately wrong exchange (what the comparison must catch): every routed initial state
    (``states``) or convolution context (``conv``) replaced by zeros. Messages and gradients still
    travel as usual."""
    saved = vars(context_parallel._StateIn)["forward"], context_parallel._CPContext.recurrent_conv_inputs
    if what == "states":
        forward = context_parallel._StateIn.forward
        context_parallel._StateIn.forward = staticmethod(lambda ctx, *args: forward(ctx, *args).zero_())
    else:
        hook = context_parallel._CPContext.recurrent_conv_inputs

        def zeroed(self, layer, K, inputs):
            given, contexts = hook(self, layer, K, inputs)
            return given, {n: c * 0 for n, c in contexts.items()}

        context_parallel._CPContext.recurrent_conv_inputs = zeroed
    try:
        yield
    finally:
        context_parallel._StateIn.forward, context_parallel._CPContext.recurrent_conv_inputs = saved


def _worker(rank, C, port, case, out, wrong=()):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=C)
    try:
        name, forest, objective, window, *ckpt = case
        model = _model(name, window, *ckpt)
        batch = _batch(forest, objective, *ckpt[2:])
        obj = _objective(objective)
        Z = obj.norm_contribution(batch, "token-mean")
        # FORK: unit costs put the cut right after the branch token (index 5): both children start rank 1;
        # SLOTS: see its comment (cases are pickled to the processes: forests compare by value)
        costs = np.ones(batch.num_tokens) if forest in UNIT_COSTS else None
        saved = {}
        for broken in (None, *wrong):  # the right exchange, then each wrong one
            model.zero_grad(set_to_none=True)
            with _exact(name), _broken(broken) if broken else contextlib.nullcontext():
                value, metrics, plan = cp_micro_batch(model, obj, batch, None, aggregation="token-mean",
                                                      normalizer=Z, attention="sdpa_dense", costs=costs,
                                                      router_normalizer=_router_normalizer(model, batch))
            if forest == FORK and C == 2:
                assert plan.ranges == [(0, 6), (6, 12)] and int(batch.parent[6]) == int(batch.parent[9]) == 5
            if forest == SLOTS and C == 2:
                assert plan.ranges == [(0, 5), (5, 11)] and batch.parent[[5, 7, 9]].tolist() == [2, 1, 0]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            for g in grads:
                dist.all_reduce(g)
            # every rank reports the whole loss and the same metrics
            everyone = [None] * C
            dist.all_gather_object(everyone, (value, metrics))
            assert all(e == everyone[0] for e in everyone), everyone
            if rank == 0:
                saved[broken] = {"value": value, "grads": [g.clone() for g in grads], "imbalance": plan.imbalance,
                                 "metrics": metrics}
        if rank == 0:
            torch.save(dict(saved.pop(None), names=[n for n, _ in model.named_parameters()],
                            recurrent=_recurrent_names(model), wrong=saved), out)
    finally:
        dist.destroy_process_group()
    end_rank()


def one_process_result(case):
    """``run_micro_batch`` on one process: its result and every parameter's gradient."""
    name, forest, objective, window, *ckpt = case
    from treelit.partition.engine import run_micro_batch

    model = _model(name, window, *ckpt)
    batch = _batch(forest, objective, *ckpt[2:])
    obj = _objective(objective)
    with _exact(name):
        res = run_micro_batch(model, obj, batch, aggregation="token-mean",
                              normalizer=obj.norm_contribution(batch, "token-mean"), attention="sdpa_dense",
                              router_normalizer=_router_normalizer(model, batch))
    return res, [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def one_process(case):
    res, grads = one_process_result(case)
    return res.loss, grads


def _difference(got, value, grads):
    """(relative loss difference, max relative gradient difference) of a CP result against one process."""
    names = [str(i) for i in range(len(grads))]
    err = max_rel_grad_diff(dict(zip(names, got["grads"])), dict(zip(names, grads)), grad_floor(torch.float64),
                            negligible_grad(torch.float64))
    return abs(got["value"] - value) / abs(value), err


def compare(case, C, tmp_path, wrong=()):
    """CP over C processes against one process; ``wrong``: exchanges broken on purpose (see
    :func:`_broken`) after the right one, each of which must break the comparison."""
    out = tmp_path / f"cp{C}.pt"
    mp.spawn(_worker, args=(C, _port(), case, str(out), tuple(wrong)), nprocs=C, join=True)
    got = torch.load(out, weights_only=True)
    res, grads = one_process_result(case)
    value = res.loss
    assert any(g.abs().max() > 0 for g in grads), "the case must train something"
    loss_err, err = _difference(got, value, grads)
    assert loss_err <= 1e-9, (got["value"], value)
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"
    for k, v in res.metrics.items():  # an MoE model's router loss and expert loads
        if k.startswith(("router_", "moe/")):
            assert got["metrics"][k] == pytest.approx(v, rel=1e-9), (k, got["metrics"][k], v)
    for what, res in got["wrong"].items():  # the same comparison fails when the exchange is wrong
        assert max(_difference(res, value, grads)) > 1e-6, f"zeroed {what} went unnoticed"
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


def test_memory_ranges_balance_tokens_and_received_path():
    """The default split: ranges of equal memory, ``tokens + weight x ancestors of the first
    token``; with weight 0 equal tokens; the most loaded range never holds more than a split of
    equal compute puts on one rank."""
    from treelit.partition.context_parallel import memory_ranges

    prefix = list(range(1, 40))
    batch = treelit.TokenTree.from_branches([prefix + [50 + b] * (20 + 7 * b) for b in range(5)]).to_batch()
    parent = batch.parent.numpy()
    anc = np.zeros(batch.num_tokens)
    for i in range(batch.num_tokens):
        anc[i] = anc[parent[i]] + 1 if parent[i] >= 0 else 0
    N = batch.num_tokens
    for C in (2, 3, 4, 8):
        for w in (0.0, 0.05, 0.5):
            ranges = memory_ranges(batch, C, w)
            assert len(ranges) == C and ranges[0][0] == 0 and ranges[-1][1] == N
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
            mem = lambda rs: max(e - s + w * anc[s] for s, e in rs)  # noqa: E731
            assert mem(ranges) <= mem(cp_ranges(token_costs(batch), C)) + 1e-9, (C, w)
            if w == 0:
                assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= C, ranges
    assert memory_ranges(batch, N + 2, 0.1)[-1] == (N, N)  # fewer tokens than ranks: the last ones empty


@pytest.mark.parametrize("C,forest,window", [(2, ONE_TOKEN, False), (2, FORK, True)], ids=["one-token", "fork-window"])
def test_context_parallel_equals_one_process(C, forest, window, tmp_path):
    compare(("qwen2_5_tiny", forest, "sft", window), C, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "grpo", "gspo", "ppo", "dpo"])
@pytest.mark.parametrize("C", [2, 4])
@pytest.mark.parametrize("forest", [ONE_TOKEN, TINY, CHAIN, FORK], ids=["one-token", "tiny", "chain", "fork"])
def test_context_parallel_objectives_and_degrees(C, forest, objective, tmp_path):
    if forest in (TINY, CHAIN) and objective != "sft":
        pytest.skip("one branch: its clipped RL surrogate trains nothing, and it makes no preference pair")
    compare(("qwen2_5_tiny", forest, objective, False), C, tmp_path)


@pytest.mark.slow
def test_context_parallel_moe_without_router_loss(tmp_path):
    compare(("qwen3_moe_tiny", ONE_TOKEN, "sft", False), 2, tmp_path)


@pytest.mark.slow
def test_context_parallel_moe_routing_replay(tmp_path):
    """Routing replay under C = 2 with the router loss on (sequence): each rank's range replays its
    own tokens' recorded experts; the router loss counts the replayed assignment of both ranges."""
    got = compare(("qwen3_moe_tiny", ONE_TOKEN, "grpo", False, False, "sequence", True), 2, tmp_path)
    assert got["metrics"]["router_aux_loss"] > 0


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


def _hf_recurrent_grads_nonzero(got):
    grads = dict(zip(got["names"], got["grads"]))
    assert got["recurrent"] and all(grads[n].abs().max() > 0 for n in got["recurrent"]), \
        [n for n in got["recurrent"] if not grads[n].abs().max() > 0]


def test_transformers_hybrid_context_parallel_equals_one_process(tmp_path):
    """Qwen3.5 through the adapter (Gated DeltaNet + attention), its tree kernels' convolution
    contexts and states crossing the rank boundary of C = 2, the second rank's roots continuing
    the first rank's path at three points (SLOTS): loss and every gradient as one process, the
    Gated DeltaNet layer's included; zeroing the routed initial states, or then the convolution
    contexts (a wrong exchange), breaks the comparison. (On ONE_TOKEN at C = 2 the second rank's roots that continue the path are
    leaves: no log-prob reads their states.)"""
    got = compare((hf_case("qwen3_5", tmp_path), SLOTS, "sft", False), 2, tmp_path, wrong=("states", "conv"))
    _hf_recurrent_grads_nonzero(got)
    assert any("linear_attn" in n for n in got["recurrent"])


@pytest.mark.slow
@pytest.mark.parametrize("family,C,forest", [
    ("nemotron_h", 2, "slots"),     # Mamba2 (conv bias, n_groups > 1), attention, MoE without the router loss
    ("kimi_linear", 2, "slots"),    # Kimi Delta Attention (per-channel decays), MLA attention, MoE
    ("lfm2", 2, "slots"),           # short convolutions only (no state)
    ("falcon_h1", 2, "slots"),      # attention and Mamba2 in parallel in one layer (one layer index)
    ("qwen3_5", 4, "one-token"),
    ("nemotron_h", 4, "one-token"),
    ("kimi_linear", 4, "slots"),
    ("qwen3_5", 2, "fork"),         # a branch point at the rank boundary
    ("nemotron_h", 2, "fork"),
    ("qwen3_5", 4, "tiny"),         # fewer tokens than ranks
])
def test_transformers_hybrid_context_parallel_families(family, C, forest, tmp_path):
    forest = {"slots": SLOTS, "one-token": ONE_TOKEN, "fork": FORK, "tiny": TINY}[forest]
    wrong = () if forest != SLOTS else ("conv",) if family == "lfm2" else ("states", "conv")
    got = compare((hf_case(family, tmp_path), forest, "sft", False), C, tmp_path, wrong=wrong)
    if forest != TINY:
        _hf_recurrent_grads_nonzero(got)


@pytest.mark.slow
def test_transformers_hybrid_context_parallel_grpo(tmp_path):
    """grpo with a KL term to the reference model (whose pass exchanges too)."""
    compare((hf_case("qwen3_5", tmp_path), SLOTS, "grpo", False), 2, tmp_path)


def _checkpointing_worker(rank, C, port, name, out):
    """The same CP pass without and with transformers' activation checkpointing (each hybrid layer
    recomputed in the backward, its exchanges repeated), outside KeepFloat64: the recomputation runs
    in the backward, where the mode does not reach, so both passes keep transformers' float32 upcasts."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=C)
    try:
        model = _model(name, False)
        batch = _tree(SLOTS, False).to_batch()
        obj = _objective("sft")
        runs = []
        for on in (False, True):
            model.activation_checkpointing = on
            model.zero_grad(set_to_none=True)
            value, _, _ = cp_micro_batch(model, obj, batch, None, aggregation="token-mean",
                                         normalizer=obj.norm_contribution(batch, "token-mean"),
                                         attention="sdpa_dense", costs=np.ones(batch.num_tokens))
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            for g in grads:
                dist.all_reduce(g)
            runs.append({"value": value, "grads": [g.clone() for g in grads]})
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.hf.modules())
        if rank == 0:
            torch.save(runs, out)
    finally:
        dist.destroy_process_group()
    end_rank()


@pytest.mark.slow
def test_transformers_hybrid_context_parallel_with_activation_checkpointing(tmp_path):
    out = tmp_path / "ckpt.pt"
    mp.spawn(_checkpointing_worker, args=(2, _port(), hf_case("qwen3_5", tmp_path), str(out)), nprocs=2, join=True)
    off, on = torch.load(out, weights_only=True)
    assert any(g.abs().max() > 0 for g in off["grads"])
    loss_err, err = _difference(on, off["value"], off["grads"])
    assert loss_err <= 1e-12 and err <= 1e-12, (loss_err, err)


def test_transformers_hybrid_layers_are_accepted(tmp_path):
    """The adapter's hybrid layers read their boundary inputs through the context's hooks: context
    parallelism accepts them. Still refused, naming it: a native layer type it does not cover, and
    an adapter layer reaching a kernel whose tree version does not go through the hooks."""
    from types import SimpleNamespace

    from treelit.partition.context_parallel import check_cp_model

    check_cp_model(treelit.load_hf_model(hf_case("qwen3_5", tmp_path)[3:], dtype=torch.float64))
    check_cp_model(tiny_model("hybrid_tiny", torch.float64))  # native recurrent layers are covered
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.config = SimpleNamespace(layer_types=["rwkv7", "full_attention"])
    with pytest.raises(ValueError, match="does not cover the layer types rwkv7"):
        check_cp_model(model)
    model.config = SimpleNamespace()
    model[0]._treelit_kernels = frozenset({"causal_conv1d_fn", "selective_scan_fn"})
    with pytest.raises(ValueError, match="does not cover the kernels selective_scan_fn"):
        check_cp_model(model)
