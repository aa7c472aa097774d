"""Context parallelism within partitioned passes (``partition=redundancy_free`` with
``context_parallel_degree=C``): each pass's row split over C gloo processes, the partitions'
ancestor K/V assembled from the ranks that hold them and their gradients relayed back, equal
to one unpartitioned process in float64 (loss and every parameter gradient, the ranks'
gradients summed). A chain of partitions holds C x the per-rank budget."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import treelit
from helpers import grad_floor, max_rel_grad_diff, negligible_grad, tiny_model
from test_context_parallel import ONE_TOKEN, _exact, _objective, _port, _rl, _tree, hf_case
from treelit.partition.engine import run_micro_batch
from treelit.partition.plan import BudgetError
from harness import end_rank  # noqa: E402

# a deeper forest: shared prefixes several levels down, a branch that is a prefix of another,
# a duplicate branch and one-token segments (so that passes have children at several depths)
DEEP = ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 9, 10, 0, 3], [1, 2, 3, 4, 5, 9, 10, 2], [1, 2, 3, 7],
         [1, 2, 3, 7, 8, 9, 1, 4, 6], [1, 2, 3, 7, 8, 9, 1, 4, 6], [1, 2, 0], [5, 6, 7, 8, 9, 10], [5, 6, 7, 2]],
        [[0, 1, 1, 1, 1, 1, 1, 1], [1] * 9, [0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1],
         [0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9, [1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1]],
        [1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 1.0, 0.7, 1.2])


def _case(case):
    name, forest, objective, budget, *extra = case
    window = bool(extra) and extra[0] is True
    router = extra[0] if extra and extra[0] in ("micro_batch", "sequence") else None
    kw = dict(sliding_window=3, sliding_window_layers=[0]) if window else {}
    model = treelit.load_hf_model(name[3:], dtype=torch.float64) if name.startswith("hf:") else \
        tiny_model(name, torch.float64, **kw)
    if "checkpointing" in extra:  # each layer recomputed in the backward, its exchanges and assemblies too
        model.activation_checkpointing = True
    if router is not None:  # the router load-balancing loss on (micro_batch | sequence)
        from treelit.models.factory import set_router_aux_loss

        set_router_aux_loss(model, 0.3, router)
    batch = _tree(forest, _rl(objective)).to_batch()
    obj = _objective(objective)
    return model, batch, obj, budget


def _probe_shards(seen):
    """Record, per captured attention layer, the rows this rank keeps of the capture (``own``)
    and the capture's size; and count the assemblies a rank with an empty range takes part in."""
    import treelit.partition.context_parallel as cpm
    import treelit.partition.engine as eng

    captures, idle_forward = eng.cp_captures, cpm._AncestorsIdle.forward

    def recorded(ctx, plan, need, group, grad):
        kv, produced, leaves = captures(ctx, plan, need, group, grad)
        seen["shards"] += [(sh.size, int(sh.own.shape[2]), isinstance(sh, cpm.KVShard)) for sh in kv.values()]
        return kv, produced, leaves

    def idle(ctx, *a):
        seen["idle"] += 1
        return idle_forward(ctx, *a)

    eng.cp_captures, cpm._AncestorsIdle.forward = recorded, staticmethod(idle)


def _worker(rank, C, port, case, out, attention="sdpa_dense", probe=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=C)
    try:
        seen = {"shards": [], "idle": 0}
        if probe:
            _probe_shards(seen)
        model, batch, obj, budget = _case(case)
        Z = obj.norm_contribution(batch, "token-mean")
        from treelit.partition.engine import PartitionStats

        stats = PartitionStats()
        with _exact(case[0]):  # (transformers' float32 upcasts kept in float64 for the adapter's hybrids)
            res = run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, budget_tokens=budget,
                                  attention=attention, cp_group=dist.group.WORLD, stats=stats)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        for g in grads:
            dist.all_reduce(g)
        # nothing of the step outlives it (a pass's context kept by its graph would keep its captures)
        import treelit.partition.context_parallel as cpm

        gc.collect()
        alive = sum(isinstance(o, cpm._CPContext) for o in gc.get_objects())
        assert alive == 0, f"{alive} pass contexts outlive the step"
        forwards = torch.tensor([float(stats.token_forwards)])
        dist.all_reduce(forwards)
        every = [None] * C
        dist.all_gather_object(every, seen)
        if rank == 0:
            torch.save({"value": res.loss, "metrics": res.metrics, "grads": [g.clone() for g in grads],
                        "partitions": stats.partitions, "forwards": float(forwards), "seen": every}, out)
        dist.barrier()  # every rank done with its messages before the group goes
    finally:
        dist.destroy_process_group()
    end_rank()


