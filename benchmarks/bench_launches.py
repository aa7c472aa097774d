"""What one training step asks of a GPU's host: kernel launches, syncs and uploads, counted.

On a GPU every dispatched kernel costs ~5-20 us of host time and every sync stalls the queue,
so a step whose counts grow with the tree's segments is bound by the host, not by its FLOPs.
The counts do not depend on the device: :class:`treelit.utils.dispatch.DispatchCounter` takes
them exactly on CPU (what it calls a launch, a sync and an upload: its module docs). One tree
step (forward, SFT loss, backward) is counted per row, after one uncounted warm-up step.

Grid: trees (GRPO groups, fan-out agent trees, a branch at every turn, the real tau-bench
trace), attention backends (``sdpa_dense``; ``segment``; ``segment/cuda``: segment's CUDA code
path forced on CPU, :data:`treelit.attention.merged.MATH_ON_CPU`), the attention family and
the hybrid one (Gated DeltaNet / attention / Mamba2, ``ssm=torch``), 2 and 8 layers. Columns:
launches per step and per layer (the step's launches less the same step's at 0 layers' worth,
i.e. the difference between the 8- and 2-layer rows, over 6), syncs and uploads per step.

The head is counted apart, on the meta device (no memory): its launches for 20,000 targets at
Qwen3's 151,936-token vocabulary, with the chunk the head picks on an 80 GiB device and on CPU.

The last table fits ``launches per layer = a + b x segments`` per (family, backend) over the
trees: ``b`` is the growth with the tree (0: flat).

    python benchmarks/bench_launches.py --json benchmarks/results/bench_launches.json
    python benchmarks/bench_launches.py --quick      # a few small rows (the test suite runs it)

On a GPU (``--device cuda``) each row also reads the profiler's count of CUDA kernel launches.

``ssm=fla`` runs fla's Triton kernels, which need a GPU; ``--fla`` counts their launches on CPU under
Triton's interpreter (a process of its own, started by this script with ``--fla-interpreter``): per
recurrent layer, the calls of fla's chunked ops (one per depth level of the tree's segments) and the
Triton kernels they launch, for native Gated DeltaNet and Mamba2 layers, forward and backward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--fla-interpreter" in sys.argv:  # fla's Triton kernels on CPU: the interpreter comes before Triton is imported
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import triton_interpreter  # noqa: E402

    triton_interpreter.install()

import treelit  # noqa: E402
from treelit.attention import merged  # noqa: E402
from treelit.utils.dispatch import DispatchCounter  # noqa: E402

VOCAB = 4096
SMALL = dict(dim=64, heads=4, kv_heads=2, intermediate=128, vocab=VOCAB)


# -- trees (token ids, every token after the first trained) ------------------------------------------------
def _seg(rng, n: int) -> List[int]:
    return rng.integers(1, VOCAB, size=n).tolist()


def grpo(G: int, prompt: int = 256, completion: int = 64, seed: int = 0) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    p = _seg(rng, prompt)
    return [p + _seg(rng, completion) for _ in range(G)]


def fanout(depth: int, k: int = 3, call: int = 40, tool: int = 80, seed: int = 0) -> List[List[int]]:
    """Every trajectory sampled ``k`` times at each of ``depth`` levels (a call and its tool result)."""
    rng = np.random.default_rng(seed)
    paths = [_seg(rng, 200)]
    for _ in range(depth):
        paths = [p + _seg(rng, call) + _seg(rng, tool) for p in paths for _ in range(k)]
    return paths


def every_turn(turns: int, turn: int = 48, side: int = 16, seed: int = 0) -> List[List[int]]:
    """One main path of ``turns`` turns and, at every turn, a branch that leaves it (dropped
    thinking, a retried call): ``turns + 1`` branches, about ``2 x turns`` segments."""
    rng = np.random.default_rng(seed)
    main = _seg(rng, 128)
    out = []
    for _ in range(turns):
        out.append(main + _seg(rng, side))
        main = main + _seg(rng, turn)
    return out + [main]


def tau_bench() -> List[List[int]]:
    from real_data import tau_bench_case

    case = tau_bench_case(0, max_calls=6)
    used = sorted({t for b in case.branches for t in b})
    index = {t: 1 + i % (VOCAB - 1) for i, t in enumerate(used)}  # not injective: the counts only need the shape
    return [[index[t] for t in b] for b in case.branches]


TREES = {
    **{f"grpo_{g}": (lambda g=g: grpo(g)) for g in (4, 16, 64)},
    **{f"fanout_d{d}": (lambda d=d: fanout(d)) for d in (2, 3, 4)},
    **{f"every_turn_{t}": (lambda t=t: every_turn(t)) for t in (8, 32, 128)},
    "tau_bench": tau_bench,
}
QUICK_TREES = ["grpo_4", "every_turn_8", "every_turn_32"]


# -- models and one counted step --------------------------------------------------------------------------
def build(family: str, layers: int):
    from bench_models import attention_model, hybrid_model

    make = hybrid_model if family == "hybrid" else attention_model
    model = make(layers=layers, **SMALL, max_seq_len=65536).double()
    if family == "hybrid":
        treelit.ssm.set_ssm_backend(model, "torch")
    return model


def _step(model, batch, attention: str, objective: str = "sft") -> None:
    model.zero_grad(set_to_none=True)
    treelit.tree_loss(model, batch, attention=attention, objective=objective).backward()


def rl_tree(branches: List[List[int]], seed: int = 0):
    """``branches`` with advantages and old log-probs (one per token id: shared tokens agree)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(-2.0, 0.1, VOCAB)
    return treelit.TokenTree.from_branches(branches, advantages=rng.normal(0, 1, len(branches)).tolist(),
                                           old_logprobs=[[float(table[t]) for t in b] for b in branches])


