"""Scale: per-rank memory of DDP vs FSDP2, and a partitioned GRPO step on a large tree.

``sharding``: one SFT update (forward, backward, AdamW step) of a model large enough that
parameters, gradients and AdamW state dominate, on 2 and 4 gloo processes, with DDP
(treelit's gradient sum, every rank holds everything) and FSDP2 (``shard_model``: every
layer, the embeddings and the root sharded), with and without activation checkpointing;
``--modes hsdp`` adds HSDP (``--replicas`` R replicas of world/R shards, as
``trainer.strategy.replicate_degree=R``).
Per rank: the bytes of its parameters + gradients + AdamW state (local shards under
FSDP2), and the peak of all its tensors during the update (parameters held before the
update plus the peak of tensors allocated during it: activations, gathered blocks,
gradients, optimizer state; CPU allocations followed by ``treelit.utils.memory``).

``grpo``: one process, a tree of ``--completions`` completions of ``--completion-len``
tokens under a ``--prompt``-token prompt (a GRPO group), group-relative advantages from
random rewards. Peak tensor memory of one step for: the longest branch alone; the whole
tree partitioned with the budget set to the longest branch (GRPO: token-level, folded per
partition; GSPO: sequence-level, with its no-gradient log-prob pass); the rollout
log-prob pass that fills old log-probs (no gradient, partitioned); optionally the whole
tree unpartitioned. Token-forwards with gradient are reported apart from the no-gradient
ones; the partitioned GRPO gradients are compared with the unpartitioned ones.

``cp``: context parallelism (:func:`treelit.partition.context_parallel.cp_micro_batch`) on
one long tree (``--branches`` branches of ``--branch-len`` tokens under a ``--prefix``-token
prefix), one SFT forward + backward split over C gloo processes (``--worlds``; C = 1 is the
same code in one process). Per rank: its range of the DFS row, the ancestor path whose K/V it
receives (bytes over all layers), the bytes it sends forward (path K/V) and backward (their
gradients), counted at the point-to-point calls and checked against the plan's arithmetic
(rows x KV heads x (Dk + Dv) x element size per attention layer), the tensor bytes held when
the forward ends and the peak of the step. Parameters, buffers and gradient buffers exist
before the measured region and are not counted, nor are views of them made inside it (a linear
layer's ``W.t()``); FSDP2 shards them over every rank (see ``sharding``). The peak is what the
pass itself allocates: activations, the received K/V and their gradient buffers, logits
chunks and transient weight gradients. The ranks' summed gradients are compared with C = 1.

``cp-partitioned``: context parallelism inside partitioned passes
(:func:`treelit.partition.engine.run_micro_batch` with ``cp_group``) on the same tree. With L
the longest branch, C ranks each get the budget ``ceil(L / C)``, so chains of partitions hold
up to C x that = L tokens and every pass is split over the C ranks; C = 1 at budget L is the
smallest budget one process accepts, and C = 1 at ``ceil(L / 2)`` is recorded as refused
(``BudgetError``). Per rank: the step peak (counted as in ``cp``), the tokens it forwards and
the partitions; the ranks' summed gradients are compared with C = 1.

    python benchmarks/bench_scale.py sharding --json benchmarks/results/bench_scale_sharding.json
    python benchmarks/bench_scale.py sharding --worlds 4 --modes ddp fsdp2 hsdp --checkpointing on \
        --json benchmarks/results/bench_scale_hsdp.json
    python benchmarks/bench_scale.py grpo --json benchmarks/results/bench_scale_grpo.json
    python benchmarks/bench_scale.py cp --json benchmarks/results/bench_scale_cp.json
    python benchmarks/bench_scale.py cp-partitioned --json benchmarks/results/bench_scale_cp_partitioned.json
    python benchmarks/bench_scale.py table benchmarks/results/bench_scale_*.json    # the README tables
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch

MIB = 2**20


# ---------------------------------------------------------------------------------------
# sharding: DDP vs FSDP2 per rank


def _model(args):
    import treelit

    torch.manual_seed(0)
    return treelit.build_decoder(family="qwen2", vocab_size=args.vocab, num_layers=args.layers, num_heads=args.heads,
                                 num_kv_heads=getattr(args, "kv_heads", None) or max(1, args.heads // 2),
                                 embed_dim=args.dim, intermediate_dim=getattr(args, "intermediate", None) or 3 * args.dim,
                                 max_seq_len=max(4096, getattr(args, "prefix", 0) + getattr(args, "branch_len", 0)))


def _tree(rank: int, args):
    import treelit

    g = torch.Generator().manual_seed(100 + rank)
    prefix = torch.randint(16, args.vocab, (args.prefix,), generator=g).tolist()
    branches = [prefix + torch.randint(16, args.vocab, (args.branch_len,), generator=g).tolist()
                for _ in range(args.branches)]
    return treelit.TokenTree.from_branches(branches).to_batch()


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _measure(rank: int, world: int, mode: str, ckpt: bool, args):
    from torch.distributed.device_mesh import init_device_mesh

    from treelit.lightning.module import TreeLitModule
    from treelit.objectives import make_objective
    from treelit.utils.memory import LiveBytes

    model = _model(args)
    model.activation_checkpointing = ckpt
    module = TreeLitModule(model, make_objective("sft"), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                           attention="segment", grad_clip=0.0)
    if mode == "fsdp2":
        module._device_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        module.configure_model()
    elif mode == "hsdp":  # trainer.strategy.replicate_degree: replicas x world/replicas shards
        from treelit.utils.distributed import hsdp_mesh

        module._device_mesh = hsdp_mesh(args.replicas, world)
        module.configure_model()
    opt = module.configure_optimizers()
    batch = _tree(rank, args)
    params = sum(_local_bytes(p) for p in model.parameters())
    t0 = time.perf_counter()
    with LiveBytes() as live:
        module.compute_gradients([batch])
        grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        adam = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    seconds = time.perf_counter() - t0
    return {"params": params, "grads": grads, "adamw": adam, "state": params + grads + adam,
            "step_peak": params + live.peak, "seconds": seconds, "tree_tokens": batch.num_tokens}


def _worker(rank: int, world: int, port: int, mode: str, args, out: str):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    try:
        rows = []
        for ckpt in args.checkpointing:
            m = _measure(rank, world, mode, ckpt, args)
            t = torch.tensor([m["state"], m["step_peak"], m["params"], m["grads"], m["adamw"], m["seconds"]],
                             dtype=torch.float64)
            gathered = [torch.zeros_like(t) for _ in range(world)]
            dist.all_gather(gathered, t)
            if rank == 0:
                g = torch.stack(gathered)
                rows.append({"mode": mode, "world": world, "checkpointing": ckpt,
                             "replicas": args.replicas if mode == "hsdp" else (world if mode == "ddp" else 1),
                             "state_bytes_max": float(g[:, 0].max()), "step_peak_bytes_max": float(g[:, 1].max()),
                             "params_bytes": float(g[:, 2].max()), "grads_bytes": float(g[:, 3].max()),
                             "adamw_bytes": float(g[:, 4].max()), "seconds_max": float(g[:, 5].max()),
                             "tree_tokens_per_rank": m["tree_tokens"]})
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharding(args):
    import torch.multiprocessing as mp

    rows = []
    for world in args.worlds:
        for mode in args.modes:
            if mode == "hsdp" and (world % args.replicas or world == args.replicas):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rows.pt")
                mp.spawn(_worker, args=(world, _free_port(), mode, args, out), nprocs=world, join=True)
                rows += torch.load(out)
            for r in rows[-len(args.checkpointing):]:
                print(f"{r['mode']:5s} x{world} ckpt={str(r['checkpointing']):5s}: params+grads+AdamW "
                      f"{r['state_bytes_max'] / MIB:7.0f} MiB, step peak {r['step_peak_bytes_max'] / MIB:7.0f} MiB "
                      f"({r['seconds_max']:.1f}s)", flush=True)
    for r in rows:
        ddp = next(x for x in rows if x["mode"] == "ddp" and x["world"] == r["world"]
                   and x["checkpointing"] == r["checkpointing"])
        r["state_over_ddp"] = r["state_bytes_max"] / ddp["state_bytes_max"]
        r["step_peak_over_ddp"] = r["step_peak_bytes_max"] / ddp["step_peak_bytes_max"]
    n_params = sum(p.numel() for p in _model(args).parameters())
    return {"rows": rows, "parameters": n_params, "model": f"qwen2-style, {args.layers} layers, dim {args.dim}, "
            f"{args.heads} heads, vocab {args.vocab}, float32", "threads_per_rank": 1}


# ---------------------------------------------------------------------------------------
# a partitioned GRPO step on a large group


def grpo(args):
    import numpy as np

    import treelit
    from treelit.objectives import make_objective
    from treelit.partition import PartitionStats, tree_backward
    from treelit.partition.engine import policy_logprobs
    from treelit.utils.memory import peak_memory

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    V = args.vocab
    prompt = torch.randint(16, V, (args.prompt,), generator=g).tolist()
    branches = [prompt + torch.randint(16, V, (args.completion_len,), generator=g).tolist()
                for _ in range(args.completions)]
    masks = [[0] * args.prompt + [1] * args.completion_len for _ in branches]
    rewards = np.random.default_rng(0).integers(0, 2, args.completions).astype(float)
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    tree = treelit.TokenTree.from_branches(branches, masks, advantages=adv.tolist())
    batch = tree.to_batch()
    longest = max(map(len, branches))
    torch.manual_seed(0)
    model = treelit.build_decoder(family="qwen2", vocab_size=V, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                                  embed_dim=args.dim, intermediate_dim=3 * args.dim, max_seq_len=8192)
    agg = "seq-mean-token-mean"
    grpo_obj = make_objective("grpo")
    Z = treelit.global_normalizer([batch], agg, objective=grpo_obj)
    one = treelit.TokenTree.from_branches([branches[0]], [masks[0]], advantages=[float(adv[0])]).to_batch()
    out = {"tree_tokens": batch.num_tokens, "flat_tokens": batch.flat_tokens, "longest_branch": longest,
           "budget_tokens": longest, "completions": args.completions, "prompt": args.prompt,
           "completion_len": args.completion_len, "model": f"qwen2-style, {args.layers} layers, dim {args.dim}, vocab {V}, float32",
           "threads": args.threads}

    def timed(fn):
        t0 = time.perf_counter()
        peak, value = peak_memory(fn)
        return peak, value, time.perf_counter() - t0

    def grads():
        gr = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return gr

    # the rollout pass: old log-probs of every target, no gradient, partitioned
    st = PartitionStats()
    peak, old, sec = timed(lambda: policy_logprobs(model, batch, budget_tokens=longest, stats=st))
    out["rollout"] = {"peak_bytes": peak, "no_grad_forwards": st.extra_forwards, "seconds": sec}
    print(f"rollout log-probs (no grad): {st.extra_forwards} token-forwards, peak {peak / MIB:.0f} MiB, {sec:.1f}s", flush=True)
    batch.token_old_logp = old
    batch.branch_old_logp = old[batch.branch_tokens]
    one_old = policy_logprobs(model, one)
    one.token_old_logp, one.branch_old_logp = one_old, one_old[one.branch_tokens]

    peak, _, sec = timed(lambda: tree_backward(model, one, agg, "none", objective=grpo_obj))
    grads()
    out["branch"] = {"peak_bytes": peak, "seconds": sec}
    print(f"longest branch alone ({longest} tokens): peak {peak / MIB:.0f} MiB, {sec:.1f}s", flush=True)

    for name in ("grpo", "gspo"):
        obj = grpo_obj if name == "grpo" else make_objective("gspo", clip_low=0.5, clip_high=0.5)
        st = PartitionStats()
        peak, loss, sec = timed(lambda: tree_backward(model, batch, agg, "redundancy_free", longest, normalizer=Z,
                                                      stats=st, objective=obj))
        row = {"peak_bytes": peak, "over_branch": peak / out["branch"]["peak_bytes"], "partitions": st.partitions,
               "token_forwards": st.token_forwards, "no_grad_forwards": st.extra_forwards, "loss": loss, "seconds": sec}
        out[f"{name}_partitioned"] = row
        if name == "grpo":
            g_part = grads()
        else:
            grads()
        print(f"{name} partitioned (budget {longest}): {st.partitions} partitions, {st.token_forwards} token-forwards "
              f"with gradient + {st.extra_forwards} without, tree {batch.num_tokens}; peak {peak / MIB:.0f} MiB "
              f"({row['over_branch']:.2f}x the branch), {sec:.1f}s", flush=True)
    if args.unpartitioned:
        peak, loss, sec = timed(lambda: tree_backward(model, batch, agg, "none", normalizer=Z, objective=grpo_obj))
        g_full = grads()
        worst = max(((g_part[k] - g_full[k]).norm() / g_full[k].norm().clamp_min(1e-30)).item() for k in g_full)
        out["grpo_unpartitioned"] = {"peak_bytes": peak, "over_branch": peak / out["branch"]["peak_bytes"],
                                     "loss": loss, "seconds": sec}
        out["grpo_partitioned"]["max_rel_grad_diff_vs_unpartitioned"] = worst
        out["grpo_partitioned"]["loss_rel_diff_vs_unpartitioned"] = (
            abs(out["grpo_partitioned"]["loss"] - loss) / max(abs(loss), 1e-30))
        print(f"grpo unpartitioned: peak {peak / MIB:.0f} MiB ({peak / out['branch']['peak_bytes']:.1f}x the branch), "
              f"{sec:.1f}s; partitioned vs unpartitioned: max rel grad diff {worst:.1e}", flush=True)
    return out


# ---------------------------------------------------------------------------------------
# cp: context parallelism on one long tree, per rank


def _existing(live, tensors) -> None:
    """Mark the storages of ``tensors`` as held before the region: a view of a parameter made
    inside it (``W.t()`` in a linear layer) shares the parameter's storage and is not new memory."""
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key:
            live.live.setdefault(key, 0)