def compare(case, C, tmp_path, attention="sdpa_dense", probe=False):
    out = tmp_path / f"cpp{C}.pt"
    mp.spawn(_worker, args=(C, _port(), case, str(out), attention, probe), nprocs=C, join=True)
    got = torch.load(out, weights_only=True)
    model, batch, obj, _ = _case(case)
    Z = obj.norm_contribution(batch, "token-mean")
    with _exact(case[0]):
        want = run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, attention="sdpa_dense")
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    assert abs(got["value"] - want.loss) <= 1e-9 * abs(want.loss), (got["value"], want.loss)
    for k, v in want.metrics.items():
        assert abs(got["metrics"][k] - v) <= 1e-9 * max(abs(v), 1e-12), (k, got["metrics"][k], v)
    assert any(g.abs().max() > 0 for g in grads), "the case must train something"
    names = [str(i) for i in range(len(grads))]
    err = max_rel_grad_diff(dict(zip(names, got["grads"])), dict(zip(names, grads)), grad_floor(torch.float64),
                            negligible_grad(torch.float64))
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"
    assert got["partitions"] > 1 or case[3] >= batch.num_tokens, "the budget must cut the row into several passes"
    assert got["forwards"] == batch.num_tokens, "every token through the model once, on one rank"
    return got


def test_cp_partitioned_equals_one_process(tmp_path):
    compare(("qwen2_5_tiny", DEEP, "sft", 5), 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "grpo", "gspo", "ppo", "dpo"])
