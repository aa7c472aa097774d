"""Tree mode vs the linearized baseline: one forward+backward step, same process, same model.

For each agentic-shaped case this times a full training step (forward, loss, backward)
in tree mode and in linearized per-branch mode (warm-up, then several repetitions,
median), measures each mode's peak tensor memory, and checks that both modes give the
same gradients. Speed is reported as a ratio, because absolute times on shared machines
are noise.

    python benchmarks/bench_step.py --json results.json          # full suite (~8k tree tokens per case)
    python benchmarks/bench_step.py --quick --json quick.json    # small trees, a minute or two
    python benchmarks/bench_step.py --cases tau_bench --json tau.json   # real tau-bench trajectories
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from agentic import SUITE, make_case  # noqa: E402
from memory import peak_memory  # noqa: E402


def bench_model(args, vocab=None) -> treelit.TreeDecoder:
    torch.manual_seed(0)
    return treelit.build_decoder(
        family="qwen2",
        vocab_size=vocab or args.vocab,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        embed_dim=args.dim,
        intermediate_dim=3 * args.dim,
        max_seq_len=32768,
    )


def grads_of(model) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


HYBRID_SUITE = ["hybrid/grpo_group", "hybrid/multi_turn", "hybrid/wide_fanout"]
REAL_CASES = {"tau_bench": "real tau-bench airline trajectories, task 0 (4 trials, first 6 calls each), Qwen BPE"}


def hybrid_model(args) -> treelit.TreeDecoder:
    """Gated DeltaNet, attention, Mamba2 and Gated DeltaNet layers (Qwen3-Next-like mix)."""
    torch.manual_seed(0)
    return treelit.build_model(
        "hybrid_tiny", vocab_size=args.vocab, embed_dim=args.dim, num_heads=args.heads, num_kv_heads=args.kv_heads,
        intermediate_dim=3 * args.dim, max_seq_len=32768,
        recurrent={"gdn": {"head_dim": 16, "num_heads": 2, "num_v_heads": 4, "expand_v": 1.0},
                   "mamba2": {"head_dim": 16, "state_size": 16, "n_groups": 1, "expand": 2, "mlp": True}},
    )


HYBRID_SCALE = 0.2  # smaller trees keep the whole suite within a few minutes on 2 CPU cores


def load_case(name: str, args):
    """A synthetic agentic case; ``hybrid/<case>`` on the hybrid model (at a fifth of the size);
    or the real-data ``tau_bench`` case (natural per-call masks, a model with the Qwen vocabulary).
    Returns ``(case, model key)``."""
    if name == "tau_bench":
        from real_data import QWEN_VOCAB, tau_bench_case

        return tau_bench_case(0, max_calls=max(2, round(6 * args.scale))), ("attention", QWEN_VOCAB)
    if name.startswith("hybrid/"):
        case = make_case(name.split("/", 1)[1], seed=args.seed, vocab=args.vocab, scale=args.scale * HYBRID_SCALE,
                         mask_mode=args.mask)
        case.name = name
        return case, ("hybrid", args.vocab)
    return make_case(name, seed=args.seed, vocab=args.vocab, scale=args.scale, mask_mode=args.mask), ("attention", args.vocab)


def run_case(name: str, models: Dict, args) -> Dict:
    case, key = load_case(name, args)
    if key not in models:
        models[key] = hybrid_model(args) if key[0] == "hybrid" else bench_model(args, key[1])
    model = models[key]
    t0 = time.perf_counter()
    tree = treelit.TokenTree.from_branches(case.branches, case.masks)
    batch = tree.to_batch()
    build_s = time.perf_counter() - t0
    stats = tree.stats()

    def tree_step():
        loss = treelit.tree_loss(model, batch, args.aggregation, attention=args.attention)
        loss.backward()
        return float(loss.detach())

    def linear_step():
        return treelit.linear_backward(
            model, case.branches, case.masks, aggregation=args.aggregation, max_tokens=args.linear_tokens
        )

    def dense_step():
        loss = treelit.tree_loss(model, batch, args.aggregation, attention="sdpa_dense")
        loss.backward()
        return float(loss.detach())

    modes = {"tree": tree_step, "linear": linear_step}
    if args.compare_dense and batch.num_segments >= 32:
        modes["tree_dense"] = dense_step
    result: Dict = {"name": name, **stats, "tree_build_s": build_s, "vocab": model.vocab_size,
                    "targets": int(batch.num_targets)}
    grads, times = {}, {m: [] for m in modes}
    for mode, step in modes.items():  # warm-up doubles as the memory and gradient pass
        model.zero_grad(set_to_none=True)
        peak, loss = peak_memory(step) if args.memory and mode != "tree_dense" else (None, step())
        grads[mode] = grads_of(model)
        result[f"loss_{mode}"] = loss
        result[f"peak_mem_{mode}_bytes"] = peak
    for _ in range(args.reps):
        for mode, step in modes.items():  # interleaved, so drifts in machine load hit both
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    t_tree, t_lin = statistics.median(times["tree"]), statistics.median(times["linear"])
    result["segments"] = stats["segments"]
    result.update(
        time_tree_s=t_tree,
        time_linear_s=t_lin,
        measured_speedup=t_lin / t_tree,
        efficiency=(t_lin / t_tree) / stats["ideal_speedup"],
        max_rel_grad_diff=max_rel_diff(grads["tree"], grads["linear"]),
        attention=args.attention,
    )
    if "tree_dense" in times:
        result["time_tree_dense_s"] = statistics.median(times["tree_dense"])
        result["auto_vs_dense_speedup"] = result["time_tree_dense_s"] / t_tree
    return result


def fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}M"


def print_table(rows: List[Dict]) -> None:
    head = (
        f"{'case':<17}{'flat':>7}{'tree':>7}{'POR':>6}{'ideal':>7}{'measured':>9}{'eff':>6}"
        f"{'t_tree':>8}{'t_lin':>8}{'mem_tree':>9}{'mem_lin':>9}{'grad_diff':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['name']:<17}{r['flat_tokens']:>7}{r['tree_tokens']:>7}{r['por']:>6.2f}{r['ideal_speedup']:>6.2f}x"
            f"{r['measured_speedup']:>8.2f}x{r['efficiency']:>6.2f}{r['time_tree_s']:>7.2f}s{r['time_linear_s']:>7.2f}s"
            f"{fmt_bytes(r['peak_mem_tree_bytes']):>9}{fmt_bytes(r['peak_mem_linear_bytes']):>9}"
            f"{r['max_rel_grad_diff']:>10.1e}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write results here")
    p.add_argument("--quick", action="store_true", help="small trees (scale 0.25), one repetition")
    p.add_argument(
        "--cases", default=",".join(SUITE + HYBRID_SUITE),
        help="comma-separated case names (also: tau_bench, the real-data case; agent_group)",
    )
    p.add_argument("--scale", type=float, default=None, help="size multiplier for the cases (default 1)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per mode (default 3; quick: 1)")
    p.add_argument("--mask", choices=["all", "assistant"], default="all", help="loss mask of each branch")
    p.add_argument("--aggregation", default="token-mean", choices=treelit.AGGREGATIONS)
    p.add_argument("--attention", default="auto", help="tree attention backend")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--linear-tokens", type=int, default=8192, help="padded tokens per linear micro-batch")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory pass")
    p.add_argument(
        "--no-compare-dense", dest="compare_dense", action="store_false",
        help="skip timing the sdpa_dense tree step on trees with >= 32 segments",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.scale = args.scale if args.scale is not None else (0.25 if args.quick else 1.0)
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    models: Dict = {}
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "model": (
            f"qwen2-style, {args.layers} layers, dim {args.dim}, {args.heads} heads "
            f"({args.kv_heads} kv), vocab {args.vocab}, float32"
        ),
        "mask": args.mask,
        "aggregation": args.aggregation,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    print(f"# {env['model']}; torch {env['torch']}, {env['threads']} threads; mask={args.mask}; attention={args.attention}")
    rows = []
    for name in [c for c in args.cases.split(",") if c]:
        rows.append(run_case(name, models, args))
        print(f"  {name}: {rows[-1]['measured_speedup']:.2f}x (ideal {rows[-1]['ideal_speedup']:.2f}x)", flush=True)
    print_table(rows)
    for r in rows:
        if "time_tree_dense_s" in r:
            print(
                f"{r['name']}: {r['segments']} segments; tree step with {args.attention} {r['time_tree_s']:.2f}s "
                f"vs sdpa_dense {r['time_tree_dense_s']:.2f}s ({r['auto_vs_dense_speedup']:.2f}x)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "cases": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
