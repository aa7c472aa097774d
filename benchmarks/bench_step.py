"""Tree mode vs per-branch training: one forward+backward step, same process, same weights.

For each agentic-shaped case this times a full training step (forward, loss, backward)
in three ways, interleaved (warm-up, then repetitions, median). Each repetition runs
about as many tree steps as one per-branch step lasts, half before and half after the
other modes, and counts their mean (``--tree-steps``; this machine's speed drifts within
seconds, see :func:`tree_steps_per_rep`):

* ``tree``   - treelit's tree step;
* ``linear`` - treelit's own per-branch path (padded micro-batches of the same model);
* ``hf``     - the peer: the same weights in ``transformers``, branch by branch in padded
  micro-batches with ``labels=-100`` outside the mask (:mod:`hf_peer`), the loop users run
  today (attention-only models, token-mean).

``--schedule interleave`` cuts each per-branch step into consecutive runs of its own
micro-batches (:func:`step_pieces`, one per tree step of the repetition) and puts a tree step
before, between and after them, so that every part of a per-branch step is timed next to a
tree step; the pieces run exactly the step's micro-batches with the step's normalizer and
accumulate the same gradients (the tree steps in between do not touch them), and the
repetition's per-branch time is their sum.

Times are this process's CPU time with one thread by default (``--timer``, ``--threads``):
on a shared machine, wall-clock time with several threads mostly measures the other
processes. It reports flat/tree tokens, the compute-weighted ideal (:mod:`bench_models`), the
measured speedup over the per-branch path and its efficiency against that ideal, the
speedup over the transformers loop, each mode's peak tensor memory, and the largest
relative gradient difference between modes. The default model has a real checkpoint's
head/trunk cost ratio (``--preset realistic``); cases run at ``--scale`` of their full
size (message lengths; hybrid cases at ``--hybrid-scale`` of that), and the per-branch
micro-batches (``--linear-tokens``, 8192 padded tokens at full size) shrink with the case.
Besides the agentic cases (:mod:`agentic`) the suite has the RL shapes of :data:`RL_CASES`:
GRPO groups of 16 completions of 512 tokens under a 1,024-token prompt and of 64 x 256
under 2,048 (lengths at full size, chat frames included), and a 3-level agent tree of 27
leaves.

    python benchmarks/bench_step.py --json benchmarks/results/bench_step.json
    python benchmarks/bench_step.py --cases tau_bench --json benchmarks/results/bench_step_tau_bench.json
    python benchmarks/bench_step.py --quick                 # tiny cases, one repetition
    python benchmarks/bench_step.py --cases agent_tree_27 --no-peer --schedule interleave
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
from agentic import SUITE, Case, _Gen, _per_call, make_case  # noqa: E402
from bench_models import PRESETS, attention_model, branch_targets, compute_weighted_ideal, cost_model, hybrid_model  # noqa: E402
from memory import peak_memory  # noqa: E402

HYBRID_SUITE = ["hybrid/grpo_group", "hybrid/multi_turn", "hybrid/wide_fanout"]
# RL shapes (lengths in tokens at full size; --scale shrinks them like the other cases)
RL_SUITE = ["grpo_16x512", "grpo_64x256", "agent_tree_27"]


def grpo_shape(g: _Gen, mask_mode: str, G: int, completion: int, prompt: int):
    """One prompt of ``prompt`` tokens (system + user message), ``G`` completions of ``completion`` tokens."""
    head = [("system", g.text(prompt * 3 // 4 - 4)), ("user", g.text(prompt // 4 - 4))]
    return _per_call([head + [("assistant", g.text(completion - 4))] for _ in range(G)], mask_mode)


def agent_tree(g: _Gen, mask_mode: str, depth: int = 3, k: int = 3):
    """An agent tree: at each of ``depth`` levels every trajectory is sampled ``k`` times (an
    assistant call and its tool result, the last level's call alone): ``k ** depth`` leaves."""
    paths = [[("system", g.text(1200)), ("user", g.text(200))]]
    for level in range(depth):
        last = level == depth - 1
        paths = [p + [("assistant", g.text(g.jitter(150)))] + ([] if last else [("tool", g.text(g.jitter(300)))])
                 for p in paths for _ in range(k)]
    return _per_call(paths, mask_mode)


RL_CASES = {
    "grpo_16x512": lambda g, m: grpo_shape(g, m, 16, 512, 1024),
    "grpo_64x256": lambda g, m: grpo_shape(g, m, 64, 256, 2048),
    "agent_tree_27": agent_tree,
}


def make_any_case(name: str, *, seed: int, vocab: int, scale: float, mask_mode: str):
    """A case of ``agentic`` or of :data:`RL_CASES`."""
    if name in RL_CASES:
        branches, masks = RL_CASES[name](_Gen(seed, vocab, scale), mask_mode)
        return Case(name, branches, masks)
    return make_case(name, seed=seed, vocab=vocab, scale=scale, mask_mode=mask_mode)
BASE_LINEAR_TOKENS = 8192  # padded tokens per per-branch micro-batch at scale 1


def retain_freed_memory() -> bool:
    """``--malloc retain``: make glibc serve every allocation from its heap and keep freed
    memory there (``mallopt``: no ``mmap`` chunks, no trimming), for the whole process.

    By default glibc maps each allocation above 32 MiB afresh and unmaps it when freed (and
    trims its heap), so every step touches those pages anew: one minor page fault per 4 KiB,
    zeroed by the kernel. Both modes pay it, in different places: a long tree row's MLP
    activations are such blocks (grpo_64x256: 4,614 tokens x 2,816 x 4 bytes = 52 MB; 0.9M
    faults, 2.1-2.3 s of system time in a 21 s tree step), the per-branch path's head
    allocates a 64 MB weight gradient per micro-batch. Both modes run under the same setting.
    Returns False where ``mallopt`` is missing (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def tree_steps_per_rep(requested: str, warm_tree: float, warm_linear: float, cap: int = 8) -> int:
    """Tree steps per repetition. A per-branch step lasts several tree steps, and this
    machine's speed drifts within seconds (``machine_noise.py``: the same matrix product
    took -19% / +53% of its median over half a minute, nothing else running), so one tree step per
    repetition samples a much shorter stretch of time than the per-branch step it is
    compared with. ``auto`` runs about as many tree steps as one per-branch step lasts
    (a tree step and the per-branch warm-up, at most ``cap``), half before and half after the other modes; the
    repetition's tree time is their mean. An integer fixes the count (1: one each)."""
    if requested != "auto":
        n = int(requested) if str(requested).isdigit() else 0
        if n < 1:
            raise ValueError(f"--tree-steps must be 'auto' or >= 1, got {requested}")
        return n
    return max(1, min(cap, round(warm_linear / max(warm_tree, 1e-9))))