def _cp_step(model, batch, ckpt: bool, args):
    """One SFT forward + backward of ``batch`` split over the default group: this rank's figures."""
    import torch.distributed as dist

    import treelit.partition.context_parallel as cpm
    import treelit.partition.cp_exchange as cp_exchange
    from treelit.objectives import make_objective
    from treelit.utils.memory import LiveBytes

    model.activation_checkpointing = ckpt
    obj = make_objective("sft")
    for p in model.parameters():  # gradient buffers exist before the region (FSDP2 shards them)
        p.grad = torch.zeros_like(p)
    sent = [0, 0]  # bytes this rank sends: forward (path K/V, even tags), backward (their gradients, odd tags)
    held = []
    wait, forward_range = cp_exchange._exchange, cpm._forward_range
    live = LiveBytes()

    def counting_wait(ops, kind):
        for op in ops:
            if op.op is dist.isend:
                sent[op.tag % 2] += op.tensor.numel() * op.tensor.element_size()
        wait(ops, kind)

    def noting_forward(*a, **k):
        res = forward_range(*a, **k)
        held.append(live.current)  # tensors alive when the forward ends: what the backward will need
        return res

    _existing(live, [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())])
    cp_exchange._exchange, cpm._forward_range = counting_wait, noting_forward
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        with live:
            loss, _, plan = cpm.cp_micro_batch(model, obj, batch, None, aggregation="token-mean",
                                               normalizer=obj.norm_contribution(batch, "token-mean"),
                                               attention=args.attention)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        cp_exchange._exchange, cpm._forward_range = wait, forward_range
    # the plan's arithmetic: per attention layer, rows x KV heads x (Dk + Dv) x element size
    cfg = model.config
    row_bytes = cfg.num_kv_heads * 2 * cfg.head_dim * next(model.parameters()).element_size() * len(model.layers)
    return {"rank": plan.rank, "start": plan.start, "end": plan.end, "tokens": plan.size, "path": len(plan.path),
            "recv_kv_bytes": len(plan.path) * row_bytes,
            "plan_sent_bytes": sum(len(r) for r in plan.send.values()) * row_bytes,
            "sent_forward_bytes": sent[0], "sent_backward_bytes": sent[1], "held_after_forward_bytes": held[0],
            "step_peak_bytes": live.peak, "seconds": seconds, "cpu_seconds": cpu, "imbalance": plan.imbalance,
            "loss": loss, "kv_row_bytes_all_layers": row_bytes}