def count_step(model, tree, backend: str, device: str = "cpu", objective: str = "sft",
               where: bool = False) -> Dict[str, float]:
    """Counts of one step on ``tree`` (a :class:`~treelit.TokenTree`) after an uncounted one;
    each step gets its row afresh from the tree, as a training step gets a new batch."""
    attention = "segment" if backend.startswith("segment") else backend
    merged.MATH_ON_CPU = backend == "segment/cuda"
    try:
        _step(model, tree.to_batch().to(device), attention, objective)  # warm-up: lazy imports
        batch = tree.to_batch().to(device)
        with DispatchCounter(where=where) as c:
            _step(model, batch, attention, objective)
        row = c.counts.as_dict()
        if where:
            row["sites"] = dict(c.counts.sites)
        if device == "cuda":
            row["cuda_kernels"] = cuda_launches(lambda: _step(model, batch, attention))
        return row
    finally:
        merged.MATH_ON_CPU = False


def cuda_launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def head_counts(targets: int = 20000, vocab: int = 151936, dim: int = 2048) -> List[Dict]:
    """Launches of the log-prob head (fused SFT head and the RL head with entropy) for ``targets``
    rows, with the chunk the head picks for an 80 GiB device and on CPU, counted on meta tensors."""
    from treelit.loss.logprobs import default_chunk_rows, token_logprobs, weighted_nll

    rows = []
    for where, memory in (("80 GiB device", 80 << 30), ("cpu", None)):
        chunk = default_chunk_rows(vocab, memory_bytes=memory)
        h = torch.empty(targets, dim, device="meta", requires_grad=True)
        w = torch.empty(vocab, dim, device="meta", requires_grad=True)
        t = torch.empty(targets, dtype=torch.long, device="meta")
        coef = torch.empty(targets, device="meta")
        with DispatchCounter() as c:
            weighted_nll(h, w, t, coef, chunk_rows=chunk).backward()
        sft = c.counts.launches
        with DispatchCounter() as c:
            lp, ent = token_logprobs(h, w, t, chunk_rows=chunk, with_entropy=True)
            (lp.sum() + ent.sum()).backward()
        rows.append({"where": where, "chunk_rows": chunk, "chunks": -(-targets // chunk), "sft": sft,
                     "rl_entropy": c.counts.launches})
    return rows


def fit(rows: List[Dict]) -> List[Dict]:
    """``per_layer = a + b * segments`` per (family, backend), least squares over the trees."""
    out = []
    keys = sorted({(r["family"], r["backend"]) for r in rows if "per_layer" in r})
    for fam, be in keys:
        pts = [(r["segments"], r["per_layer"], r["syncs"], r["uploads"]) for r in rows
               if (r["family"], r["backend"]) == (fam, be) and "per_layer" in r]
        if len(pts) < 2:
            continue
        s, pl, sy, up = (np.array(v, dtype=float) for v in zip(*pts))
        b, a = np.polyfit(s, pl, 1)
        out.append({"family": fam, "backend": be, "a": a, "b_per_segment": b, "per_layer_min": pl.min(),
                    "per_layer_max": pl.max(), "syncs_max": int(sy.max()), "uploads_max": int(up.max())})
    return out


def run(trees: List[str], families: List[str], backends: List[str], layer_counts: Tuple[int, int],
        device: str = "cpu") -> List[Dict]:
    rows = []
    models = {}
    for fam in families:
        for L in layer_counts:
            models[(fam, L)] = build(fam, L).to(device)
    for name in trees:
        tree = treelit.TokenTree.from_branches(TREES[name]())
        st = tree.to_batch().stats()
        for fam in families:
            for be in backends:
                per = {}
                for L in layer_counts:
                    t0 = time.perf_counter()
                    c = count_step(models[(fam, L)], tree, be, device)
                    row = {"tree": name, "segments": int(st["segments"]), "tree_tokens": int(st["tree_tokens"]),
                           "family": fam, "backend": be, "layers": L, **c, "seconds": time.perf_counter() - t0}
                    per[L] = row
                    rows.append(row)
                lo, hi = layer_counts
                per[hi]["per_layer"] = (per[hi]["launches"] - per[lo]["launches"]) / (hi - lo)
                print(f"  {name:14s} {fam:9s} {be:12s} segs {row['segments']:4d}  launches {per[hi]['launches']:7d}"
                      f"  per layer {per[hi]['per_layer']:8.1f}  syncs {per[hi]['syncs']:4d}"
                      f"  uploads {per[hi]['uploads']:4d}", flush=True)
    return rows


FLA_TREES = {"grpo_4": lambda: grpo(4, prompt=24, completion=8), "every_turn_4": lambda: every_turn(4, turn=8, side=4),
             "every_turn_8": lambda: every_turn(8, turn=8, side=4), "fanout_d2": lambda: fanout(2, k=2, call=6, tool=6)}


def fla_counts(trees: List[str]) -> List[Dict]:
    """Under Triton's interpreter (this process was started with ``--fla-interpreter``): per tree, fla
    op calls and Triton launches per recurrent layer of a tiny Gated DeltaNet and a tiny Mamba2 model."""
    from unittest import mock

    from triton.runtime.interpreter import InterpretedFunction

    from treelit.ssm import fla_backend, set_ssm_backend

    launches = [0]
    run = InterpretedFunction.run

    def counted(self, *a, **k):
        launches[0] += 1
        return run(self, *a, **k)

    InterpretedFunction.run = counted
    calls = [0]
    scan = fla_backend.level_scan

    def level_scan(kernel, *a, **k):
        def one(*ka):
            calls[0] += 1
            return kernel(*ka)
        return scan(one, *a, **k)

    fla_backend.level_scan = level_scan
    rows = []
    for name in trees:
        tree = treelit.TokenTree.from_branches(FLA_TREES[name]())
        batch = tree.to_batch()
        levels = int(len(__import__("treelit.ssm.layout", fromlist=["tree_layout"]).tree_layout(batch, 4).levels))
        for case in ("gdn_tiny", "mamba2_tiny"):
            torch.manual_seed(0)
            model = treelit.build_model(case, vocab_size=VOCAB)
            with mock.patch.object(torch.cuda, "is_available", lambda: True):
                set_ssm_backend(model, "fla")
            n_rec = sum(1 for i in range(model.config.num_layers) if model.config.layer_type(i) != "attention")
            launches[0] = calls[0] = 0
            treelit.tree_loss(model, tree.to_batch(), attention="sdpa_dense").backward()
            rows.append({"tree": name, "segments": int(batch.num_segments), "levels": levels, "model": case,
                         "recurrent_layers": n_rec, "fla_calls_per_layer": calls[0] / n_rec,
                         "triton_launches_per_layer": launches[0] / n_rec,
                         "triton_launches_per_layer_per_level": launches[0] / n_rec / levels})
            print(f"  fla {name:13s} {case:12s} segs {rows[-1]['segments']:3d} levels {levels:3d}  fla calls/layer "
                  f"{rows[-1]['fla_calls_per_layer']:.0f}  Triton launches/layer {rows[-1]['triton_launches_per_layer']:.0f}",
                  flush=True)
    return rows


def fla_in_subprocess(trees: List[str]) -> List[Dict]:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "fla.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--fla-interpreter", "--json", out, "--trees-fla", *trees]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("the fla interpreter run failed:\n" + proc.stdout[-2000:] + proc.stderr[-4000:])
        print(proc.stdout, end="")
        with open(out) as f:
            return json.load(f)["fla"]