def step_pieces(lengths: List[int], max_tokens: int, k: int) -> List[List[int]]:
    """Branch indices of a per-branch step in the order it runs them, cut into at most ``k``
    consecutive runs of whole micro-batches of about equal padded tokens. A piece starts at a
    micro-batch boundary, so the per-branch path, given a piece's branches, forms exactly
    those micro-batches again: running the pieces one after the other runs the step."""
    from treelit.loss.linear import linear_micro_batches

    if k < 1:
        raise ValueError(f"need at least one piece, got {k}")
    groups = linear_micro_batches(lengths, max_tokens)
    work = [len(g) * max(lengths[i] for i in g) for g in groups]
    total, done = float(sum(work)), 0.0
    pieces: List[List[int]] = [[]]
    for g, w in zip(groups, work):
        if pieces[-1] and done >= total * len(pieces) / k:
            pieces.append([])
        pieces[-1].extend(g)
        done += w
    return pieces


class stashed_grads:
    """Park ``model``'s accumulated gradients while another step of the same model runs, and
    put them back afterwards (that step starts from no gradients and its own are dropped)."""

    def __init__(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]

    def __enter__(self):
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.saved):
            p.grad = g
        return False


def grads_of(model) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


def load_case(name: str, args, vocab: int):
    """A synthetic agentic case (``hybrid/<case>`` on the hybrid model) or ``tau_bench`` (real
    trajectories; token ids re-indexed injectively into the model's vocabulary, which keeps
    the tree and the masks and the realistic head size). Returns ``(case, model kind)``."""
    if name == "tau_bench":
        from real_data import tau_bench_case

        case = tau_bench_case(0, max_calls=args.tau_calls)
        used = sorted({t for b in case.branches for t in b})
        if len(used) > vocab:
            raise ValueError(f"tau_bench uses {len(used)} distinct ids, more than the vocabulary ({vocab})")
        index = {t: i for i, t in enumerate(used)}
        case.branches = [[index[t] for t in b] for b in case.branches]
        return case, "attention"
    kind = "attention"
    if name.startswith("hybrid/"):
        kind, name = "hybrid", name.split("/", 1)[1]
    case = make_any_case(name, seed=args.seed, vocab=vocab, scale=case_scale(kind, args), mask_mode=args.mask)
    case.name = f"hybrid/{name}" if kind == "hybrid" else name
    return case, kind


