"""Context parallelism on the hybrid: the step time with sends left in flight against the lock-step hand-off.

Under context parallelism a recurrent layer's states travel rank to rank: rank r receives its
range's initial states from earlier ranks, runs its scan and sends later ranks theirs (and
attention's path K/V and the convolution inputs travel from earlier ranks to later ones).
With gloo a send completes only once the receiver has posted its receive. Waiting for every
send where it is posted (``treelit.partition.p2p.BLOCKING = True``, *before*) ties each rank to
the next: the ranks run each layer's exchange in lock-step, one scan after another. Leaving the
sends in flight and waiting for them at the end of the pass (``BLOCKING = False``, the default,
*after*) lets a rank run ahead of the ranks it sends to; it still waits for what it receives.

One SFT forward + backward of the hybrid of ``bench_cp_memory.py`` (attention + Gated DeltaNet
+ Mamba2, float32) on one tree (``--branches`` branches of ``--branch-len`` tokens under a
``--prefix``-token prefix), on C gloo processes of one thread each (``--worlds``; C = 1 is the
same code in one process), without partitioning (``cp_micro_batch``) and with it
(``run_micro_batch`` with ``cp_group``, ``ceil(L / C)`` tokens per rank for the longest branch
L). Both hand-offs run in the same processes, taking turns (``--warmup`` steps of each, then
``--repeats`` rounds, each round one step of each in alternating order). Per hand-off:

* the slowest rank's step time, median over the rounds;
* after / before, of those medians, and per round (the two steps of a round share the
  machine's load at that moment: median, lowest and highest);
* the seconds a rank spent waiting in the exchanges during its step (receives, and sends where
  they are waited on), by kind: path rows, recurrent states, and the drain of the sends still in
  flight at a pass's end; per kind the longest of any rank, and each rank's total, medians over
  the rounds;
* whether the two hand-offs gave bitwise the same gradients.

    python benchmarks/bench_cp_recurrent.py --repeats 15 --json benchmarks/results/bench_cp_recurrent.json
    python benchmarks/bench_cp_recurrent.py --table benchmarks/results/bench_cp_recurrent.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cp_memory import _model, _tree, model_args, parse_or_table, report  # noqa: E402
from bench_scale import _free_port  # noqa: E402

MODES = {"before": True, "after": False}  # p2p.BLOCKING per hand-off


def _step(model, batch, partitioned: bool, args):
    """One SFT step of this rank: (seconds, wait seconds by kind); gradients in ``.grad``."""
    import torch.distributed as dist

    from treelit.objectives import make_objective
    from treelit.partition import p2p
    from treelit.partition.context_parallel import cp_micro_batch
    from treelit.partition.engine import run_micro_batch
    from treelit.partition.plan import plan_partitions

    C = dist.get_world_size()
    obj = make_objective("sft")
    Z = obj.norm_contribution(batch, "token-mean")
    model.zero_grad(set_to_none=True)
    budget = -(-plan_partitions(batch, batch.num_tokens).longest_branch // C)
    dist.barrier()
    p2p.WAITS.take()
    t0 = time.perf_counter()
    if partitioned:
        run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, budget_tokens=budget,
                        attention=args.attention, cp_group=dist.group.WORLD if C > 1 else None)
    else:
        cp_micro_batch(model, obj, batch, dist.group.WORLD, aggregation="token-mean", normalizer=Z,
                       attention=args.attention)
    return time.perf_counter() - t0, p2p.WAITS.take()


def _worker(rank: int, world: int, port: int, args, partitioned: bool, out: str):
    import torch.distributed as dist

    from treelit.partition import p2p

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    try:
        model = _model("hybrid", args)
        batch = _tree(args)
        grads, times = {}, {m: [] for m in MODES}
        for r in range(args.warmup + args.repeats):
            for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                p2p.BLOCKING = MODES[mode]
                seconds, waits = _step(model, batch, partitioned, args)
                if r == 0:
                    grads[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                if r >= args.warmup:
                    times[mode].append((seconds, waits))
        p2p.BLOCKING = False
        same = all(torch.equal(a, b) for a, b in zip(grads["before"], grads["after"]))
        ranks = [None] * world
        dist.all_gather_object(ranks, {"times": times, "same": same})
        if rank == 0:
            torch.save({"partitioned": partitioned, "world": world, "ranks": ranks, "tree_tokens": batch.num_tokens},
                       out)
    finally:
        dist.destroy_process_group()


def _summary(r) -> dict:
    """Per hand-off: the slowest rank's step seconds and, per kind, the longest wait of a rank
    (medians over rounds)."""
    out = {}
    for mode in MODES:
        rounds = range(len(r["ranks"][0]["times"][mode]))
        slow = [max(x["times"][mode][i][0] for x in r["ranks"]) for i in rounds]
        kinds = sorted({k for x in r["ranks"] for _, w in x["times"][mode] for k in w})
        waits = {k: statistics.median(max(x["times"][mode][i][1].get(k, 0.0) for x in r["ranks"]) for i in rounds)
                 for k in kinds}
        per_rank = [statistics.median(sum(x["times"][mode][i][1].values()) for i in rounds) for x in r["ranks"]]
        out[mode] = {"seconds": statistics.median(slow), "rounds": slow, "waits": waits, "waits_per_rank": per_rank}
    out["after_over_before"] = out["after"]["seconds"] / out["before"]["seconds"]
    paired = [a / b for a, b in zip(out["after"]["rounds"], out["before"]["rounds"])]  # (the same round's load)
    out["paired"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}
    out["same_gradients"] = all(x["same"] for x in r["ranks"])
    return out


def run(args):
    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for partitioned in args.partitioned:
            for world in args.worlds:
                out = os.path.join(tmp, "row.pt")
                mp.spawn(_worker, args=(world, _free_port(), args, partitioned, out), nprocs=world, join=True)
                r = torch.load(out, weights_only=False)
                r.update(_summary(r))
                del r["ranks"]
                rows.append(r)
                print(f"{'partitioned' if partitioned else 'whole row  '} C={world}: before "
                      f"{r['before']['seconds']:.2f}s, after {r['after']['seconds']:.2f}s, "
                      f"after/before {r['after_over_before']:.3f}; waits before {r['before']['waits']}, "
                      f"after {r['after']['waits']}; same gradients {r['same_gradients']}", flush=True)
    a = args
    return {"rows": rows, "tree": f"{a.branches} branches of {a.branch_len} tokens under a {a.prefix}-token prefix",
            "model": f"hybrid (gdn, attention, mamba2, gdn), {a.layers} layers, dim {a.dim}, {a.heads} heads "
                     f"({a.kv_heads} kv), MLP {a.intermediate}, vocab {a.vocab}, float32",
            "attention": a.attention, "threads_per_rank": 1, "cores": os.cpu_count(),
            "warmup": a.warmup, "repeats": a.repeats}


def table(d) -> str:
    lines = [f"# {d['tree']}; {d['model']}; attention={d['attention']}; {d['threads_per_rank']} thread per rank on "
             f"{d['cores']} cores; seconds per SFT step (slowest rank, median of {d['repeats']} rounds); waits: "
             "the longest wait of a rank in the exchanges, seconds (rows/states/drain); per round: after/before of "
             "each round's two steps, median [lowest-highest]",
             f"{'partitioned':>11s}{'C':>3s}{'before':>9s}{'after':>9s}{'after/before':>14s}{'per round':>19s}"
             f"{'waits before':>17s}{'waits after':>17s}{'same grads':>12s}"]

    def waits(w):
        return "/".join(f"{w.get(k, 0.0):.2f}" for k in ("rows", "states", "drain"))

    def paired(p):
        return f"{p['median']:.3f} [{p['min']:.2f}-{p['max']:.2f}]"

    for r in d["rows"]:
        lines.append(f"{('yes' if r['partitioned'] else 'no'):>11s}{r['world']:>3d}{r['before']['seconds']:>9.2f}"
                     f"{r['after']['seconds']:>9.2f}{r['after_over_before']:>14.3f}{paired(r['paired']):>19s}"
                     f"{waits(r['before']['waits']):>17s}{waits(r['after']['waits']):>17s}"
                     f"{('yes' if r['same_gradients'] else 'NO'):>12s}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--partitioned", type=lambda v: v == "yes", nargs="+", default=[False, True],
                   help="yes, no or both")
    model_args(p)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--branch-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    args = parse_or_table(p, argv, table)
    if args is None:
        return
    report(run, table, args, "bench_cp_recurrent.py", argv)


if __name__ == "__main__":
    main()