@pytest.mark.parametrize("C,budget", [(2, 5), (2, 9), (4, 3)])
def test_cp_partitioned_objectives_and_degrees(C, budget, objective, tmp_path):
    """Token-separable objectives fold per pass; GSPO takes every target's log-prob in a
    no-gradient partitioned pass first; GRPO's reference model runs partitioned too."""
    compare(("qwen2_5_tiny", DEEP, objective, budget), C, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name,window", [("qwen2_5_tiny", True), ("qwen3_moe_tiny", False), ("llama3_2_tiny", False)])
def test_cp_partitioned_windows_moe_families(name, window, tmp_path):
    compare((name, DEEP, "sft", 5, window), 2, tmp_path)


@pytest.mark.slow
def test_cp_partitioned_one_token_forest(tmp_path):
    compare(("qwen2_5_tiny", ONE_TOKEN, "sft", 3), 2, tmp_path)


def test_ancestors_stay_sharded_and_an_empty_range_takes_part(tmp_path):
    """At C = 3 with a budget of 2 tokens per rank, passes of one or two tokens leave ranges
    empty. Each captured layer's rows are split over the ranks (each keeps its own, none the
    whole path), the ranks with an empty range take part in assembling the ancestors' K/V, and
    loss and every gradient equal one process's."""
    got = compare(("qwen2_5_tiny", ONE_TOKEN, "sft", 2), 3, tmp_path, probe=True)
    seen = got["seen"]
    per_rank = [s["shards"] for s in seen]
    assert all(len(s) == len(per_rank[0]) for s in per_rank) and per_rank[0], "every rank captures every layer"
    assert all(kind for s in per_rank for _, _, kind in s), "captures under context parallelism are shards"
    for layer_capture in zip(*per_rank):
        size = layer_capture[0][0]
        assert sum(own for _, own, _ in layer_capture) == size, "each captured row is kept by exactly one rank"
    assert any(max(own for _, own, _ in c) < c[0][0] for c in zip(*per_rank)), "no capture split over ranks"
    assert sum(s["idle"] for s in seen) > 0, "the case must leave some rank's range of a pass with ancestors empty"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_5_tiny", "hybrid_tiny"])
def test_cp_partitioned_with_activation_checkpointing(name, tmp_path):
    """A checkpointed layer runs its forward again in the backward: the ancestors' assembly
    (and, in the hybrid, the state hand-off) happens once more on every rank."""
    compare((name, DEEP, "grpo", 4, "checkpointing"), 3, tmp_path)


def test_budget_is_per_rank():
    """A chain of partitions holds C x the per-rank budget; a path longer than that is one line."""
    from treelit.partition.plan import plan_partitions

    batch = treelit.TokenTree.from_branches(*DEEP).to_batch()
    assert plan_partitions(batch, 5 * 2, per_rank=2).max_chain_tokens <= 10
    with pytest.raises(BudgetError, match=r"budget of 4 tokens per rank x 2 context-parallel ranks .* at least 5 "
                                          r"tokens per rank"):
        plan_partitions(batch, 4 * 2, per_rank=2)


def test_hybrid_cp_partitioned_equals_one_process(tmp_path):
    """Gated DeltaNet, Mamba2 and their convolutions: a pass's root continues its partition's
    outside state and convolution context, its boundary states are assembled from the ranks that
    hold them, and ranges within a pass pass states in rank order."""
    got = compare(("hybrid_tiny", DEEP, "sft", 5), 2, tmp_path)
    names = [n for n, _ in tiny_model("hybrid_tiny", torch.float64).named_parameters()]
    mixers = {n: g for n, g in zip(names, got["grads"]) if ".mixer." in n}
    assert mixers and all(g.abs().max() > 0 for g in mixers.values())


@pytest.mark.slow
@pytest.mark.parametrize("definition,objective,C", [("micro_batch", "sft", 2), ("sequence", "grpo", 2),
                                                    ("micro_batch", "gspo", 4)])
def test_cp_partitioned_router_loss(definition, objective, C, tmp_path):
    """The routing counts of every rank's ranges of every pass are taken in a no-gradient pass and
    summed over the group; each rank folds its own tokens' share into its passes."""
    got = compare(("qwen3_moe_tiny", DEEP, objective, 5 if C == 2 else 3, definition), C, tmp_path)
    assert got["metrics"]["router_aux_loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("hybrid,planner", [(False, False), (True, False), (False, True)],
                         ids=["attention", "hybrid", "planner"])
def test_treelit_train_cp_partitioned_equals_one_process(tmp_path_factory, hybrid, planner):
    """``treelit-train trainer=fsdp2_cpu trainer.strategy.context_parallel_degree=2
    partition=redundancy_free partition.budget_tokens=40``: a budget per rank, chains of up to
    80 tokens (the longest branch has 70), the update equal to one unpartitioned process's."""
    import json

    from cli import run, tail
    from test_cp_train import F64, close, weights
    from test_multiprocess import COMMON

    d = tmp_path_factory.mktemp("cpp_cli")
    prefix = list(range(1, 30))
    with (d / "trees.jsonl").open("w") as f:
        for t in range(6):
            branches = [{"input_ids": prefix[: 10 + 3 * t] + [(7 * b + t) % 300 + 50] * (10 + 5 * b)} for b in range(3 + t)]
            f.write(json.dumps({"id": f"t{t}", "branches": branches}) + "\n")

    common = [c for c in COMMON if not c.startswith("model.config")] + ["model=hybrid_tiny"] if hybrid else COMMON

    def train(name, *extra):
        log = d / f"{name}.log"
        rc = run([*common, *F64, f"data.train_path={d / 'trees.jsonl'}", f"output_dir={d / name}", *extra], d, log)
        assert rc == 0, tail(log)
        return d / name

    single = weights(train("single"))
    # the planner: memory for about 40 tokens per rank at its initial 1 MiB per token (chains of 80)
    budget = (["callbacks=planner", "callbacks.memory_planner.memory_limit_bytes=51380224"] if planner
              else ["partition.budget_tokens=40"])
    out = train("cpp", "trainer=fsdp2_cpu", "trainer.strategy.context_parallel_degree=2",
                "partition=redundancy_free", *budget)
    close(weights(out), single, "C=2 partitioned")
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    if planner:  # (its first step ran at about 40 tokens per rank; calibrated, the last one may not partition)
        assert metrics["planner/budget_tokens"] >= 35, metrics
    else:
        assert metrics["partitions"] > 1
    assert metrics["cp/received_bytes_max"] > 0 and metrics["cp/peak_bytes/rank1"] > 0, metrics


def test_planner_budget_is_per_rank_under_cp():
    """The planner's budget is what one rank holds; under context parallelism a chain holds C x
    that, so a branch longer than one rank's memory is planned, and one longer than C ranks'
    is one line naming both."""
    from types import SimpleNamespace

    from treelit.lightning.planner import MemoryBudgetError, MemoryPlanner

    class Rank:
        device = torch.device("cpu")

        def __init__(self, C):
            self.C = C

        def _comm(self):
            return SimpleNamespace(rank=0, min=lambda v: v, max=lambda v: v)

        def _cp_degree(self):
            return self.C

    planner = MemoryPlanner(memory_limit_bytes=40 * 1024, fraction=1.0, margin=1.0, initial_bytes_per_token=1024)
    batch = [SimpleNamespace(position_ids=torch.arange(70))]  # a 70-token branch; memory for 40 tokens per rank
    assert planner.budget_for(Rank(2), batch) == 40
    with pytest.raises(MemoryBudgetError, match="holds 40 tokens per rank x 1|holds 40 tokens per chain"):
        planner.budget_for(Rank(1), batch)
    batch = [SimpleNamespace(position_ids=torch.arange(90))]
    with pytest.raises(MemoryBudgetError, match="holds 40 tokens per rank x 2 context-parallel ranks per chain"):
        planner.budget_for(Rank(2), batch)


@pytest.mark.slow
@pytest.mark.parametrize("name,forest,objective,C,budget", [
    ("hybrid_tiny", DEEP, "grpo", 2, 9), ("hybrid_tiny", DEEP, "gspo", 4, 3), ("hybrid_tiny", DEEP, "sft", 4, 3),
    ("hybrid_tiny", ONE_TOKEN, "sft", 2, 3), ("hybrid_tiny", ONE_TOKEN, "sft", 4, 2),
    ("gdn_tiny", DEEP, "sft", 3, 3), ("mamba2_tiny", DEEP, "ppo", 2, 5)])
def test_recurrent_cp_partitioned(name, forest, objective, C, budget, tmp_path):
    """Small ranges (one-token segments at C = 4 with 2 tokens per rank: tokens whose convolution
    reaches beyond the pass's root sit on later ranks too), several levels of passes, every
    objective kind, recurrent-only models."""
    compare((name, forest, objective, budget), C, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "kimi_linear", "lfm2", "falcon_h1"])
