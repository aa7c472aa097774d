"""Partitioned training memory: a tree much larger than one branch, trained with the
partition budget set to its longest branch.

Measures, in one process, the peak tensor memory of one training step (forward, loss,
backward) for (a) the longest branch alone, (b) the whole tree unpartitioned, (c) the
whole tree with ``partition=redundancy_free`` and ``budget_tokens`` = the longest
branch; checks that (c) equals (b) on loss and every gradient and that every token was
forwarded exactly once.

    python benchmarks/bench_partition.py --json benchmarks/results/bench_partition.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from treelit.partition import PartitionStats, tree_backward  # noqa: E402
from treelit.utils.memory import peak_memory  # noqa: E402


def grads(model):
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return g


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--branches", type=int, default=12)
    p.add_argument("--branch-len", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default="qwen2", help="qwen2 (attention) or hybrid")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(16, 32768, (args.prefix,), generator=g).tolist()
    branches = [prefix + torch.randint(16, 32768, (args.branch_len,), generator=g).tolist() for _ in range(args.branches)]
    tree = treelit.TokenTree.from_branches(branches)
    batch = tree.to_batch()
    longest = max(map(len, branches))
    torch.manual_seed(0)
    if args.model == "hybrid":
        model = treelit.build_model("hybrid_tiny", vocab_size=32768, embed_dim=args.dim, intermediate_dim=3 * args.dim,
                                    max_seq_len=8192, num_heads=4, num_kv_heads=2)
    else:
        model = treelit.build_decoder(family="qwen2", vocab_size=32768, num_layers=args.layers, num_heads=4,
                                      num_kv_heads=2, embed_dim=args.dim, intermediate_dim=3 * args.dim, max_seq_len=8192)
    one = treelit.TokenTree.from_branches([branches[0]]).to_batch()
    Z = treelit.global_normalizer([batch], "token-mean")

    def step(b, budget=None, normalizer=None, stats=None):
        return tree_backward(model, b, "token-mean", "redundancy_free", budget, normalizer=normalizer, stats=stats)

    t0 = time.perf_counter()
    mem_branch, _ = peak_memory(lambda: step(one))
    model.zero_grad(set_to_none=True)
    mem_full, loss_full = peak_memory(lambda: step(batch, normalizer=Z))
    g_full = grads(model)
    stats = PartitionStats()
    mem_part, loss_part = peak_memory(lambda: step(batch, budget=longest, normalizer=Z, stats=stats))
    g_part = grads(model)
    worst = max(((g_part[k] - g_full[k]).norm() / g_full[k].norm().clamp_min(1e-30)).item() for k in g_full)
    row = {
        "model": args.model,
        "tree_tokens": batch.num_tokens,
        "flat_tokens": batch.flat_tokens,
        "longest_branch": longest,
        "budget_tokens": longest,
        "partitions": stats.partitions,
        "token_forwards": stats.token_forwards,
        "peak_mem_branch_bytes": mem_branch,
        "peak_mem_unpartitioned_bytes": mem_full,
        "peak_mem_partitioned_bytes": mem_part,
        "unpartitioned_over_branch": mem_full / mem_branch,
        "partitioned_over_branch": mem_part / mem_branch,
        "loss_rel_diff": abs(loss_part - loss_full) / abs(loss_full),
        "max_rel_grad_diff": worst,
        "seconds": time.perf_counter() - t0,
        "command": " ".join(["python", *sys.argv]),
    }
    assert stats.token_forwards == batch.num_tokens
    mib = 2**20
    print(f"tree: {batch.num_tokens} tokens ({args.branches} branches of {longest}); budget {longest} -> {stats.partitions} partitions, "
          f"{stats.token_forwards} token-forwards")
    print(f"peak memory: branch alone {mem_branch / mib:.0f} MiB | unpartitioned {mem_full / mib:.0f} MiB "
          f"({row['unpartitioned_over_branch']:.1f}x) | partitioned {mem_part / mib:.0f} MiB ({row['partitioned_over_branch']:.2f}x)")
    print(f"exactness: loss rel diff {row['loss_rel_diff']:.1e}, max rel grad diff {worst:.1e} (float32)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
