"""Context parallelism: one attention layer's ancestor K/V exchange, done three ways.

Under context parallelism (:mod:`treelit.partition.context_parallel`) the DFS row of a tree is
cut into C ranges. For each attention layer, rank r needs the K/V of the root-to-s path
(s: its range's first token), which earlier ranks hold. The backward returns the gradients of
those rows to their owners. This benchmark times the forward + backward of ONE layer's
exchange on C gloo processes (one thread each), done three ways. Each way gives every rank
exactly the path rows it needs, and gives every owner exactly the summed gradient:

* ``p2p``: treelit's own, ``_PathRows.apply(kv, cp_plan(...), group, tag, 2)``, as
  ``_CPContext.attention`` calls it. Each owner sends each later rank the path rows it holds,
  one message per pair (K and V together); the backward sends their gradients back.
* ``allgather``: every rank all-gathers every range's K/V (``dist.all_gather``; the blocks are
  padded to the longest range, since the collective takes equal sizes) and keeps its path
  rows. The backward reduce-scatters the gradients to the owners (``dist.reduce_scatter``).
* ``ring``: C - 1 steps. In each, a rank sends the range block it last received (its own at
  first) to the next rank, and receives one from the previous rank; it keeps the path rows it
  needs. A block travels from its owner to the last rank and no further, since no earlier rank
  needs it. The backward runs the ring the other way: each block's gradient accumulates from
  the last rank back to its owner.

Trees (``--shapes``), both cut by treelit's cost balance (``token_costs`` with the model of
``bench_scale.py cp``: qwen2-style, 8 layers, dim 512, vocab 32768):

* ``branches``: ``--branches`` branches of ``--branch-len`` tokens under a ``--prefix``-token
  prefix, the tree of ``bench_scale.py cp``;
* ``path``: one path of as many tokens, so each range's path is the whole row before it.

One layer's K/V per token is ``--kv-heads`` x (``--head-dim`` + ``--head-dim``), 2 x (64 + 64)
by default: Qwen2.5-0.5B's (2 KV heads of 64), also the K/V of ``bench_scale.py cp``'s model.

Per way:

* bytes sent per rank, forward and backward (the maximum over ranks of each). For ``p2p`` and
  ``ring`` they are counted at the point-to-point calls. For ``allgather`` they are the volume
  a ring algorithm sends for the collective: (C - 1) padded blocks per rank each way. All are
  checked against the plan's arithmetic.
* wall time of forward + backward: the slowest rank's time in each repetition, median over
  ``--repeats`` after ``--warmup``, and its ratio to ``p2p`` in the same run. The three ways
  take turns within each repetition, in a rotating order.

Before timing, each (C, tree) runs once in float64 with integer values. This checks that the
three ways give every rank the same received rows and every owner the same gradient, equal to
a reference computed from the whole row (exact: sums of integers). So the three compare equal
work. The timed runs also check that the received rows are identical.

    python benchmarks/bench_cp_exchange.py --json benchmarks/results/bench_cp_exchange.json
    python benchmarks/bench_cp_exchange.py --table benchmarks/results/bench_cp_exchange.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

MIB = 2**20
METHODS = ("p2p", "allgather", "ring")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# ---------------------------------------------------------------------------------------
# the trees and their plans


def tree(shape: str, args):
    """The tree ``shape`` as a batch (token values are irrelevant here: only the structure is)."""
    import treelit

    g = torch.Generator().manual_seed(0)
    n = args.prefix + args.branches * args.branch_len
    if shape == "path":
        return treelit.TokenTree.from_branches([torch.randint(16, 1000, (n,), generator=g).tolist()]).to_batch()
    prefix = torch.randint(16, 1000, (args.prefix,), generator=g).tolist()
    branches = [prefix + torch.randint(16, 1000, (args.branch_len,), generator=g).tolist() for _ in range(args.branches)]
    return treelit.TokenTree.from_branches(branches).to_batch()


def costs(batch, args):
    """Per-token costs the ranges balance: those of ``bench_scale.py cp``'s model, or (``--costs
    uniform``) treelit's model-free default."""
    from treelit.partition.context_parallel import token_costs

    if args.costs == "uniform":
        return token_costs(batch)
    import treelit

    torch.manual_seed(0)
    model = treelit.build_decoder(family="qwen2", vocab_size=32768, num_layers=8, num_heads=8, num_kv_heads=2,
                                  embed_dim=512, intermediate_dim=2816, max_seq_len=8192)
    return token_costs(batch, model)