def case_scale(kind: str, args) -> float:
    """Size of a synthetic case relative to its full size (hybrid cases: ``--hybrid-scale`` of that)."""
    return args.scale * (args.hybrid_scale if kind == "hybrid" else 1.0)


def run_case(name: str, models: Dict, args) -> Dict:
    case, kind = load_case(name, args, args.model_cfg["vocab"])
    if kind not in models:
        models[kind] = (hybrid_model if kind == "hybrid" else attention_model)(**args.model_cfg)
    model = models[kind]
    peer = None
    if args.peer and kind == "attention" and args.aggregation == "token-mean":
        if "peer" not in models:
            from hf_peer import load_peer

            models["peer"] = load_peer(models["attention"])
        peer = models["peer"]
    t0 = time.perf_counter()
    tree = treelit.TokenTree.from_branches(case.branches, case.masks)
    batch = tree.to_batch()
    build_s = time.perf_counter() - t0
    stats = tree.stats()
    ideal = compute_weighted_ideal(cost_model(model), case.branches, case.masks, batch, args.aggregation)
    # per-branch micro-batches shrink with the case, so that they hold as many branches as at full size
    micro = args.linear_tokens or max(256, round(BASE_LINEAR_TOKENS * (1.0 if name == "tau_bench" else case_scale(kind, args))))

    def tree_step():
        loss = treelit.tree_loss(model, batch, args.aggregation, attention=args.attention)
        loss.backward()
        return float(loss.detach())

    def linear_step():
        return treelit.linear_backward(model, case.branches, case.masks, aggregation=args.aggregation, max_tokens=micro)

    modes = {"tree": (model, tree_step), "linear": (model, linear_step)}
    if peer is not None:
        from hf_peer import peer_step

        modes["hf"] = (peer, lambda: peer_step(peer, case.branches, case.masks, micro))
    result: Dict = {"name": case.name, **stats, **ideal, "tree_build_s": build_s, "vocab": model.vocab_size,
                    "linear_tokens": micro, "attention": args.attention}
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    grads, times = {}, {m: [] for m in modes}
    for mode, (m, step) in modes.items():  # warm-up doubles as the memory and gradient pass
        m.zero_grad(set_to_none=True)
        t0 = clock()
        peak, loss = peak_memory(step) if args.memory else (None, step())
        if mode == "linear":
            warm_linear = clock() - t0
        grads[mode] = grads_of(m)
        result[f"loss_{mode}"] = loss
        result[f"peak_mem_{mode}_bytes"] = peak
    if peer is not None:
        from hf_peer import grad_diff

        result["max_rel_grad_diff_hf"] = grad_diff(model, grads["tree"], grads["hf"])
    def timed(mode):
        m, step = modes[mode]
        m.zero_grad(set_to_none=True)
        t0 = clock()
        step()
        return clock() - t0

    # the tree's warm-up carries first-call costs; one more (untimed for the result) tree step sizes k
    k = tree_steps_per_rep(args.tree_steps, timed("tree") if args.tree_steps == "auto" else 1.0, warm_linear)
    tree_all: List[float] = []
    if args.schedule == "interleave":
        pieces = step_pieces([len(b) for b in case.branches], micro, k)
        Z = treelit.Branches.build(case.branches, case.masks).normalizer(args.aggregation)
        n_items = branch_targets(case.masks)  # the step's targets: the peer's num_items_in_batch

        def piece_step(mode, piece):
            sub_b, sub_m = [case.branches[i] for i in piece], [case.masks[i] for i in piece]
            if mode == "linear":
                return lambda: treelit.linear_backward(model, sub_b, sub_m, aggregation=args.aggregation,
                                                       normalizer=Z, max_tokens=micro)
            from hf_peer import peer_step

            return lambda: peer_step(peer, sub_b, sub_m, micro, n_items=n_items)

        def timed_tree_between():  # the tree step leaves the per-branch gradients as they were
            with stashed_grads(model):
                return timed("tree")

        result.update(schedule_pieces=len(pieces), piece_times_s={m: [] for m in modes if m != "tree"})
    for _ in range(args.reps):  # interleaved, so drifts in machine speed hit every mode
        if args.schedule == "interleave":
            for m, _step in modes.values():
                m.zero_grad(set_to_none=True)
            steps = [timed_tree_between()]
            spent = {mode: [] for mode in modes if mode != "tree"}
            for piece in pieces:
                for mode in spent:
                    t0 = clock()
                    piece_step(mode, piece)()
                    spent[mode].append(clock() - t0)
                steps.append(timed_tree_between())
            for mode, ts in spent.items():
                times[mode].append(sum(ts))
                result["piece_times_s"][mode].append(ts)
            tree_all += steps
            times["tree"].append(statistics.fmean(steps))
            continue
        before = [timed("tree") for _ in range((k + 1) // 2)]
        for mode in modes:
            if mode != "tree":
                times[mode].append(timed(mode))
        after = [timed("tree") for _ in range(k // 2)]
        tree_all += before + after
        times["tree"].append(statistics.fmean(before + after))
    for m, _ in modes.values():
        m.zero_grad(set_to_none=True)
    med = {mode: statistics.median(t) for mode, t in times.items()}
    result.update(
        tree_steps_per_rep=k,
        tree_step_times_s=tree_all,
        times_s=times,
        time_tree_s=med["tree"],
        time_linear_s=med["linear"],
        measured_speedup=med["linear"] / med["tree"],
        efficiency=(med["linear"] / med["tree"]) / ideal["ideal_compute"],
        # each repetition's own ratio (its per-branch step over its tree steps' mean): the spread
        # a single figure carries on a machine whose speed drifts
        efficiency_reps=[lin / tr / ideal["ideal_compute"] for lin, tr in zip(times["linear"], times["tree"])],
        efficiency_tokens=(med["linear"] / med["tree"]) / stats["ideal_speedup"],
        max_rel_grad_diff=max_rel_diff(grads["tree"], grads["linear"]),
    )
    if "hf" in med:
        result.update(time_hf_s=med["hf"], speedup_vs_hf=med["hf"] / med["tree"])
    return result


def fmt_bytes(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}M"


def print_table(rows: List[Dict]) -> None:
    head = (f"{'case':<19}{'flat':>6}{'tree':>6}{'ideal':>7}{'ideal_c':>8}{'measured':>9}{'eff':>6}{'eff_reps':>11}{'vs_hf':>7}"
            f"{'t_tree':>8}{'t_lin':>8}{'t_hf':>8}{'mem_tree':>9}{'mem_lin':>8}{'mem_hf':>8}{'grad_diff':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        hf = r.get("time_hf_s")
        vs_hf = f"{r['speedup_vs_hf']:.2f}x" if hf else "-"
        t_hf = f"{hf:.2f}s" if hf else "-"
        reps = r.get("efficiency_reps") or [r["efficiency"]]
        spread = f"{min(reps):.2f}-{max(reps):.2f}" if len(reps) > 1 else f"{reps[0]:.2f}"
        print(
            f"{r['name']:<19}{r['flat_tokens']:>6}{r['tree_tokens']:>6}{r['ideal_speedup']:>6.2f}x"
            f"{r['ideal_compute']:>7.2f}x{r['measured_speedup']:>8.2f}x{r['efficiency']:>6.2f}{spread:>11}{vs_hf:>7}"
            f"{r['time_tree_s']:>7.2f}s{r['time_linear_s']:>7.2f}s{t_hf:>8}"
            f"{fmt_bytes(r['peak_mem_tree_bytes']):>9}{fmt_bytes(r['peak_mem_linear_bytes']):>8}"
            f"{fmt_bytes(r.get('peak_mem_hf_bytes')):>8}{r['max_rel_grad_diff']:>10.1e}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write results here")
    p.add_argument("--quick", action="store_true", help="tiny cases (scale 0.05), one repetition")
    p.add_argument("--cases", default=",".join(SUITE + RL_SUITE + HYBRID_SUITE),
                   help="comma-separated case names (also: tau_bench, the real-data case; agent_group)")
    p.add_argument("--scale", type=float, default=None, help="size of the synthetic cases (default 0.25 of full)")
    p.add_argument("--hybrid-scale", type=float, default=0.4,
                   help="hybrid cases run at this fraction of --scale (their recurrent scans are slow on CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per mode (default 2; quick: 1)")
    p.add_argument("--mask", choices=["all", "assistant"], default="all", help="loss mask of each branch")
    p.add_argument("--aggregation", default="token-mean", choices=treelit.AGGREGATIONS)
    p.add_argument("--attention", default="auto", help="tree attention backend")
    p.add_argument("--preset", default="realistic", choices=sorted(PRESETS), help="model shape (see bench_models)")
    for k in ("dim", "layers", "heads", "kv_heads", "intermediate", "vocab"):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"override the preset's {k}")
    p.add_argument("--linear-tokens", type=int, default=None,
                   help="padded tokens per per-branch micro-batch (default 8192 x scale; tau_bench 8192)")
    p.add_argument("--tau-calls", type=int, default=3, help="tau_bench: first model calls kept per trial")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip the transformers loop")
    p.add_argument("--timer", choices=["wall", "cpu"], default="cpu",
                   help="this process's CPU time (default; with one thread it does not count time spent waiting for "
                        "other processes on a shared machine) or wall-clock time")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's choice)")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory pass")
    p.add_argument("--malloc", choices=["default", "retain"], default="default",
                   help="glibc allocator: its defaults, or keep freed memory for reuse (see retain_freed_memory)")
    p.add_argument("--tree-steps", default="auto",
                   help="tree steps per repetition, around the other modes' steps (default auto: as many as one "
                        "per-branch step lasts, at most 8; 1: one step per mode); the repetition's tree time is their mean")
    p.add_argument("--schedule", choices=["bracket", "interleave"], default="bracket",
                   help="bracket: a repetition's tree steps half before and half after the other modes' steps; "
                        "interleave: the per-branch steps cut into runs of their micro-batches, a tree step "
                        "before, between and after them (see step_pieces)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.scale = args.scale if args.scale is not None else (0.05 if args.quick else 0.25)
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 2)
    try:
        tree_steps_per_rep(args.tree_steps, 1.0, 1.0)
    except ValueError as e:
        p.error(str(e))
    args.model_cfg = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in PRESETS[args.preset].items()}
    if args.malloc == "retain" and not retain_freed_memory():
        p.error("--malloc retain needs glibc's mallopt")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.timer == "cpu" and torch.get_num_threads() > 1:
        print("# note: CPU time with several threads includes their synchronisation; wall-clock may suit better")
    c = args.model_cfg
    cost = cost_model(attention_model(**{**c, "max_seq_len": 64}))
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "model": (f"{args.preset}: qwen2-style, {c['layers']} layers, dim {c['dim']}, {c['heads']} heads "
                  f"({c['kv_heads']} kv), MLP {c['intermediate']}, vocab {c['vocab']}, float32; "
                  f"head/trunk per token {cost['head_over_trunk']:.2f}"),
        "timer": args.timer, "tree_steps": args.tree_steps, "schedule": args.schedule, "malloc": args.malloc, "scale": args.scale, "hybrid_scale": args.scale * args.hybrid_scale, "reps": args.reps, "mask": args.mask, "aggregation": args.aggregation,
        "load_before": os.getloadavg()[0],
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    tau_note = " (tau_bench: its own per-call masks)" if "tau_bench" in args.cases.split(",") else ""
    print(f"# {env['model']}; torch {env['torch']}, {env['threads']} threads, {args.timer} time; scale {args.scale} "
          f"(hybrid {env['hybrid_scale']:g}); mask={args.mask}{tau_note}; attention={args.attention}; malloc={args.malloc}; "
          f"schedule={args.schedule}; "
          f"load {env['load_before']:.1f}")
    rows, models = [], {}
    for name in [n for n in args.cases.split(",") if n]:
        rows.append(run_case(name, models, args))
        r = rows[-1]
        print(f"  {name}: {r['measured_speedup']:.2f}x (ideal_c {r['ideal_compute']:.2f}x)"
              + (f", {r['speedup_vs_hf']:.2f}x vs transformers" if "speedup_vs_hf" in r else ""), flush=True)
    env["load_after"] = os.getloadavg()[0]
    print_table(rows)
    print(f"# load average {env['load_before']:.1f} before, {env['load_after']:.1f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "cases": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