def _grad_diff_vs_one(model, rank: int, world: int, ref: str):
    """The ranks' gradients summed (the one-process gradient); on rank 0 their largest relative
    difference from the C = 1 run's, saved at ``ref`` by that run (None there, and on other ranks)."""
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
    if rank != 0:
        return None
    if world == 1:
        torch.save(grads, ref)
        return None
    one = torch.load(ref)
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads, one))


def _cp_worker(rank: int, world: int, port: int, args, out_dir: str):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    try:
        model = _model(args)
        batch = _tree(0, args)  # the same tree on every rank
        out = []
        for ckpt in args.checkpointing:
            m = _cp_step(model, batch, ckpt, args)
            ranks = [None] * world
            dist.all_gather_object(ranks, m)
            diff = _grad_diff_vs_one(model, rank, world, os.path.join(out_dir, f"grads_ckpt{int(ckpt)}.pt"))
            out.append({"world": world, "checkpointing": ckpt, "ranks": ranks, "max_rel_grad_diff_vs_one": diff,
                        "tree_tokens": batch.num_tokens, "logprob_allreduce_bytes": 8 * batch.num_tokens})
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "rows.pt"))
    finally:
        dist.destroy_process_group()


def cp(args):
    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted(set(args.worlds) | {1}):  # C = 1 first: the reference
            mp.spawn(_cp_worker, args=(world, _free_port(), args, tmp), nprocs=world, join=True)
            new = torch.load(os.path.join(tmp, "rows.pt"), weights_only=False)
            rows += new
            for r in new:
                for x in r["ranks"]:
                    # counted at the point-to-point calls = the plan; recomputed layers send their path again
                    assert x["sent_forward_bytes"] == x["plan_sent_bytes"] * (2 if r["checkpointing"] else 1), x
                    assert x["sent_backward_bytes"] == x["recv_kv_bytes"], x  # the received rows' gradients go back
                    print(f"C={world} ckpt={'on' if r['checkpointing'] else 'off':3s} rank {x['rank']}: tokens "
                          f"[{x['start']}, {x['end']}), path {x['path']}, recv K/V {x['recv_kv_bytes'] / MIB:.1f} MiB, "
                          f"sent {x['sent_forward_bytes'] / MIB:.1f} + {x['sent_backward_bytes'] / MIB:.1f} MiB, held "
                          f"after forward {x['held_after_forward_bytes'] / MIB:.0f} MiB, peak "
                          f"{x['step_peak_bytes'] / MIB:.0f} MiB ({x['seconds']:.1f}s)", flush=True)
    for r in rows:
        one = next(x for x in rows if x["world"] == 1 and x["checkpointing"] == r["checkpointing"])["ranks"][0]
        for x in r["ranks"]:
            x["step_peak_over_one"] = x["step_peak_bytes"] / one["step_peak_bytes"]
            x["held_over_one"] = x["held_after_forward_bytes"] / one["held_after_forward_bytes"]
        r["imbalance"] = r["ranks"][0]["imbalance"]
        r["sent_forward_bytes"] = sum(x["sent_forward_bytes"] for x in r["ranks"])
        r["sent_backward_bytes"] = sum(x["sent_backward_bytes"] for x in r["ranks"])
    a = args
    return {"cp": rows, "tree": f"{a.branches} branches of {a.branch_len} tokens under a {a.prefix}-token prefix",
            "model": f"qwen2-style, {a.layers} layers, dim {a.dim}, {a.heads} heads ({a.kv_heads} kv) x {a.dim // a.heads}, "
                     f"MLP {a.intermediate}, vocab {a.vocab}, float32", "attention": a.attention, "threads_per_rank": 1}


