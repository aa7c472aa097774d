"""Per-rank memory under context parallelism, share by share, against one process.

One SFT forward + backward of one long tree (``--branches`` branches of ``--branch-len``
tokens under a ``--prefix``-token prefix) split over C gloo processes (``--worlds``; C = 1 is
the same code in one process), for an attention model and a hybrid (attention + Gated
DeltaNet + Mamba2), without partitioning (:func:`treelit.partition.context_parallel.cp_micro_batch`)
and with it (:func:`treelit.partition.engine.run_micro_batch` with ``cp_group``, ``ceil(L / C)``
tokens per rank for the longest branch L: chains of L tokens, every pass split over the C ranks).

Per rank, each share apart:

* **weights**, **gradients**, **optimizer** (AdamW: two moments per trained parameter): the
  bytes one rank holds when FSDP2 shards them over the C ranks (the full model's / C; the
  benchmark itself runs unsharded, with every gradient buffer allocated before the step);
* **activations**: the peak of the tensors the step allocates (``treelit.utils.memory``:
  parameters, buffers and the gradient buffers exist before it and are not counted, nor views
  of them), i.e. the step peak minus weights, gradients and optimizer state;
* **received K/V**: the bytes the rank received in the forward (path K/V and recurrent states
  and convolution inputs; a partitioned pass's all-reduced boundary states and each per-layer
  assembly of its ancestors' K/V).

The activation peak of rank r over one process's, and the target ``1.15 / C``; the ranks'
summed gradients against C = 1.

    python benchmarks/bench_cp_memory.py --json benchmarks/results/bench_cp_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import _existing, _free_port, _grad_diff_vs_one  # noqa: E402

MIB = 2**20


def _model(kind: str, args):
    import treelit

    torch.manual_seed(0)
    common = dict(vocab_size=args.vocab, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                  embed_dim=args.dim, intermediate_dim=args.intermediate,
                  max_seq_len=max(4096, args.prefix + args.branch_len))
    if kind == "attention":
        return treelit.build_decoder(family="qwen2", **common)
    types = (["gdn", "attention", "mamba2", "gdn"] * args.layers)[: args.layers]
    return treelit.build_model("hybrid_tiny", layer_types=types, **common,
                               recurrent={"gdn": {"head_dim": 32, "num_heads": 4, "num_v_heads": 4, "expand_v": 1.0,
                                                  "conv_size": 4},
                                          "mamba2": {"head_dim": 32, "state_size": 16, "n_groups": 1, "expand": 1,
                                                     "conv_kernel": 4, "mlp": True}})


def _tree(args):
    import treelit

    g = torch.Generator().manual_seed(100)
    prefix = torch.randint(16, args.vocab, (args.prefix,), generator=g).tolist()
    branches = [prefix + torch.randint(16, args.vocab, (args.branch_len,), generator=g).tolist()
                for _ in range(args.branches)]
    return treelit.TokenTree.from_branches(branches).to_batch()


def _step(model, batch, partitioned: bool, args):
    import torch.distributed as dist

    from treelit.objectives import make_objective
    from treelit.partition.context_parallel import TRAFFIC, cp_micro_batch
    from treelit.partition.engine import PartitionStats, run_micro_batch
    from treelit.partition.plan import plan_partitions
    from treelit.utils.memory import LiveBytes

    C = dist.get_world_size()
    obj = make_objective("sft")
    Z = obj.norm_contribution(batch, "token-mean")
    for p in model.parameters():  # gradient buffers exist before the region (FSDP2 shards them)
        p.grad = torch.zeros_like(p)
    live = LiveBytes()
    _existing(live, [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())])
    TRAFFIC.take()
    L = plan_partitions(batch, batch.num_tokens).longest_branch
    budget = -(-L // C)
    t0 = time.perf_counter()
    with live:
        if partitioned:
            stats = PartitionStats()
            run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, budget_tokens=budget,
                            attention=args.attention, stats=stats, cp_group=dist.group.WORLD if C > 1 else None)
            tokens = stats.token_forwards
        else:
            _, _, plan = cp_micro_batch(model, obj, batch, dist.group.WORLD, aggregation="token-mean", normalizer=Z,
                                        attention=args.attention)
            tokens = plan.size
    seconds = time.perf_counter() - t0
    forward = TRAFFIC.forward
    received = TRAFFIC.take()
    return {"rank": dist.get_rank(), "activations": live.peak, "received_forward": forward, "received": received,
            "tokens": tokens, "seconds": seconds, "budget_per_rank": budget if partitioned else None}


def _worker(rank: int, world: int, port: int, args, kind: str, partitioned: bool, out_dir: str):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800))
    try:
        model = _model(kind, args)
        batch = _tree(args)
        m = _step(model, batch, partitioned, args)
        ranks = [None] * world
        dist.all_gather_object(ranks, m)
        diff = _grad_diff_vs_one(model, rank, world, os.path.join(out_dir, f"grads_{kind}_{int(partitioned)}.pt"))
        if rank == 0:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            torch.save({"kind": kind, "partitioned": partitioned, "world": world, "ranks": ranks,
                        "max_rel_grad_diff_vs_one": diff, "tree_tokens": batch.num_tokens,
                        "weights": weights / world, "gradients": trained / world, "optimizer": 2 * trained / world},
                       os.path.join(out_dir, "row.pt"))
    finally:
        dist.destroy_process_group()


def run(args):
    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            for partitioned in args.partitioned:
                for world in sorted(set(args.worlds) | {1}):  # C = 1 first: the reference
                    mp.spawn(_worker, args=(world, _free_port(), args, kind, partitioned, tmp), nprocs=world,
                             join=True)
                    r = torch.load(os.path.join(tmp, "row.pt"), weights_only=False)
                    rows.append(r)
                    one = next(x for x in rows if x["kind"] == kind and x["partitioned"] == partitioned
                               and x["world"] == 1)["ranks"][0]["activations"]
                    r["activations_max"] = max(x["activations"] for x in r["ranks"])
                    r["activations_max_over_one"] = r["activations_max"] / one
                    r["target_over_one"] = 1.15 / world
                    print(f"{kind:9s} {'partitioned' if partitioned else 'whole row  '} C={world}: activations per "
                          f"rank {[round(x['activations'] / MIB) for x in r['ranks']]} MiB, max/one "
                          f"{r['activations_max_over_one']:.3f} (target {r['target_over_one']:.3f}); received K/V "
                          f"{[round(x['received_forward'] / MIB, 1) for x in r['ranks']]} MiB; grads vs C=1 "
                          f"{r['max_rel_grad_diff_vs_one']}; {max(x['seconds'] for x in r['ranks']):.1f}s", flush=True)
    a = args
    return {"rows": rows, "tree": f"{a.branches} branches of {a.branch_len} tokens under a {a.prefix}-token prefix",
            "model": f"{a.layers} layers, dim {a.dim}, {a.heads} heads ({a.kv_heads} kv), MLP {a.intermediate}, "
                     f"vocab {a.vocab}, float32", "attention": a.attention, "threads_per_rank": 1}


def table(d) -> str:
    lines = [f"# {d['tree']}; {d['model']}; attention={d['attention']}; MiB per rank (weights, gradients, "
             "optimizer: FSDP2 shards over the C ranks; activations: the most loaded rank's step peak minus those)",
             f"{'model':10s}{'partitioned':>12s}{'C':>3s}{'weights':>9s}{'grads':>7s}{'AdamW':>7s}{'activations':>13s}"
             f"{'vs C=1':>8s}{'1.15/C':>8s}{'recv K/V':>10s}{'grad diff':>11s}"]
    for r in d["rows"]:
        recv = max(x["received_forward"] for x in r["ranks"])
        diff = r["max_rel_grad_diff_vs_one"]
        lines.append(f"{r['kind']:10s}{('yes' if r['partitioned'] else 'no'):>12s}{r['world']:>3d}"
                     f"{r['weights'] / MIB:>9.1f}{r['gradients'] / MIB:>7.1f}{r['optimizer'] / MIB:>7.1f}"
                     f"{r['activations_max'] / MIB:>13.1f}{r['activations_max_over_one']:>8.3f}"
                     f"{r['target_over_one']:>8.3f}{recv / MIB:>10.1f}{('-' if diff is None else f'{diff:.1e}'):>11s}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--models", nargs="+", choices=["attention", "hybrid"], default=["attention", "hybrid"])
    p.add_argument("--partitioned", type=lambda v: v == "yes", nargs="+", default=[False, True],
                   help="yes, no or both")
    model_args(p)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--branch-len", type=int, default=512)
    args = parse_or_table(p, argv, table)
    if args is not None:
        report(run, table, args, "bench_cp_memory.py", argv)


def model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape and attention backend (this file's, bench_cp_longest's and
    bench_cp_recurrent's)."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--attention", default="segment")


def parse_or_table(p: argparse.ArgumentParser, argv, table):
    """``--json`` and ``--table`` added, ``argv`` parsed; with ``--table FILE``, that results
    file's table printed and None returned."""
    p.add_argument("--json")
    p.add_argument("--table", help="print the table of a results file and exit")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return None
    return args


def report(run, table, args, script: str, argv) -> None:
    """Run ``run(args)``, add the command, torch's version and the seconds taken, print
    ``table`` of the result and write it to ``args.json`` (this file's and bench_cp_longest's)."""
    t0 = time.perf_counter()
    result = run(args)
    result["command"] = " ".join(["python", f"benchmarks/{script}", *(argv if argv is not None else sys.argv[1:])])
    result["torch"] = torch.__version__
    result["seconds"] = time.perf_counter() - t0
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