def expected_bytes(plans, row_bytes: int):
    """Per method, per rank: (bytes sent forward, bytes sent backward), from the plans alone."""
    C = len(plans)
    sizes = [e - s for s, e in plans[0].ranges]
    tmax = max(sizes)
    out = {}
    out["p2p"] = [(sum(len(r) for r in p.send.values()) * row_bytes, len(p.path) * row_bytes) for p in plans]
    out["allgather"] = [((C - 1) * tmax * row_bytes, (C - 1) * tmax * row_bytes) for _ in plans]
    # ring: rank r < C-1 forwards blocks 0..r; rank r returns the gradients of blocks 0..r-1
    out["ring"] = [((sum(sizes[: r + 1]) if r < C - 1 else 0) * row_bytes, sum(sizes[:r]) * row_bytes)
                   for r in range(C)]
    return out


# ---------------------------------------------------------------------------------------
# the two alternatives to treelit's point-to-point path rows (treelit's own is _PathRows)


def _batch(ops, counter, key) -> None:
    for op in ops:
        if op.op is dist.isend:
            counter[key] += op.tensor.numel() * op.tensor.element_size()
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _rows_of(plan, src: int, device):
    """(positions in ``plan.path``, rows within ``src``'s block) of the path rows ``src`` holds."""
    pos = plan.recv[src]
    return torch.from_numpy(pos).to(device), torch.from_numpy(plan.path[pos] - plan.ranges[src][0]).to(device)


