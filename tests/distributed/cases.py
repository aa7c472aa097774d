"""Worker functions for the multi-process tests (run on every rank by harness.launch).

:func:`exact_step` trains nothing: it computes one update's loss and gradients the way
``TreeLitModule`` does on several ranks (FSDP2 per block or DDP, partitions, the memory
planner with a memory limit per rank, activation checkpointing) and, on rank 0, the
same step on one process with the plain unpartitioned tree loss of the objective on an
unsharded copy of the model, and returns the differences.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch

import treelit
from helpers import grad_floor, max_rel_grad_diff, negligible_grad, tiny_model
from treelit.objectives import make_objective

EMPTY = treelit.TokenTree.from_branches([[0, 0]], loss_masks=[[0, 0]])


def with_routing(trees: List[treelit.TokenTree], shape) -> List[treelit.TokenTree]:
    """The trees again, each branch with recorded MoE routing ``shape = (layers, k, experts)``
    drawn as a function of its prefix (routing replay; ``routing_oracle.routing_for``)."""
    from routing_oracle import routing_for

    out = []
    for t in trees:
        branches = t.branches()
        rec = [routing_for(b, *shape) for b in branches]
        out.append(treelit.TokenTree.from_branches(
            branches, [t.loss_mask(b) for b in range(t.num_branches)], t.branch_weight,
            advantages=t.branch_adv, routed_experts=rec,
            old_logprobs=None if t.branch_old is None else
            [[None if np.isnan(v) else float(v) for v in t.branch_old[t.branch_ptr[b]:t.branch_ptr[b + 1]]]
             for b in range(t.num_branches)]))
    return out


def make_trees(kind: str, n_trees: int = 6, seed: int = 0) -> List[treelit.TokenTree]:
    """Trees of very different sizes (ranks get different shares and partition counts).
    ``kind``: ``sft``, ``rl`` (advantages; old log-probs near the tiny models' own), ``dpo``."""
    rng = np.random.default_rng(seed)
    trees = []
    for t in range(n_trees):
        prefix = [int(x) for x in rng.integers(1, 11, 3 + 3 * t)]
        nb = 2 * (1 + t // 2) if kind == "dpo" else 2 + t
        branches = [prefix + [int(x) for x in rng.integers(1, 11, 3 + (3 * b + t) % 8)] for b in range(nb)]
        masks = [[0] * len(prefix) + [1] * (len(b) - len(prefix)) for b in branches]
        weights = [1.0 + 0.5 * (b % 3) for b in range(nb)]
        if kind == "dpo":
            ref = [[None] + [float(-2.4 + 0.3 * np.sin(hash(tuple(b[: i + 1])) % 97)) for i in range(1, len(b))]
                   for b in branches]
            fields = {"pair": [b // 2 for b in range(nb)], "chosen": [b % 2 == 0 for b in range(nb)]}
            trees.append(treelit.TokenTree.from_branches(branches, masks, weights, ref_logprobs=ref, branch_fields=fields))
        elif kind == "rl":
            adv = [float(a) for a in rng.normal(0, 1, nb)]
            old = [[None] + [float(-2.4 + 0.05 * np.sin(hash(tuple(b[: i + 1])) % 89)) for i in range(1, len(b))]
                   for b in branches]
            trees.append(treelit.TokenTree.from_branches(branches, masks, weights, advantages=adv, old_logprobs=old))
        else:
            trees.append(treelit.TokenTree.from_branches(branches, masks, weights))
    return trees


def build(spec: Dict[str, Any], dtype):
    """The spec's model: a test family, or ``hf:<dir>`` (a transformers checkpoint through the
    adapter); ``router_coef`` turns a mixture-of-experts model's router loss on."""
    family = spec["family"]
    if family.startswith("hf:"):
        from treelit.models.hf_adapter import load_hf_model

        model = load_hf_model(family[3:], dtype=dtype)
    else:
        model = tiny_model(family, dtype)
    if spec.get("router_coef"):
        from treelit.models.factory import set_router_aux_loss

        set_router_aux_loss(model, spec["router_coef"], spec.get("router_definition", "micro_batch"))
    if spec.get("replay"):  # MoE routing replay: the trees carry routed_experts (with_routing)
        from treelit.models.factory import set_moe_routing

        set_moe_routing(model, "replay")
    return model


def rank_micro_batches(trees, rank: int, world: int, micro_tokens: int):
    """Largest tree first onto the least loaded rank; pack; pad with empty micro-batches."""
    empty = EMPTY
    routed = [t.token_routing for t in trees if t.token_routing is not None]
    if routed:  # routing replay: the padding micro-batches carry a routing too
        L, k = routed[0].shape[1:]
        empty = treelit.TokenTree.from_branches([[0, 0]], loss_masks=[[0, 0]],
                                                routed_experts=[np.tile(np.arange(k), (2, L, 1))])
    sizes = [t.to_batch().num_tokens for t in trees]
    shares: List[List[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(trees)), key=lambda i: -sizes[i]):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += sizes[i]
    packed = [treelit.pack_trees([trees[i] for i in sorted(s)], micro_tokens) if s else [] for s in shares]
    n = max(len(p) for p in packed)
    return packed[rank] + [empty.to_batch() for _ in range(n - len(packed[rank]))]


def exact_steps(rank: int, world: int, specs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """:func:`exact_step` for each spec, in one launch (process start-up dominates); a spec
    ``{"mismatch": True}`` runs :func:`mismatched_step` instead (last: it breaks its group)."""
    return [mismatched_step(rank, world) if spec.get("mismatch") else exact_step(rank, world, spec) for spec in specs]


def mismatched_step(rank: int, world: int):
    """Rank 0's training step issues a collective that rank 1's does not: rank 0 must fail
    with an error naming the step (within the collective timeout), not wait for ever."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from treelit.lightning.data import StepBatch
    from treelit.lightning.module import TreeLitModule

    group = dist.new_group(timeout=timedelta(seconds=3))
    module = TreeLitModule(tiny_model("qwen2_tiny", torch.float32), make_objective("sft"),
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.0))

    def step(batch):
        if rank == 0:
            dist.all_reduce(torch.ones(1), group=group)  # rank 1 never joins
        else:
            time.sleep(8)

    module._training_step = step
    try:
        module.training_step(StepBatch([EMPTY.to_batch()], index=7), 0)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


def exact_step(rank: int, world: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from treelit.lightning.module import TreeLitModule

    dtype = spec.get("dtype", torch.float64)
    family, name, agg = spec["family"], spec["objective"], spec.get("aggregation", "token-mean")
    opts = dict(spec.get("options", {}))
    trees = make_trees(spec.get("data", "sft"), spec.get("n_trees", 6), spec.get("seed", 0))
    if spec.get("replay"):
        trees = with_routing(trees, spec["replay"])
    micro_tokens = spec.get("micro_tokens", 150)
    model = build(spec, dtype)
    model.activation_checkpointing = bool(spec.get("checkpointing", False))
    module = TreeLitModule(model, make_objective(name, **opts), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                           aggregation=agg, attention="segment", partition="redundancy_free",
                           old_logprobs="rollout" if spec.get("rollout") else "data")
    if spec.get("mp"):
        from treelit.utils.distributed import mixed_precision_policy

        module.fsdp_mp_policy = mixed_precision_policy(*spec["mp"])
    if spec.get("replicas", 1) > 1:  # HSDP: replicas x world/replicas shards
        from treelit.utils.distributed import hsdp_mesh

        module._device_mesh = hsdp_mesh(spec["replicas"], world)
        module.configure_model()
    elif spec.get("sharded", True):
        module._device_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        module.configure_model()
    micro = rank_micro_batches(trees, rank, world, micro_tokens)
    oom_above = spec.get("oom_rank_above")  # (rank, tokens): that rank's blocks run out of memory on larger rows
    if oom_above is not None and oom_above[0] == rank:
        import treelit.models.decoder as dec

        real = dec._layer_forward

        def flaky(layer, i, pos, ctx, h):
            if h.shape[1] > oom_above[1]:
                raise torch.OutOfMemoryError("simulated")
            return real(layer, i, pos, ctx, h)

        dec._layer_forward = flaky
    try:
        return _exact_step(rank, world, spec, module, model, trees, micro, micro_tokens, dtype, family, name, agg, opts)
    finally:
        if oom_above is not None and oom_above[0] == rank:
            dec._layer_forward = real


def _exact_step(rank, world, spec, module, model, trees, micro, micro_tokens, dtype, family, name, agg, opts):
    from treelit.lightning.planner import MemoryPlanner
    from treelit.utils.distributed import Collectives, gather_full

    planner = MemoryPlanner(memory_limit_bytes=spec["limits"], initial_bytes_per_token=1000.0, margin=1.0,
                            fraction=1.0, measure_cpu=False)
    module.budget_tokens = planner.budget_for(module, micro)
    if spec.get("rollout"):
        module.record_rollout_logprobs(micro)
    out = module.compute_gradients(micro, planner)
    comm = Collectives()
    loss = comm.sum(out["loss"])
    grads = {n: gather_full(p.grad).detach().clone() if p.grad is not None else None for n, p in model.named_parameters()}
    per_rank = comm.gather_lists([int(out["partitions"]), int(out["token_forwards"]), int(out["empty_passes"]),
                                  int(module.budget_tokens), sum(mb.num_tokens for mb in micro)])
    if rank != 0:
        return None
    from treelit.loss.router import router_normalizer_contribution

    ref_model = build(spec, dtype)
    obj = make_objective(name, **opts)
    ref_micro = treelit.pack_trees(trees, micro_tokens)
    Z = treelit.global_normalizer(ref_micro, agg, objective=obj)
    R = sum(router_normalizer_contribution(ref_model, mb) for mb in ref_micro)
    ref_loss = 0.0
    for mb in ref_micro:
        if spec.get("rollout"):
            from treelit.loss.tree import tree_token_logprobs

            with torch.no_grad():
                sel, lp, _ = tree_token_logprobs(ref_model, mb, "sdpa_dense")
            old = torch.full((mb.num_tokens,), float("nan"), dtype=torch.float64)
            old[sel] = lp.double()
            mb.token_old_logp, mb.branch_old_logp = old, old[mb.branch_tokens]
        loss_mb = treelit.tree_loss(ref_model, mb, agg, "sdpa_dense", normalizer=Z, objective=obj, router_normalizer=R)
        loss_mb.backward()
        ref_loss += float(loss_mb.detach())
    ref_grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref_model.named_parameters()}
    got = {n: (g if g is not None else torch.zeros_like(ref_grads[n])) for n, g in grads.items()}
    return {
        "loss": loss, "ref_loss": ref_loss,
        "grad_err": max_rel_grad_diff(got, ref_grads, grad_floor(dtype), negligible_grad(dtype)),
        "grad_scale": max(float(g.norm()) for g in ref_grads.values()),
        "grad_err_global": float(torch.sqrt(sum(((got[k].double() - ref_grads[k].double()) ** 2).sum() for k in got))
                                 / torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values()))),
        "partitions": [r[0] for r in per_rank], "token_forwards": [r[1] for r in per_rank],
        "empty_passes": [r[2] for r in per_rank], "budget": [r[3] for r in per_rank],
        "head_bytes": planner.head_bytes, "chunk_rows": planner.chunk_rows,
        "rank_tokens": [r[4] for r in per_rank], "tree_tokens": sum(mb.num_tokens for mb in ref_micro),
        "longest": max(int(mb.position_ids.max()) + 1 for mb in ref_micro),
    }
