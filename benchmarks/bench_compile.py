"""``compile=true`` against eager: the tree step's time, its compiles and graph breaks, its gradients.

One process, one model (``bench_models.attention_model``, qwen2-style, small dims: the default
``--dim 256 --layers 4``; ``--family hybrid``: ``bench_models.hybrid_model``), two copies with
the same weights: one eager, one whose layers run through :mod:`treelit.models.compiled`
(``--backend inductor`` by default). Each case (the
agentic trees of ``agentic.py`` at ``--scale``, every one a different size and shape) is a
training step of the tree loss (forward, loss, backward; ``--attention segment`` by default), run:

* once per copy first (the compiled copy's first step compiles, a later one recompiles if a
  guard fails): the compile time is the first compiled step's wall-clock time less the eager
  step's (inductor compiles in worker processes), with a fresh inductor cache unless ``--warm-cache``;
* then ``--reps`` times per copy, alternating eager / compiled (odd repetitions the other way
  round): the median of each is the step time, the ratio eager / compiled the speedup.

Times are this process's CPU time on one thread (``torch.set_num_threads(1)``), which the other
processes of a shared machine do not inflate; with ``--device cuda``, wall-clock time after the
device finished. Graph breaks and frames compiled are dynamo's own
counters over the whole run; ``max_abs_grad_diff`` is the largest difference of any gradient
between the two copies on the case's last step.

    python benchmarks/bench_compile.py --json benchmarks/results/bench_compile.json
    python benchmarks/bench_compile.py --family hybrid --cases grpo_group wide_fanout --reps 3 \
        --json benchmarks/results/bench_compile_hybrid.json
    python benchmarks/bench_compile.py --quick     # a tiny model, aot_eager: seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from agentic import make_case  # noqa: E402
from bench_models import attention_model, hybrid_model  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from treelit.models.compiled import CompiledLayers  # noqa: E402

CASES = ["grpo_group", "multi_turn", "tool_fanout", "dropped_thinking", "wide_fanout"]


def step(model, batch, attention: str, wall: bool = False) -> float:
    """One tree step's CPU seconds (forward, loss, backward); ``wall`` (and on a GPU, where the
    step's time is the device's): wall-clock seconds, after the device finished."""
    cuda = batch.input_ids.is_cuda
    clock = time.perf_counter if wall or cuda else time.process_time
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    t = clock()
    treelit.tree_loss(model, batch, attention=attention).backward()
    if cuda:
        torch.cuda.synchronize()
    return clock() - t


def run(args) -> Dict:
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    build = hybrid_model if args.family == "hybrid" else attention_model
    eager = build(args.dim, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab)
    eager = eager.to(args.device)
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend(args.backend)
    compiled.compiled_layers = CompiledLayers(counter)
    rows: List[Dict] = []
    for name in args.cases:
        case = make_case(name, seed=0, vocab=args.vocab, scale=args.scale)
        batch = treelit.TokenTree.from_branches(case.branches, case.masks).to_batch().to(args.device)
        first_eager = step(eager, batch, args.attention, wall=True)
        frames = counter.frame_count
        first_compiled = step(compiled, batch, args.attention, wall=True)
        times = {"eager": [], "compiled": []}
        for r in range(args.reps):
            order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
            for which in order:
                times[which].append(step(eager if which == "eager" else compiled, batch, args.attention))
        diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(eager.parameters(), compiled.parameters()))
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        rows.append(dict(case=name, tree_tokens=batch.num_tokens, segments=batch.num_segments,
                         eager_s=e, compiled_s=c, speedup=e / c,
                         first_step_compile_s=max(0.0, first_compiled - first_eager),
                         frames_compiled=counter.frame_count - frames, max_abs_grad_diff=diff,
                         eager_times_s=times["eager"], compiled_times_s=times["compiled"]))
    return dict(
        backend=args.backend, family=args.family, device=args.device, attention=args.attention,
        torch=torch.__version__, machine=platform.machine(), threads=1,
        model=dict(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                   intermediate=args.intermediate, vocab=args.vocab),
        scale=args.scale, reps=args.reps, rows=rows,
        frames_compiled=counter.frame_count, graph_breaks=sum(counters["graph_break"].values()),
        speedup_geomean=statistics.geometric_mean([r["speedup"] for r in rows]),
    )


def print_table(data: Dict) -> None:
    m = data["model"]
    where = "CPU, 1 thread" if data["device"] == "cpu" else data["device"]
    print(f"compiled ({data['backend']}) against eager, tree step on {where}; {data['family']} model dim "
          f"{m['dim']}, {m['layers']} layers, vocab {m['vocab']}; median of {data['reps']}")
    print(f"{'case':<18}{'tokens':>8}{'segs':>6}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}"
          f"{'compile s':>11}{'frames':>8}{'grad diff':>11}")
    for r in data["rows"]:
        print(f"{r['case']:<18}{r['tree_tokens']:>8}{r['segments']:>6}{r['eager_s'] * 1e3:>10.1f}"
              f"{r['compiled_s'] * 1e3:>13.1f}{r['speedup']:>8.2f}x{r['first_step_compile_s']:>11.1f}"
              f"{r['frames_compiled']:>8}{r['max_abs_grad_diff']:>11.1e}")
    print(f"geometric mean speedup {data['speedup_geomean']:.2f}x; frames compiled {data['frames_compiled']} "
          f"over {len(data['rows'])} trees; graph breaks {data['graph_breaks']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor | aot_eager | eager)")
    p.add_argument("--family", choices=["attention", "hybrid"], default="attention",
                   help="attention: bench_models.attention_model; hybrid: its GDN/attention/Mamba2/GDN model")
    p.add_argument("--device", default="cpu", help="cpu (CPU time, 1 thread) or cuda (wall-clock time, synchronized)")
    p.add_argument("--attention", default="segment", help="tree attention backend (segment | sdpa_dense | flex)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--scale", type=float, default=0.25, help="case lengths relative to agentic.py's")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", nargs="+", default=CASES)
    p.add_argument("--quick", action="store_true", help="a tiny model, two cases, aot_eager, one repetition")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--warm-cache", action="store_true",
                   help="use inductor's usual cache (default: a fresh one, so the compile time is a first compile's)")
    args = p.parse_args(argv)
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compile_")
    if args.quick:
        args.dim, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab = 32, 2, 4, 2, 64, 512
        args.scale, args.reps, args.cases = 0.05, 1, CASES[:2]
        if args.backend == "inductor":
            args.backend = "aot_eager"
    data = run(args)
    print_table(data)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
