"""Model paths on the step-benchmark cases: native decoder, transformers adapter, Qwen3-MoE.

For each agentic case of :mod:`bench_step` (same trees, same scale) this times one training
step (forward, loss, backward; this process's CPU time, one thread, interleaved repetitions,
median):

* ``native``  - treelit's tree step on the realistic dense model (:mod:`bench_models`);
* ``adapter`` - the same weights through ``treelit.load_hf_model`` (transformers' modelling
  code, treelit's attention backends and chunked head);
* ``hf``      - the same weights in plain ``transformers``, branch by branch in padded
  micro-batches (:mod:`hf_peer`, the loop users run today);
* ``moe`` / ``moe_linear`` - a Qwen3-MoE model of the same width (8 experts, top-2, each
  expert half the dense MLP, so the routed MLP work per token equals the dense one; router
  loss on, ``micro_batch``) in tree mode and per branch (treelit's per-branch path).

It reports the adapter's time over the native one (target <= 1.3x), both speedups over the
transformers loop, and the MoE case's speedup over its per-branch path against its
compute-weighted ideal (the active expert parameters count per token).

``--hybrid`` times the hybrid transformers families instead (:mod:`hybrid_families`): a
Qwen3.5-shaped and a Nemotron-H-shaped model through the adapter (tree step and treelit's
per-branch path) and in plain transformers on its torch kernels, branch by branch, with the
step split per layer kind (attention, Gated DeltaNet / Mamba2, MLP, head).

    python benchmarks/bench_families.py --json benchmarks/results/bench_families.json
    python benchmarks/bench_families.py --hybrid --json benchmarks/results/bench_families_hybrid.json
    python benchmarks/bench_families.py --hybrid --precision    # float32 gradients of both sides vs float64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from bench_models import PRESETS, attention_model, compute_weighted_ideal, cost_model  # noqa: E402
from bench_step import BASE_LINEAR_TOKENS, load_case  # noqa: E402
from hf_peer import grad_diff, load_peer, peer_step  # noqa: E402
from hybrid_families import HYBRID_CASES, SHAPES  # noqa: E402
from hybrid_families import main as hybrid_main  # noqa: E402
from hybrid_families import precision as hybrid_precision  # noqa: E402

CASES = ["grpo_group", "multi_turn", "tool_fanout", "wide_fanout"]


def moe_model(dim, layers, heads, kv_heads, intermediate, vocab, max_seq_len=32768):
    torch.manual_seed(0)
    model = treelit.build_model("qwen3_moe_tiny", vocab_size=vocab, embed_dim=dim, num_layers=layers, num_heads=heads,
                                num_kv_heads=kv_heads, head_dim=dim // heads, intermediate_dim=intermediate,
                                max_seq_len=max_seq_len, tie_word_embeddings=False,
                                moe={"num_experts": 8, "top_k": 2, "intermediate_dim": intermediate // 2,
                                     "norm_topk_prob": True, "router_aux_loss_coef": 0.001})
    return model


def moe_cost(model) -> Dict[str, float]:
    """As :func:`bench_models.cost_model`, counting the experts a token is routed to (top-k of E)."""
    c = model.config
    k, E = c.moe["top_k"], c.moe["num_experts"]
    trunk = 0.0
    for n, p in model.named_parameters():
        if not n.startswith("layers.") or p.dim() < 2:
            continue
        trunk += p.numel() * (k / E if n.endswith((".w1", ".w2", ".w3")) else 1.0)
    return {"per_token": 3 * 2.0 * trunk, "per_pair": 3 * 4.0 * c.num_heads * c.head_dim * c.num_layers,
            "per_target": 3 * 2.0 * c.embed_dim * c.vocab_size, "trunk_params": trunk,
            "head_over_trunk": c.embed_dim * c.vocab_size / trunk}


def timed(modes, reps: int) -> Dict[str, float]:
    times = {m: [] for m in modes}
    for _, step in modes.values():  # warm-up
        step()
    for _ in range(reps):
        for mode, (model, step) in modes.items():  # interleaved: drifts in machine load hit every mode
            model.zero_grad(set_to_none=True)
            t0 = time.process_time()
            step()
            times[mode].append(time.process_time() - t0)
            model.zero_grad(set_to_none=True)
    return {m: statistics.median(t) for m, t in times.items()}


def run_case(name, models, args) -> Dict:
    case, _ = load_case(name, args, args.model_cfg["vocab"])
    batch = treelit.TokenTree.from_branches(case.branches, case.masks).to_batch()
    micro = max(256, round(BASE_LINEAR_TOKENS * args.scale))
    native, adapter, peer, moe = models["native"], models["adapter"], models["peer"], models["moe"]

    def tree(m):
        def step():
            loss = treelit.tree_loss(m, batch)
            loss.backward()
        return step

    modes = {
        "native": (native, tree(native)),
        "adapter": (adapter, tree(adapter)),
        "hf": (peer, lambda: peer_step(peer, case.branches, case.masks, micro)),
        "moe": (moe, tree(moe)),
        "moe_linear": (moe, lambda: treelit.linear_loss(moe, case.branches, case.masks, max_tokens=micro).backward()),
    }
    # the adapter computes the native model's loss and gradients (same weights)
    native.zero_grad(set_to_none=True)
    adapter.zero_grad(set_to_none=True)
    a = treelit.tree_loss(native, batch)
    a.backward()
    b = treelit.tree_loss(adapter, batch)
    b.backward()
    adapter_grad_diff = grad_diff(native, {n: p.grad for n, p in native.named_parameters()},
                                  {n[3:]: p.grad for n, p in adapter.named_parameters() if p.grad is not None})
    med = timed(modes, args.reps)
    stats = treelit.TokenTree.from_branches(case.branches, case.masks).stats()
    ideal_moe = compute_weighted_ideal(moe_cost(moe), case.branches, case.masks, batch)
    return {
        "name": name, "flat_tokens": stats["flat_tokens"], "tree_tokens": stats["tree_tokens"],
        "loss_native": float(a.detach()), "loss_adapter": float(b.detach()), "adapter_grad_diff": adapter_grad_diff,
        **{f"time_{m}_s": t for m, t in med.items()},
        "adapter_over_native": med["adapter"] / med["native"],
        "native_vs_hf": med["hf"] / med["native"], "adapter_vs_hf": med["hf"] / med["adapter"],
        "moe_speedup": med["moe_linear"] / med["moe"], "moe_ideal_compute": ideal_moe["ideal_compute"],
        "moe_efficiency": (med["moe_linear"] / med["moe"]) / ideal_moe["ideal_compute"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--cases", default=None, help=f"default {','.join(CASES)}; --hybrid: {','.join(HYBRID_CASES)}")
    p.add_argument("--scale", type=float, default=0.25, help="size of the synthetic cases (as bench_step)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--preset", default="realistic", choices=sorted(PRESETS))
    p.add_argument("--hybrid", nargs="?", const=",".join(SHAPES), default=None, metavar="SHAPES",
                   help=f"time the hybrid families instead (default {','.join(SHAPES)}; see hybrid_families)")
    p.add_argument("--tree-reps", type=int, default=3, help="--hybrid: tree-step samples per repetition")
    p.add_argument("--precision", action="store_true",
                   help="--hybrid: instead of timing, compare both sides' float32 gradients with float64")
    p.add_argument("--hybrid-scale", type=float, default=0.16,
                   help="--hybrid: the hybrid/ cases run at this fraction of --scale (default: 0.04 of full size)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.seed, args.mask, args.tau_calls = 0, "all", 3
    if args.hybrid:
        unknown = sorted(set(args.hybrid.split(",")) - set(SHAPES))
        if unknown:
            p.error(f"--hybrid: unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
        args.cases = args.cases or ",".join(HYBRID_CASES)
        (hybrid_precision if args.precision else hybrid_main)(args)
        return 0
    args.cases = args.cases or ",".join(CASES)
    args.model_cfg = dict(PRESETS[args.preset])
    args.hybrid_scale = 1.0
    cfg = args.model_cfg
    native = attention_model(**cfg)
    with tempfile.TemporaryDirectory() as d:
        treelit.save_hf_checkpoint(native, d)
        adapter = treelit.load_hf_model(d)
    models = {"native": native, "adapter": adapter, "peer": load_peer(native), "moe": moe_model(**cfg)}
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "model": f"{args.preset}: {cfg}", "moe": "qwen3_moe, 8 experts top-2, expert MLP = dense MLP / 2",
           "scale": args.scale, "reps": args.reps, "load_before": os.getloadavg()[0],
           "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    print(f"# {env['model']}; MoE: {env['moe']}; torch {env['torch']}, 1 thread, CPU time; scale {args.scale}; "
          f"load {env['load_before']:.1f}")
    rows = []
    for name in [n for n in args.cases.split(",") if n]:
        rows.append(run_case(name, models, SimpleNamespace(**vars(args))))
        r = rows[-1]
        print(f"  {name}: adapter/native {r['adapter_over_native']:.2f}x, adapter {r['adapter_vs_hf']:.2f}x vs "
              f"transformers, MoE {r['moe_speedup']:.2f}x (ideal_c {r['moe_ideal_compute']:.2f}x)", flush=True)
        if args.json:  # partial results survive an interrupted run
            with open(args.json, "w") as f:
                json.dump({"env": env, "cases": rows, "complete": False}, f, indent=2)
    head = (f"{'case':<13}{'flat':>7}{'tree':>7}{'t_native':>10}{'t_adapter':>10}{'adapt/nat':>10}{'t_hf':>8}"
            f"{'nat_vs_hf':>10}{'adapt_vs_hf':>12}{'t_moe':>8}{'t_moe_lin':>10}{'moe_x':>7}{'ideal_c':>8}{'eff':>6}")
    print(head)
    for r in rows:
        print(f"{r['name']:<13}{r['flat_tokens']:>7}{r['tree_tokens']:>7}{r['time_native_s']:>9.2f}s"
              f"{r['time_adapter_s']:>9.2f}s{r['adapter_over_native']:>9.2f}x{r['time_hf_s']:>7.2f}s"
              f"{r['native_vs_hf']:>9.2f}x{r['adapter_vs_hf']:>11.2f}x{r['time_moe_s']:>7.2f}s"
              f"{r['time_moe_linear_s']:>9.2f}s{r['moe_speedup']:>6.2f}x{r['moe_ideal_compute']:>7.2f}x"
              f"{r['moe_efficiency']:>6.2f}")
    env["load_after"] = os.getloadavg()[0]
    print(f"# load average {env['load_before']:.1f} before, {env['load_after']:.1f} after; adapter vs native gradients "
          f"max rel diff {max(r['adapter_grad_diff'] for r in rows):.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "cases": rows, "complete": True}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
