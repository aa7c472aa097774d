"""The longest branch that trains on a fixed per-rank memory budget, at C = 1, 2, 4, 8.

The memory planner's arithmetic (:class:`treelit.lightning.planner.MemoryPlanner`): a rank
holds ``budget`` tokens of a chain of partitions, a chain holds C x that, so the longest branch
a run of C context-parallel ranks accepts is ``C x budget``. Here, per C (gloo processes on
CPU, one thread each):

1. *calibration*: one SFT step on a branch of ``--calibrate`` x C tokens (after one unmeasured
   warm-up step of the same branch: a process's first step allocates one-time buffers); each
   rank's ``bytes_per_token`` by the planner's own rule (:meth:`MemoryPlanner.calibrate`, no
   safety margin): its activation peak less ``score_bytes`` x its queries x its received path
   keys and less ``head_bytes`` x the rows of the head's logits (its pass's targets up to the
   head's chunk, then the chunks' size), over its share of the chain; ``score_bytes``,
   ``head_bytes`` and the chunk from the model and the run (:meth:`MemoryPlanner.set_model_terms`);
2. *plan*: the planner's budget for ``--budget-mib`` (:meth:`MemoryPlanner.tokens_for`: the
   last rank's queries receive ``(C - 1) x budget`` keys, a pass has ``budget`` targets), the
   smallest over ranks, and the longest branch ``L = C x budget``;
3. *the step at L*: one SFT forward + backward of a single branch of L tokens through
   ``run_micro_batch`` (budget per rank, each pass split over the C ranks); per rank its
   activation peak (as in ``bench_cp_memory.py``: weights, gradients and optimizer state apart)
   against the planner's prediction for what the step's statistics say the rank held
   (:meth:`MemoryPlanner.predicted_peak`: its chain share, score pairs and pass targets), and
   the step's wall time; the ranks' summed gradients against one process on the same branch.

    python benchmarks/bench_cp_longest.py --json benchmarks/results/bench_cp_longest.json
    python benchmarks/bench_cp_longest.py --budget-mib 64 --json benchmarks/results/bench_cp_longest_64mib.json
    python benchmarks/bench_cp_longest.py --calibrate 256 --json benchmarks/results/bench_cp_longest_calibrate256.json
    python benchmarks/bench_cp_longest.py --model hybrid --json benchmarks/results/bench_cp_longest_hybrid.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cp_memory import _model, model_args, parse_or_table, report  # noqa: E402
from bench_scale import _existing, _free_port  # noqa: E402

MIB = 2**20


def _branch(L: int, args):
    import treelit

    g = torch.Generator().manual_seed(7)
    return treelit.TokenTree.from_branches([torch.randint(16, args.vocab, (L,), generator=g).tolist()]).to_batch()


def _step(model, obj, batch, budget, cp_group, args):
    """One SFT step: ``(activation peak, seconds, PartitionStats)`` of this rank (gradients in ``.grad``)."""
    from treelit.partition.engine import PartitionStats, run_micro_batch
    from treelit.utils.memory import LiveBytes

    stats = PartitionStats()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    live = LiveBytes()
    _existing(live, [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())])
    t0 = time.perf_counter()
    with live:
        run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=obj.norm_contribution(batch, "token-mean"),
                        budget_tokens=budget, attention=args.attention, cp_group=cp_group, stats=stats)
    return live.peak, time.perf_counter() - t0, stats


def _worker(rank: int, world: int, port: int, args, out_dir: str):
    import torch.distributed as dist

    from treelit.lightning.planner import MemoryPlanner
    from treelit.objectives import make_objective

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=3600))
    try:
        group = dist.group.WORLD if world > 1 else None
        model = _model(args.model, args)
        obj = make_objective("sft")
        planner = MemoryPlanner(margin=1.0)
        planner.set_model_terms(model, obj, None, world, torch.device("cpu"))  # score_bytes, head_bytes, chunk_rows
        L0 = args.calibrate * world
        batch0 = _branch(L0, args)
        _step(model, obj, batch0, args.calibrate, group, args)  # warm-up: a first step's one-time buffers apart
        peak0, _, st0 = _step(model, obj, batch0, args.calibrate, group, args)
        # the planner's rule: the peak less the scores' and the head's terms, over this rank's share of the chain
        planner.bytes_per_token = planner.calibrate(peak0, st0.max_chain_tokens, st0.cp_score_pairs,
                                                    st0.max_pass_targets)
        budget = torch.tensor([planner.tokens_for(args.budget_mib * MIB, world)])
        dist.all_reduce(budget, op=dist.ReduceOp.MIN)
        budget = int(budget)
        L = world * budget
        batch = _branch(L, args)
        peak, seconds, st = _step(model, obj, batch, budget, group, args)
        grads = [p.grad for p in model.parameters()]
        for g in grads:
            dist.all_reduce(g)
        m = {"rank": rank, "bytes_per_token": planner.bytes_per_token, "score_bytes": planner.score_bytes,
             "score_pairs": st.cp_score_pairs, "head_bytes": planner.head_bytes, "chunk_rows": planner.chunk_rows,
             "calibration_targets": st0.max_pass_targets, "targets": st.max_pass_targets,
             "head_rows": planner.head_rows(st.max_pass_targets), "chain_tokens": st.max_chain_tokens,
             "predicted": planner.predicted_peak(st.max_chain_tokens, st.cp_score_pairs, st.max_pass_targets),
             "peak": peak, "calibration_peak": peak0,
             # the model without the scores' and the head's terms: the calibration's bytes per token, all of it
             "predicted_per_token_only": peak0 / st0.max_chain_tokens * st.max_chain_tokens,
             "seconds": seconds}
        ranks = [None] * world
        dist.all_gather_object(ranks, m)
        if rank == 0:
            torch.save({"world": world, "budget_per_rank": budget, "longest": L, "ranks": ranks, "grads": grads},
                       os.path.join(out_dir, "row.pt"))
    finally:
        dist.destroy_process_group()


def _reference_diff(grads, L: int, args) -> float:
    """The largest relative gradient difference from one process on the same branch (no budget)."""
    from treelit.objectives import make_objective
    from treelit.partition.engine import run_micro_batch

    torch.set_num_threads(1)
    model = _model(args.model, args)
    batch = _branch(L, args)
    obj = make_objective("sft")
    run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=obj.norm_contribution(batch, "token-mean"),
                    attention=args.attention)
    return max(float((a - p.grad).norm() / p.grad.norm().clamp_min(1e-30)) for a, p in zip(grads, model.parameters()))


def run(args):
    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            mp.spawn(_worker, args=(world, _free_port(), args, tmp), nprocs=world, join=True)
            r = torch.load(os.path.join(tmp, "row.pt"), weights_only=False)
            grads = r.pop("grads")
            r["max_rel_grad_diff_vs_one"] = None if world == 1 else _reference_diff(grads, r["longest"], args)
            for x in r["ranks"]:
                x["measured_over_predicted"] = x["peak"] / x["predicted"]
                x["measured_over_per_token_only"] = x["peak"] / x["predicted_per_token_only"]
            r["worst_prediction_error"] = max(abs(x["measured_over_predicted"] - 1) for x in r["ranks"])
            r["worst_per_token_only_error"] = max(abs(x["measured_over_per_token_only"] - 1) for x in r["ranks"])
            r["seconds"] = max(x["seconds"] for x in r["ranks"])
            rows.append(r)
            print(f"C={world}: budget {r['budget_per_rank']} tokens/rank, longest branch {r['longest']}, step "
                  f"{r['seconds']:.1f}s, measured/predicted per rank "
                  f"{[round(x['measured_over_predicted'], 3) for x in r['ranks']]}, grads vs C=1 "
                  f"{r['max_rel_grad_diff_vs_one']}", flush=True)
    a = args
    return {"rows": rows, "budget_mib": a.budget_mib, "model": f"{a.model}: {a.layers} layers, dim {a.dim}, {a.heads} "
            f"heads ({a.kv_heads} kv), MLP {a.intermediate}, vocab {a.vocab}, float32", "attention": a.attention,
            "calibration_tokens_per_rank": a.calibrate, "threads_per_rank": 1}


def table(d) -> str:
    lines = [f"# {d['model']}; attention={d['attention']}; {d['budget_mib']} MiB of activations per rank; "
             f"planner calibrated on {d['calibration_tokens_per_rank']} tokens per rank",
             f"{'C':>2s}{'budget/rank':>12s}{'longest':>9s}{'step':>8s}{'grad diff':>11s}{'peak/predicted per rank':>28s}"]
    for r in d["rows"]:
        diff = r["max_rel_grad_diff_vs_one"]
        per = " ".join(f"{x['measured_over_predicted']:.2f}" for x in r["ranks"])
        lines.append(f"{r['world']:>2d}{r['budget_per_rank']:>12d}{r['longest']:>9d}{r['seconds']:>7.1f}s"
                     f"{('-' if diff is None else f'{diff:.1e}'):>11s}  {per}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--model", choices=["attention", "hybrid"], default="attention")
    p.add_argument("--budget-mib", type=float, default=48.0, help="activation memory per rank")
    p.add_argument("--calibrate", type=int, default=304, help="tokens per rank of the calibration step")
    model_args(p)
    args = parse_or_table(p, argv, table)
    if args is None:
        return
    args.prefix, args.branch_len = 0, 16384  # (the model's max_seq_len)
    report(run, table, args, "bench_cp_longest.py", argv)


if __name__ == "__main__":
    main()