class AllGatherRows(torch.autograd.Function):
    """``[ext; x]`` along ``dim`` (as ``_PathRows``): every range's block all-gathered (padded to
    the longest), the path rows kept. Backward: the gradients reduce-scattered to the owners."""

    @staticmethod
    def forward(ctx, x, plan, dim: int, counter):
        ctx.plan, ctx.dim, ctx.counter = plan, dim, counter
        C, T = len(plan.ranges), x.shape[dim]
        tmax = max(e - s for s, e in plan.ranges)
        shape = list(x.shape)
        shape[dim] = tmax
        block = x.contiguous()
        if T != tmax:  # padded to the longest range
            block = x.new_zeros(shape)
            block.narrow(dim, 0, T).copy_(x)
        blocks = [torch.empty_like(block) for _ in range(C)]
        dist.all_gather(blocks, block)
        counter["fwd"] += (C - 1) * block.numel() * block.element_size()
        shape[dim] = len(plan.path)
        ext = x.new_zeros(shape)
        for src in plan.recv:
            pos, rows = _rows_of(plan, src, x.device)
            ext.index_copy_(dim, pos, blocks[src].index_select(dim, rows))
        return torch.cat([ext, x], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        plan, dim = ctx.plan, ctx.dim
        C, E, rank = len(plan.ranges), len(plan.path), plan.rank
        tmax = max(e - s for s, e in plan.ranges)
        g_ext = grad.narrow(dim, 0, E)
        g_own = grad.narrow(dim, E, grad.shape[dim] - E)
        shape = list(grad.shape)
        shape[dim] = tmax
        ins = [grad.new_zeros(shape) for _ in range(C)]
        ins[rank].narrow(dim, 0, g_own.shape[dim]).copy_(g_own)
        for src in plan.recv:
            pos, rows = _rows_of(plan, src, grad.device)
            ins[src].index_add_(dim, rows, g_ext.index_select(dim, pos))
        out = grad.new_empty(shape)
        dist.reduce_scatter(out, ins)
        ctx.counter["bwd"] += (C - 1) * out.numel() * out.element_size()
        return out.narrow(dim, 0, g_own.shape[dim]), None, None, None


class RingRows(torch.autograd.Function):
    """``[ext; x]`` along ``dim``: range blocks passed rank to rank (a block goes from its owner
    up to the last rank), the path rows kept. Backward: the other way, each block's gradient
    summed from the last rank down to its owner."""

    @staticmethod
    def forward(ctx, x, plan, dim: int, counter):
        ctx.plan, ctx.dim, ctx.counter = plan, dim, counter
        C, rank = len(plan.ranges), plan.rank
        shape = list(x.shape)
        shape[dim] = len(plan.path)
        ext = x.new_zeros(shape)
        cur = x.contiguous()
        for k in range(1, C):
            ops, buf = [], None
            if rank + 1 < C and rank - k + 1 >= 0:  # forward the block of rank - k + 1
                ops.append(dist.P2POp(dist.isend, cur, rank + 1, None, 2))
            src = rank - k
            if src >= 0:  # the block of rank - k, from the previous rank
                s, e = plan.ranges[src]
                shape[dim] = e - s
                buf = x.new_empty(shape)
                ops.append(dist.P2POp(dist.irecv, buf, rank - 1, None, 2))
            _batch(ops, counter, "fwd")
            if buf is not None:
                if src in plan.recv:
                    pos, rows = _rows_of(plan, src, x.device)
                    ext.index_copy_(dim, pos, buf.index_select(dim, rows))
                cur = buf
        return torch.cat([ext, x], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        plan, dim, counter = ctx.plan, ctx.dim, ctx.counter
        C, E, rank = len(plan.ranges), len(plan.path), plan.rank
        g_ext = grad.narrow(dim, 0, E)
        g_own = grad.narrow(dim, E, grad.shape[dim] - E).clone()
        shape = list(grad.shape)
        acc = {}  # block -> this rank's part of its gradient (plus what the next rank sent)
        for o in range(rank):
            s, e = plan.ranges[o]
            shape[dim] = e - s
            acc[o] = grad.new_zeros(shape)
            if o in plan.recv:
                pos, rows = _rows_of(plan, o, grad.device)
                acc[o].index_add_(dim, rows, g_ext.index_select(dim, pos))
        for k in range(C - 1, 0, -1):
            ops, got = [], None
            o_in = rank - k + 1  # the block this rank forwarded at step k: its gradient comes back
            if rank + 1 < C and o_in >= 0:
                s, e = plan.ranges[o_in]
                shape[dim] = e - s
                got = grad.new_empty(shape)
                ops.append(dist.P2POp(dist.irecv, got, rank + 1, None, 3))
            o_out = rank - k  # the block this rank received at step k: its gradient goes back
            if o_out >= 0:
                ops.append(dist.P2POp(dist.isend, acc[o_out], rank - 1, None, 3))
            _batch(ops, counter, "bwd")
            if got is not None:
                if o_in == rank:
                    g_own += got
                else:
                    acc[o_in] += got
        return g_own, None, None, None


@contextlib.contextmanager
def _counting_p2p(counter):
    """Count the bytes ``_PathRows`` sends (even tags: the forward, odd: the backward)."""
    import treelit.partition.cp_exchange as cpm  # the module whose _exchange the exchanges call

    exchange = cpm._exchange

    def counting(ops, kind):
        for op in ops:
            if op.op is dist.isend:
                counter["bwd" if op.tag % 2 else "fwd"] += op.tensor.numel() * op.tensor.element_size()
        exchange(ops, kind)

    cpm._exchange = counting
    try:
        yield
    finally:
        cpm._exchange = exchange


def exchange(method: str, own, grad, plan, counter=None):
    """One forward + backward of ``[ext; own]`` (dim 2 of ``[1, Hkv, T, Dk + Dv]``) by ``method``:
    ``(the received rows [1, Hkv, E, Dk + Dv], the own rows' gradient)``. ``counter``: add the
    bytes sent to its ``fwd`` and ``bwd``."""
    from treelit.partition.context_parallel import _PathRows

    x = own.detach().requires_grad_()
    if method == "p2p":
        with _counting_p2p(counter) if counter is not None else contextlib.nullcontext():
            out = _PathRows.apply(x, plan, None, 0, 2)  # as _CPContext.attention calls it
            out.backward(grad)
    else:
        fn = AllGatherRows if method == "allgather" else RingRows
        out = fn.apply(x, plan, 2, counter if counter is not None else {"fwd": 0, "bwd": 0})
        out.backward(grad)
    return out.detach().narrow(2, 0, len(plan.path)), x.grad


# ---------------------------------------------------------------------------------------
# per (C, tree): the exactness check, the byte counts, the timings


def _values(N: int, args, dtype, seed: int, integer: bool):
    g = torch.Generator().manual_seed(seed)
    shape = (1, args.kv_heads, N, 2 * args.head_dim)
    if integer:
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _inputs(plans, N: int, args, dtype, integer: bool):
    """This rank's own K/V, the gradient of its ``[ext; own]``, and the reference: the path rows
    taken from the whole row and the own rows' gradient summed over every rank that uses them."""
    rank = dist.get_rank()
    full = _values(N, args, dtype, 1, integer)
    grads = [_values(len(p.path) + p.size, args, dtype, 2 + d, integer) for d, p in enumerate(plans)]
    p = plans[rank]
    own = full[:, :, p.start:p.end].clone()
    ref_ext = full[:, :, torch.from_numpy(p.path)]
    ref_grad = grads[rank][:, :, len(p.path):].clone()
    for d, q in enumerate(plans):
        if rank in q.recv:
            pos = q.recv[rank]
            ref_grad.index_add_(2, torch.from_numpy(q.path[pos] - p.start), grads[d][:, :, torch.from_numpy(pos)])
    return own, grads[rank], ref_ext, ref_grad


def check(plans, N: int, args) -> None:
    """float64, integer values: every way gives the reference exactly, on every rank."""
    own, grad, ref_ext, ref_grad = _inputs(plans, N, args, torch.float64, integer=True)
    plan = plans[dist.get_rank()]
    for m in METHODS:
        ext, g = exchange(m, own, grad, plan)
        assert torch.equal(ext, ref_ext), (m, plan.rank, "received rows")
        assert torch.equal(g, ref_grad), (m, plan.rank, "gradient at the owner")


def measure(plans, N: int, args, dtype_name: str):
    """This rank's byte counts (per method) and times (per method, per repetition)."""
    dtype = DTYPES[dtype_name]
    own, grad, ref_ext, _ = _inputs(plans, N, args, dtype, integer=False)
    plan = plans[dist.get_rank()]
    sent = {}
    for m in METHODS:  # counted once, then warm-up
        counter = {"fwd": 0, "bwd": 0}
        dist.barrier()
        ext, _ = exchange(m, own, grad, plan, counter)
        assert torch.equal(ext, ref_ext), (m, plan.rank)
        sent[m] = (counter["fwd"], counter["bwd"])
        for _ in range(args.warmup):
            dist.barrier()
            exchange(m, own, grad, plan)
    times = {m: [] for m in METHODS}
    for i in range(args.repeats):
        for j in range(len(METHODS)):
            m = METHODS[(i + j) % len(METHODS)]
            dist.barrier()
            t0 = time.perf_counter()
            exchange(m, own, grad, plan)
            times[m].append(time.perf_counter() - t0)
    return sent, times


def _worker(rank: int, world: int, port: int, args, shape_costs, out: str):
    from treelit.partition.context_parallel import cp_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        rows = []
        for shape in args.shapes:
            batch = tree(shape, args)
            N = batch.num_tokens
            plans = [cp_plan(batch, world, r, shape_costs[shape]) for r in range(world)]
            check(plans, N, args)
            for dtype_name in args.dtypes:
                sent, times = measure(plans, N, args, dtype_name)
                every = [None] * world
                dist.all_gather_object(every, (sent, times))
                if rank:
                    continue
                row_bytes = args.kv_heads * 2 * args.head_dim * DTYPES[dtype_name].itemsize
                want = expected_bytes(plans, row_bytes)
                for m in METHODS:
                    per_rank = [every[r][0][m] for r in range(world)]
                    assert per_rank == [tuple(w) for w in want[m]], (m, per_rank, want[m])
                    slowest = [max(every[r][1][m][i] for r in range(world)) for i in range(args.repeats)]
                    rows.append({"world": world, "tree": shape, "dtype": dtype_name, "method": m,
                                 "tokens": N, "ranges": [list(r) for r in plans[0].ranges],
                                 "paths": [len(p.path) for p in plans], "row_bytes": row_bytes,
                                 "sent_forward_bytes": [f for f, _ in per_rank],
                                 "sent_backward_bytes": [b for _, b in per_rank],
                                 "sent_forward_max": max(f for f, _ in per_rank),
                                 "sent_backward_max": max(b for _, b in per_rank),
                                 "sent_total": sum(f + b for f, b in per_rank),
                                 "seconds": slowest, "median_s": statistics.median(slowest),
                                 "exact_float64": True})
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args):
    """Every (C, tree, dtype, method) row, with its ratios to ``p2p``."""
    import torch.multiprocessing as mp

    shape_costs = {s: costs(tree(s, args), args) for s in args.shapes}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = os.path.join(tmp, f"rows{world}.pt")
            mp.spawn(_worker, args=(world, _free_port(), args, shape_costs, out), nprocs=world, join=True)
            new = torch.load(out, weights_only=False)
            rows += new
            for r in new:
                print(f"C={world} {r['tree']:8s} {r['dtype']:8s} {r['method']:9s}: sent {r['sent_forward_max'] / MIB:.2f}"
                      f" + {r['sent_backward_max'] / MIB:.2f} MiB (max rank), {r['median_s'] * 1e3:.2f} ms", flush=True)
    for r in rows:
        p2p = next(x for x in rows if x["method"] == "p2p" and x["world"] == r["world"] and x["tree"] == r["tree"]
                   and x["dtype"] == r["dtype"])
        r["bytes_over_p2p"] = ((r["sent_forward_max"] + r["sent_backward_max"])
                               / max(p2p["sent_forward_max"] + p2p["sent_backward_max"], 1))
        r["total_over_p2p"] = r["sent_total"] / max(p2p["sent_total"], 1)
        r["time_over_p2p"] = r["median_s"] / p2p["median_s"]
    a = args
    n = a.prefix + a.branches * a.branch_len
    return {"rows": rows,
            "trees": {"branches": f"{a.branches} branches of {a.branch_len} tokens under a {a.prefix}-token prefix",
                      "path": f"one path of {n} tokens"},
            "kv": f"one layer, {a.kv_heads} KV heads x ({a.head_dim} + {a.head_dim})", "costs": a.costs,
            "repeats": a.repeats, "warmup": a.warmup, "threads_per_rank": 1, "backend": "gloo"}


def table(d) -> str:
    lines = [f"$ {d['command']}",
             f"# branches: {d['trees']['branches']}; path: {d['trees']['path']}; {d['kv']}; gloo, "
             f"{d['threads_per_rank']} thread per rank; time: median of {d['repeats']} (slowest rank each), "
             "forward + backward",
             "# sent fwd, sent bwd: the most any one rank sends (vs p2p: their sum); all ranks: the bytes every rank "
             "sends, forward + backward",
             f"{'C':>2s}  {'tree':9s}{'dtype':9s}{'method':10s}{'sent fwd':>10s}{'sent bwd':>10s}{'vs p2p':>8s}"
             f"{'all ranks':>11s}{'vs p2p':>8s}{'time':>10s}{'vs p2p':>8s}"]
    for r in d["rows"]:
        lines.append(f"{r['world']:>2d}  {r['tree']:9s}{r['dtype']:9s}{r['method']:10s}"
                     f"{r['sent_forward_max'] / MIB:>6.2f} MiB{r['sent_backward_max'] / MIB:>6.2f} MiB"
                     f"{r['bytes_over_p2p']:>7.2f}x{r['sent_total'] / MIB:>7.2f} MiB{r['total_over_p2p']:>7.2f}x"
                     f"{r['median_s'] * 1e3:>7.2f} ms{r['time_over_p2p']:>7.2f}x")
    seen = set()
    for r in d["rows"]:
        key = (r["world"], r["tree"])
        if key in seen:
            continue
        seen.add(key)
        ranges = ", ".join(f"[{s}, {e})" for s, e in r["ranges"])
        lines.append(f"# C={r['world']} {r['tree']}: ranges {ranges}; paths {r['paths']}; float64 check exact")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="context-parallel degrees C")
    p.add_argument("--shapes", nargs="+", choices=["branches", "path"], default=["branches", "path"])
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--branch-len", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--costs", choices=["model", "uniform"], default="model",
                   help="balance the ranges by bench_scale cp's model (model) or treelit's model-free costs")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--table", help="print the table of a result file and exit")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return None
    t0 = time.perf_counter()
    result = run(args)
    result["command"] = " ".join(["python", "benchmarks/bench_cp_exchange.py",
                                  *(argv if argv is not None else sys.argv[1:])])
    result["torch"] = torch.__version__
    result["seconds"] = time.perf_counter() - t0
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