def print_tables(rows: List[Dict], fits: List[Dict], heads: List[Dict], fla: List[Dict] = ()) -> None:
    hi = max(r["layers"] for r in rows)
    print(f"\n| tree | segments | family | backend | launches ({hi} layers) | launches per layer | syncs | uploads |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["layers"] == hi:
            print(f"| {r['tree']} | {r['segments']} | {r['family']} | {r['backend']} | {r['launches']:,} |"
                  f" {r['per_layer']:.1f} | {r['syncs']} | {r['uploads']} |")
    print("\n| family | backend | launches per layer = a + b x segments: a | b | syncs (max) | uploads (max) |")
    print("|---|---|---|---|---|---|")
    for f in fits:
        print(f"| {f['family']} | {f['backend']} | {f['a']:.1f} | {f['b_per_segment']:.2f} | {f['syncs_max']} |"
              f" {f['uploads_max']} |")
    print("\n| head, 20,000 targets, vocabulary 151,936 | chunk rows | chunks | launches (SFT) | launches (RL, entropy) |")
    print("|---|---|---|---|---|")
    for h in heads:
        print(f"| {h['where']} | {h['chunk_rows']:,} | {h['chunks']} | {h['sft']} | {h['rl_entropy']} |")
    if fla:
        print("\n| ssm=fla (Triton interpreter) | segments | depth levels | model | fla op calls per layer |"
              " Triton launches per layer | per layer and level |")
        print("|---|---|---|---|---|---|---|")
        for r in fla:
            print(f"| {r['tree']} | {r['segments']} | {r['levels']} | {r['model']} | {r['fla_calls_per_layer']:.0f} |"
                  f" {r['triton_launches_per_layer']:.0f} | {r['triton_launches_per_layer_per_level']:.1f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="three small trees, 1 and 2 layers (a dry run)")
    ap.add_argument("--trees", nargs="*", default=None, choices=sorted(TREES))
    ap.add_argument("--families", nargs="*", default=["attention", "hybrid"], choices=["attention", "hybrid"])
    ap.add_argument("--backends", nargs="*", default=["sdpa_dense", "segment", "segment/cuda"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fla", action="store_true", help="also count ssm=fla's Triton launches under the interpreter")
    ap.add_argument("--fla-interpreter", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trees-fla", nargs="*", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.fla_interpreter:  # the child process of --fla
        fla = fla_counts(args.trees_fla or list(FLA_TREES))
        with open(args.json, "w") as f:
            json.dump({"fla": fla}, f)
        return 0
    trees = args.trees or (QUICK_TREES if args.quick else list(TREES))
    layers = (1, 2) if args.quick else (2, 8)
    t0 = time.perf_counter()
    print(f"bench_launches: torch {torch.__version__}, device {args.device}, layers {layers}", flush=True)
    rows = run(trees, args.families, args.backends, layers, args.device)
    fits = fit(rows)
    heads = head_counts()
    fla = fla_in_subprocess(["grpo_4", "every_turn_4"] if args.quick else list(FLA_TREES)) if args.fla else []
    print_tables(rows, fits, heads, fla)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/bench_launches.py " + " ".join(argv or sys.argv[1:]),
                       "torch": torch.__version__, "rows": rows, "fits": fits, "head": heads, "fla": fla}, f, indent=1,
                      default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