# ---------------------------------------------------------------------------------------
# cp-partitioned: context parallelism inside partitioned passes, per rank


def _cpp_worker(rank: int, world: int, port: int, args, out_dir: str):
    """One SFT forward + backward through ``run_micro_batch`` at ``ceil(L / C)`` tokens per rank
    (L: the longest branch), each pass split over the ``world`` ranks; C = 1 is one process."""
    import torch.distributed as dist

    from treelit.objectives import make_objective
    from treelit.partition.engine import PartitionStats, run_micro_batch
    from treelit.partition.plan import BudgetError, plan_partitions
    from treelit.utils.memory import LiveBytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    try:
        model = _model(args)
        batch = _tree(0, args)  # the same tree on every rank
        plan_l = plan_partitions(batch, batch.num_tokens)
        L = plan_l.longest_branch
        budget = -(-L // world)  # per rank: the smallest that holds the longest branch over C ranks
        plan = plan_partitions(batch, budget * world, per_rank=world)
        obj = make_objective("sft")
        Z = obj.norm_contribution(batch, "token-mean")
        out = []
        for ckpt in args.checkpointing:
            model.activation_checkpointing = ckpt
            for p in model.parameters():  # gradient buffers exist before the region (FSDP2 shards them)
                p.grad = torch.zeros_like(p)
            live = LiveBytes()
            _existing(live, [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())])
            stats = PartitionStats()
            t0, c0 = time.perf_counter(), time.process_time()
            with live:
                res = run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, budget_tokens=budget,
                                      attention=args.attention, stats=stats, cp_group=dist.group.WORLD)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            m = {"rank": rank, "step_peak_bytes": live.peak, "seconds": seconds, "cpu_seconds": cpu,
                 "passes": stats.partitions, "token_forwards": stats.token_forwards}
            ranks = [None] * world
            dist.all_gather_object(ranks, m)
            diff = _grad_diff_vs_one(model, rank, world, os.path.join(out_dir, f"grads_ckpt{int(ckpt)}.pt"))
            out.append({"world": world, "checkpointing": ckpt, "budget_per_rank": budget, "chain_budget": budget * world,
                        "longest_branch": L, "tree_tokens": batch.num_tokens, "partitions": len(plan.partitions),
                        "partition_tokens": [int(p.size) for p in plan.partitions],
                        "max_chain_tokens": plan.max_chain_tokens, "loss": res.loss, "ranks": ranks,
                        "max_rel_grad_diff_vs_one": diff})
        if world == 1:  # one process below the longest branch: refused before any pass runs
            try:
                run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z,
                                budget_tokens=-(-L // 2), attention=args.attention)
                refused = None
            except BudgetError as e:
                refused = str(e)
            out.append({"world": 1, "budget_per_rank": -(-L // 2), "refused": refused})
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "rows.pt"))
    finally:
        dist.destroy_process_group()


def cp_partitioned(args):
    import torch.multiprocessing as mp

    rows, refused = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted(set(args.worlds) | {1}):  # C = 1 first: the reference
            mp.spawn(_cpp_worker, args=(world, _free_port(), args, tmp), nprocs=world, join=True)
            new = torch.load(os.path.join(tmp, "rows.pt"), weights_only=False)
            for r in new:
                if "refused" in r:
                    assert r["refused"] is not None, "one process ran below its longest branch"
                    refused.append(r)
                    print(f"C=1 budget {r['budget_per_rank']}: refused ({r['refused']})", flush=True)
                    continue
                rows.append(r)
                assert r["max_chain_tokens"] <= r["chain_budget"], r
                if r["max_rel_grad_diff_vs_one"] is not None:  # float32: the same gradients up to rounding
                    assert r["max_rel_grad_diff_vs_one"] < 1e-4, r["max_rel_grad_diff_vs_one"]
                for x in r["ranks"]:
                    print(f"C={world} ckpt={'on' if r['checkpointing'] else 'off':3s} budget {r['budget_per_rank']}/rank "
                          f"rank {x['rank']}: {r['partitions']} partitions, chains up to {r['max_chain_tokens']} tokens, "
                          f"peak {x['step_peak_bytes'] / MIB:.0f} MiB ({x['seconds']:.1f}s)", flush=True)
    for r in rows:
        one = next(x for x in rows if x["world"] == 1 and x["checkpointing"] == r["checkpointing"])["ranks"][0]
        for x in r["ranks"]:
            x["step_peak_over_one"] = x["step_peak_bytes"] / one["step_peak_bytes"]
        r["step_peak_bytes_max"] = max(x["step_peak_bytes"] for x in r["ranks"])
        r["step_peak_max_over_one"] = r["step_peak_bytes_max"] / one["step_peak_bytes"]
    a = args
    return {"cp_partitioned": rows, "refused": refused,
            "tree": f"{a.branches} branches of {a.branch_len} tokens under a {a.prefix}-token prefix",
            "model": f"qwen2-style, {a.layers} layers, dim {a.dim}, {a.heads} heads ({a.kv_heads} kv) x {a.dim // a.heads}, "
                     f"MLP {a.intermediate}, vocab {a.vocab}, float32", "attention": a.attention, "threads_per_rank": 1}


def table(paths) -> str:
    """The README tables from result files."""
    lines = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        lines.append(f"$ {d['command']}")
        if "cp_partitioned" in d:
            rows = d["cp_partitioned"]
            lines.append(f"# {d['tree']} ({rows[0]['tree_tokens']} tokens, longest branch L = {rows[0]['longest_branch']}); "
                         f"{d['model']}; attention={d['attention']}, {d['threads_per_rank']} thread per rank, SFT forward + "
                         f"backward through run_micro_batch; fwd tok = tokens the rank forwards, cpu = CPU seconds of the step")
            lines.append(f"{'C':>2s}{'ckpt':>5s}{'budget/rank':>12s}{'partitions':>11s}{'max chain':>10s}{'rank':>5s}"
                         f"{'fwd tok':>8s}{'step peak':>11s}{'vs C=1':>7s}{'cpu':>6s}{'grad diff':>10s}")
            for r in rows:
                for x in r["ranks"]:
                    diff = r["max_rel_grad_diff_vs_one"]
                    lines.append(f"{r['world']:>2d}{('on' if r['checkpointing'] else 'off'):>5s}{r['budget_per_rank']:>12d}"
                                 f"{r['partitions']:>11d}{r['max_chain_tokens']:>10d}{x['rank']:>5d}"
                                 f"{x['token_forwards']:>8d}{x['step_peak_bytes'] / MIB:>7.0f} MiB{x['step_peak_over_one']:>6.2f}x"
                                 f"{x['cpu_seconds']:>5.0f}s{('-' if diff is None else f'{diff:.1e}'):>10s}")
            for r in d["refused"]:
                lines.append(f"# C=1 at budget {r['budget_per_rank']}: refused (BudgetError: {r['refused']})")
            continue
        if "cp" in d:
            lines.append(f"# {d['tree']} ({d['cp'][0]['tree_tokens']} tokens); {d['model']}; attention={d['attention']}, "
                         f"{d['threads_per_rank']} thread per rank, cpu = CPU seconds of the step")
            lines.append(f"{'C':>2s}{'ckpt':>5s}{'rank':>5s}{'tokens':>13s}{'path':>6s}{'recv K/V':>10s}{'sent fwd':>10s}"
                         f"{'sent bwd':>10s}{'held after fwd':>16s}{'vs C=1':>7s}{'step peak':>11s}{'vs C=1':>7s}{'cpu':>6s}")
            for r in d["cp"]:
                for x in r["ranks"]:
                    lines.append(f"{r['world']:>2d}{('on' if r['checkpointing'] else 'off'):>5s}{x['rank']:>5d}"
                                 f"{x['tokens']:>6d} @{x['start']:>5d}{x['path']:>6d}{x['recv_kv_bytes'] / MIB:>6.1f} MiB"
                                 f"{x['sent_forward_bytes'] / MIB:>6.1f} MiB{x['sent_backward_bytes'] / MIB:>6.1f} MiB"
                                 f"{x['held_after_forward_bytes'] / MIB:>12.0f} MiB{x['held_over_one']:>6.2f}x"
                                 f"{x['step_peak_bytes'] / MIB:>7.0f} MiB{x['step_peak_over_one']:>6.2f}x{x['cpu_seconds']:>5.0f}s")
            for r in d["cp"]:
                if r["world"] == 1:
                    continue
                lines.append(f"# C={r['world']}, ckpt {'on' if r['checkpointing'] else 'off'}: cp/imbalance "
                             f"{r['imbalance']:.1e}; per step {r['sent_forward_bytes'] / MIB:.1f} MiB of K/V sent + "
                             f"{r['sent_backward_bytes'] / MIB:.1f} MiB of gradients back (+ a {r['logprob_allreduce_bytes'] / 1024:.0f}"
                             f" KiB log-prob all-reduce); gradients vs C=1: {r['max_rel_grad_diff_vs_one']:.1e}")
            continue
        if "rows" in d:
            lines.append(f"{'strategy':9s}{'ranks':>6s}{'checkpointing':>15s}{'params+grads+AdamW':>21s}{'vs DDP':>8s}"
                         f"{'step peak':>11s}{'vs DDP':>8s}")
            for r in d["rows"]:
                name = f"hsdp {r['replicas']}x{r['world'] // r['replicas']}" if r["mode"] == "hsdp" else r["mode"]
                lines.append(f"{name:9s}{r['world']:>6d}{('on' if r['checkpointing'] else 'off'):>15s}"
                             f"{r['state_bytes_max'] / MIB:>17.0f} MiB{r['state_over_ddp']:>7.2f}x"
                             f"{r['step_peak_bytes_max'] / MIB:>7.0f} MiB{r['step_peak_over_ddp']:>7.2f}x")
            continue
        b = d["branch"]["peak_bytes"]
        lines.append(f"tree {d['tree_tokens']} tokens ({d['completions']} x {d['completion_len']} under "
                     f"{d['prompt']}), longest branch {d['longest_branch']}, budget {d['budget_tokens']}")
        lines.append(f"{'step':28s}{'peak':>10s}{'vs branch':>11s}{'partitions':>12s}{'fwd (grad)':>12s}{'fwd (no grad)':>15s}"
                     f"{'time':>8s}")
        lines.append(f"{'longest branch alone':28s}{b / MIB:>6.0f} MiB{1.0:>10.2f}x{1:>12d}{d['longest_branch']:>12d}{0:>15d}"
                     f"{d['branch']['seconds']:>7.0f}s")
        for key, name in (("grpo_partitioned", "grpo, partitioned"), ("gspo_partitioned", "gspo, partitioned"),
                          ("grpo_unpartitioned", "grpo, unpartitioned")):
            if key not in d:
                continue
            r = d[key]
            parts = r.get("partitions", 1)
            fwd = r.get("token_forwards", d["tree_tokens"])
            lines.append(f"{name:28s}{r['peak_bytes'] / MIB:>6.0f} MiB{r['over_branch']:>10.2f}x{parts:>12d}{fwd:>12d}"
                         f"{r.get('no_grad_forwards', 0):>15d}{r['seconds']:>7.0f}s")
        r = d["rollout"]
        lines.append(f"{'rollout log-probs (no grad)':28s}{r['peak_bytes'] / MIB:>6.0f} MiB{r['peak_bytes'] / b:>10.2f}x"
                     f"{'':>12s}{0:>12d}{r['no_grad_forwards']:>15d}{r['seconds']:>7.0f}s")
        g = d.get("grpo_partitioned", {})
        if "max_rel_grad_diff_vs_unpartitioned" in g:
            u = d["grpo_unpartitioned"]["loss"]
            lines.append(f"# partitioned vs unpartitioned grpo: loss {g['loss']:.1e} vs {u:.1e} (on-policy, advantages "
                         f"summing to 0: the loss is 0 up to rounding), max rel grad diff "
                         f"{g['max_rel_grad_diff_vs_unpartitioned']:.1e} (float32)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sharding")
    s.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--dim", type=int, default=512)
    s.add_argument("--heads", type=int, default=8)
    s.add_argument("--vocab", type=int, default=32768)
    s.add_argument("--prefix", type=int, default=512)
    s.add_argument("--branches", type=int, default=4)
    s.add_argument("--branch-len", type=int, default=512)
    s.add_argument("--modes", nargs="+", choices=["ddp", "fsdp2", "hsdp"], default=["ddp", "fsdp2"])
    s.add_argument("--replicas", type=int, default=2, help="hsdp: replicas (each world/replicas shards)")
    s.add_argument("--checkpointing", type=lambda v: v == "on", nargs="+", default=[False, True],
                   help="activation checkpointing: off, on or both")
    s.add_argument("--json")
    r = sub.add_parser("grpo")
    r.add_argument("--prompt", type=int, default=1024)
    r.add_argument("--completions", type=int, default=16)
    r.add_argument("--completion-len", type=int, default=2048)
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--dim", type=int, default=256)
    r.add_argument("--vocab", type=int, default=32768)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--unpartitioned", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--json")
    c = sub.add_parser("cp")
    c.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="context-parallel degrees C (1: one process)")
    c.add_argument("--layers", type=int, default=8)
    c.add_argument("--dim", type=int, default=512)
    c.add_argument("--heads", type=int, default=8)
    c.add_argument("--kv-heads", type=int, default=2)
    c.add_argument("--intermediate", type=int, default=2816)
    c.add_argument("--vocab", type=int, default=32768)
    c.add_argument("--prefix", type=int, default=2048)
    c.add_argument("--branches", type=int, default=4)
    c.add_argument("--branch-len", type=int, default=1024)
    c.add_argument("--attention", default="segment")
    c.add_argument("--checkpointing", type=lambda v: v == "on", nargs="+", default=[False, True],
                   help="activation checkpointing: off, on or both")
    c.add_argument("--json")
    q = sub.add_parser("cp-partitioned")
    q.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4],
                   help="context-parallel degrees C (1: one process); budget per rank ceil(L / C)")
    q.add_argument("--layers", type=int, default=8)
    q.add_argument("--dim", type=int, default=512)
    q.add_argument("--heads", type=int, default=8)
    q.add_argument("--kv-heads", type=int, default=2)
    q.add_argument("--intermediate", type=int, default=2816)
    q.add_argument("--vocab", type=int, default=32768)
    q.add_argument("--prefix", type=int, default=2048)
    q.add_argument("--branches", type=int, default=4)
    q.add_argument("--branch-len", type=int, default=1024)
    q.add_argument("--attention", default="segment")
    q.add_argument("--checkpointing", type=lambda v: v == "on", nargs="+", default=[False],
                   help="activation checkpointing: off, on or both")
    q.add_argument("--json")
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    if args.what == "table":
        print(table(args.results))
        return
    t0 = time.perf_counter()
    result = {"sharding": sharding, "grpo": grpo, "cp": cp, "cp-partitioned": cp_partitioned}[args.what](args)
    result["command"] = " ".join(["python", "benchmarks/bench_scale.py", *(argv if argv is not None else sys.argv[1:])])
    result["torch"] = torch.__version__
    result["seconds"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
