"""Where the time of one training step goes, tree vs per-branch, on one benchmark case.

Runs ``bench_step``'s model and case single-threaded and splits each mode's step into
CPU time (this process only, so other load on a shared machine does not count):

* ``attention`` - the attention kernels, forward and backward (timed around each call);
* ``head``      - the log-prob head (``weighted_nll``: logits, softmax, both gradients);
* ``rest``      - everything else: linear layers, norms, RoPE, MLPs, recurrent layers,
  embedding, bookkeeping.

Each row also gives the step's minor page faults and system CPU time (part of ``total``):
memory the allocator maps afresh and the kernel zeroes (see ``bench_step --malloc``).

With both modes, ``per-branch/tree`` is the measured ratio per column, ``work ratio`` the
ratio the work allows (total: the compute-weighted ideal of ``bench_step``; attention: the
(query, key) pairs; head: the target rows; rest: the tokens) and ``efficiency`` the first
over the second: below 1.0, the tree spends more per unit of that work than the per-branch
path does. The last line gives the efficiency the tree step would reach at parity: every
part at the per-branch path's cost per unit of its work.

``--ops`` also prints torch profiler operator tables (wall time per operator, which a
loaded machine inflates).

    python benchmarks/profile_step.py --case grpo_group
    python benchmarks/profile_step.py --case tau_bench --ops
    python benchmarks/profile_step.py --case grpo_64x256 --modes tree --malloc retain
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from bench_models import PRESETS, attention_model, compute_weighted_ideal, cost_model, hybrid_model  # noqa: E402
from bench_step import BASE_LINEAR_TOKENS, case_scale, load_case, retain_freed_memory  # noqa: E402

CLOCK = {"attention": 0.0, "head": 0.0}


class _Timed(torch.autograd.Function):
    """Runs ``fn(*inputs)`` on detached copies and charges forward and backward CPU time to ``what``."""

    @staticmethod
    def forward(ctx, what, fn, *inputs):
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        t0 = time.process_time()
        with torch.enable_grad():
            out = fn(*leaves)
        CLOCK[what] += time.process_time() - t0
        ctx.what, ctx.out, ctx.leaves = what, out, leaves
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        t0 = time.process_time()
        need = [x for x in ctx.leaves if x.requires_grad]
        grads = iter(torch.autograd.grad(ctx.out, need, g, allow_unused=True) if need else [])
        CLOCK[ctx.what] += time.process_time() - t0
        return (None, None, *[next(grads) if x.requires_grad else None for x in ctx.leaves])


@contextmanager
def timed_parts():
    """Patch the attention entry points of both contexts and the head (restored on exit)."""
    from treelit.loss import linear as linear_mod
    from treelit.loss import tree as tree_mod
    from treelit.models import context

    saved = []

    def patch(owner, name, wrap):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrap(getattr(owner, name)))

    def attention(orig):
        def run(self, layer, q, k, v, *args, **kwargs):
            return _Timed.apply("attention", lambda q, k, v: orig(self, layer, q, k, v, *args, **kwargs), q, k, v)
        return run

    def head(orig):
        def run(hidden, weight, targets, coef, **kwargs):
            return _Timed.apply("head", lambda h, w: orig(h, w, targets, coef, **kwargs), hidden, weight)
        return run

    patch(context.TreeContext, "attention", attention)
    patch(context.CausalContext, "attention", attention)
    for mod in (tree_mod, linear_mod):
        if hasattr(mod, "weighted_nll"):
            patch(mod, "weighted_nll", head)
    try:
        yield
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)


def breakdown(step, model, reps: int):
    """Median over ``reps`` (by total) of (total, attention, head) CPU seconds of one step,
    its minor page faults and its system CPU seconds."""
    rows = []
    for _ in range(reps):
        CLOCK.update(attention=0.0, head=0.0)
        model.zero_grad(set_to_none=True)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.process_time()
        with timed_parts():
            step()
        total = time.process_time() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        rows.append((total, CLOCK["attention"], CLOCK["head"], r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime))
    model.zero_grad(set_to_none=True)
    return sorted(rows)[len(rows) // 2]


def work_ratios(model, case, batch) -> list:
    """Per-branch work over tree work, per column of the table: the compute-weighted ideal
    (``bench_models``) for the total, attention pairs, head target rows, and tokens for the rest."""
    cost = cost_model(model)
    ideal = compute_weighted_ideal(cost, case.branches, case.masks, batch)
    pairs_flat, pairs_tree = ideal["pairs_flat"], ideal["pairs_tree"]
    tokens = sum(map(len, case.branches)) / batch.num_tokens
    if cost["per_pair"] == 0:  # no attention layer
        pairs_flat = pairs_tree = float("nan")
    return [ideal["ideal_compute"], pairs_flat / pairs_tree, ideal["targets_flat"] / max(1, ideal["targets_tree"]), tokens]


def parity_efficiency(per_branch, work) -> float:
    """The efficiency (measured speedup over the compute-weighted ideal) of a tree step whose
    attention, head and rest each cost what the per-branch step pays per unit of that part's
    work. It differs from 1.0 where the parts' shares of the time differ from their shares of
    the FLOPs the ideal weights them by."""
    total, att, head, rest = per_branch
    ideal, pairs, targets, tokens = work
    tree = sum(t / w for t, w in ((att, pairs), (head, targets), (rest, tokens)) if t > 0)
    return total / tree / ideal


def op_table(step, model, top: int):
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    model.zero_grad(set_to_none=True)
    totals = defaultdict(float)
    for e in prof.key_averages():
        totals[e.key] += e.self_cpu_time_total
    total = sum(totals.values())
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {v / total:6.1%} {v / 1e6:8.2f}s  {k}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="tau_bench")
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--hybrid-scale", type=float, default=0.4)
    p.add_argument("--preset", default="realistic", choices=sorted(PRESETS))
    p.add_argument("--tau-calls", type=int, default=3)
    p.add_argument("--mask", default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", default="auto")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (as bench_step)")
    p.add_argument("--modes", default="tree,per-branch",
                   help="comma-separated modes to time (tree, per-branch); the ratio row needs both")
    p.add_argument("--malloc", choices=["default", "retain"], default="default", help="as bench_step's --malloc")
    p.add_argument("--ops", action="store_true", help="also print profiler operator tables")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    if args.malloc == "retain" and not retain_freed_memory():
        p.error("--malloc retain needs glibc's mallopt")
    torch.set_num_threads(args.threads)
    cfg = PRESETS[args.preset]
    case, kind = load_case(args.case, args, cfg["vocab"])
    model = (hybrid_model if kind == "hybrid" else attention_model)(**cfg)
    batch = treelit.TokenTree.from_branches(case.branches, case.masks).to_batch()
    micro = max(256, round(BASE_LINEAR_TOKENS * (1.0 if args.case == "tau_bench" else case_scale(kind, args))))

    def tree_step():
        treelit.tree_loss(model, batch, attention=args.attention).backward()

    def linear_step():
        treelit.linear_backward(model, case.branches, case.masks, max_tokens=micro)

    print(f"# {case.name}: {batch.num_tokens} tree tokens, {sum(map(len, case.branches))} flat, "
          f"{batch.num_segments} segments; {torch.get_num_threads()} thread(s), CPU time, median of {args.reps}; "
          f"malloc={args.malloc}; load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<12}{'total':>9}{'attention':>11}{'head':>9}{'rest':>9}{'faults':>9}{'sys':>8}")
    parts = {}
    modes = [(n, s) for n, s in (("tree", tree_step), ("per-branch", linear_step)) if n in args.modes.split(",")]
    for name, step in modes:
        step()  # warm-up
        total, att, head, faults, sys_s = breakdown(step, model, args.reps)
        parts[name] = (total, att, head, total - att - head)
        print(f"{name:<12}" + "".join(f"{x:>8.2f}s" for x in parts[name]) + f"{faults / 1e3:>8.0f}k{sys_s:>7.2f}s"
              + f"   attention {parts[name][1] / parts[name][0]:.1%} of the step")
    if len(parts) == 2:
        ratio = [b / a if a > 0 else float("nan") for a, b in zip(parts["tree"], parts["per-branch"])]
        print(f"{'per-branch/tree':<12}" + "".join(f"{r:>8.2f}x" for r in ratio))
        work = work_ratios(model, case, batch)
        print(f"{'work ratio':<15}" + "".join(f"{r:>8.2f}x" for r in work)
              + "   (total: compute-weighted ideal; attention: pairs; head: targets; rest: tokens)")
        print(f"{'efficiency':<15}" + "".join(f"{r / w:>9.2f}" for r, w in zip(ratio, work)))
        print(f"# at parity (each part of the tree step at the per-branch cost per unit of its work) the tree step "
              f"would reach {parity_efficiency(parts['per-branch'], work):.2f} of the compute-weighted ideal")
    if args.ops:
        for name, step in modes:
            print(f"\n{name}: operators by self time (wall)")
            op_table(step, model, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