def test_transformers_hybrid_cp_partitioned(family, tmp_path):
    """The adapter's tree kernels (Gated DeltaNet, KDA, Mamba2, short convolutions): a pass's root
    continues its partition's outside state and convolution context through the same hooks."""
    compare((hf_case(family, tmp_path), DEEP, "sft", 5), 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 5], ids=["unpartitioned", "partitioned"])
def test_cp_segment_backend(budget, tmp_path):
    """The segment backend (CPU's choice for larger rows) under context parallelism: a range's
    external keys are visible to part of a chain only (irregular externals), with and without
    a partition's ancestor keys in front (the one-process reference runs ``sdpa_dense``)."""
    compare(("qwen2_5_tiny", DEEP, "grpo", budget if budget else 10_000, True), 2, tmp_path, attention="segment")


def test_a_backend_without_external_keys_is_refused_by_name():
    """A plugin backend that handles a row's own keys only (``external_keys = False``) cannot take
    a range's ancestors from other ranks: one line naming it and the backends that can."""
    from treelit.attention.dense import DenseAttention
    from treelit.partition.context_parallel import check_cp_backend

    class OwnKeysOnly(DenseAttention):
        name = "own_keys_only"
        external_keys = False

    with pytest.raises(ValueError, match=r"attention=own_keys_only: this backend does not take external keys.*"
                                         r"sdpa_dense"):
        check_cp_backend(OwnKeysOnly())
    for ok in ("auto", "sdpa_dense", "segment", "flex", DenseAttention()):
        check_cp_backend(ok)
    from treelit.lightning.module import TreeLitModule  # (partitioning needs them too)

    with pytest.raises(ValueError, match=r"partition=redundancy_free with attention=own_keys_only"):
        TreeLitModule(tiny_model("qwen2_5_tiny", torch.float64), _objective("sft"), torch.optim.SGD,
                      attention=OwnKeysOnly(), partition="redundancy_free")
