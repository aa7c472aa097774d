"""Tree attention alone: cost model beside measured time and memory, 8k-32k tree tokens.

For each tree it prints the attention work (query x key pairs per head and layer) of
three ways to compute it:

* ``dense``   - a packed row with an N x N ancestor mask: N^2;
* ``segment`` - treelit's segment backend: sum over segments of length x path (plus
  the causal triangles, and padding of batched short chains);
* ``causal``  - every branch on its own (the linearized baseline): sum of L(L+1)/2.

and then times one attention layer forward+backward (random q/k/v, GQA) with
``sdpa_dense`` and ``segment`` in the same process, and measures each one's peak
tensor memory.

    python benchmarks/bench_attention.py --json benchmarks/results/bench_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from agentic import make_case  # noqa: E402
from memory import peak_memory  # noqa: E402
from treelit.attention import get_backend  # noqa: E402
from treelit.models.context import TreeLayout  # noqa: E402

CASES = {
    "fanout_8k": ("wide_fanout", dict(turns=4, k=8)),
    "grpo20_17k": ("grpo_group", dict(G=20)),
    "fanout_16k": ("wide_fanout", dict(turns=5, k=16)),
    "fanout_32k": ("wide_fanout", dict(turns=9, k=20)),
}


def run(name, args):
    gen, shape = CASES[name]
    case = make_case(gen, **shape)
    batch = treelit.TokenTree.from_branches(case.branches).to_batch()
    N = batch.num_tokens
    layout = TreeLayout(batch, torch.arange(N), batch.subtree_end, 0)
    seg = get_backend("segment")
    t0 = time.perf_counter()
    plan = seg.plan(layout)
    plan_s = time.perf_counter() - t0
    causal = sum(len(b) * (len(b) + 1) // 2 for b in case.branches)
    row = {
        "name": name,
        "tree_tokens": N,
        "flat_tokens": batch.flat_tokens,
        "segments": batch.num_segments,
        "chains": plan.chains,
        "pairs_dense": N * N,
        "pairs_segment": plan.cost,
        "pairs_visible": plan.exact_cost,
        "pairs_causal_branches": causal,
        "segment_plan_s": plan_s,
    }
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, H, N, D, generator=g, requires_grad=True)
    k = torch.randn(1, Hkv, N, D, generator=g, requires_grad=True)
    v = torch.randn(1, Hkv, N, D, generator=g, requires_grad=True)
    for bname in ["segment", "sdpa_dense"]:
        backend = get_backend(bname)

        def step():
            out = backend(q, k, v, backend.plan(layout))  # planning included
            out.sum().backward()
            q.grad = k.grad = v.grad = None

        peak, _ = peak_memory(step)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        row[f"time_{bname}_s"] = statistics.median(times)
        row[f"peak_mem_{bname}_bytes"] = peak
        print(f"  {name} {bname}: {row[f'time_{bname}_s']:.2f}s, peak {peak / 2**20:.0f} MiB", flush=True)
    row["speedup_segment_vs_dense"] = row["time_sdpa_dense_s"] / row["time_segment_s"]
    row["mem_saved_bytes"] = row["peak_mem_sdpa_dense_bytes"] - row["peak_mem_segment_bytes"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    args = p.parse_args(argv)
    rows = [run(n, args) for n in args.cases.split(",") if n]
    print(
        f"{'case':<12}{'tree':>7}{'segs':>6}{'dense pairs':>13}{'segment':>12}{'causal/br':>12}"
        f"{'t_dense':>9}{'t_segment':>10}{'speedup':>9}{'mem_dense':>11}{'mem_seg':>9}"
    )
    for r in rows:
        print(
            f"{r['name']:<12}{r['tree_tokens']:>7}{r['segments']:>6}{r['pairs_dense'] / 1e6:>12.1f}M"
            f"{r['pairs_segment'] / 1e6:>11.1f}M{r['pairs_causal_branches'] / 1e6:>11.1f}M"
            f"{r['time_sdpa_dense_s']:>8.2f}s{r['time_segment_s']:>9.2f}s{r['speedup_segment_vs_dense']:>8.1f}x"
            f"{r['peak_mem_sdpa_dense_bytes'] / 2**20:>10.0f}M{r['peak_mem_segment_bytes'] / 2**20:>8.0f}M"
        )
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
           "command": " ".join(["python", *sys.argv])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "cases": rows}, f, indent=2)


if __name__ == "__main__":
    main()
