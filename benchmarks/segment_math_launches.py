"""What one attention layer of ``segment``'s CUDA code path dispatches, counted on CPU, per tree.

    python benchmarks/segment_math_launches.py [--quick] [--step] [--json out.json]

On CUDA ``segment`` runs a layer as one batch of tiles (:mod:`treelit.attention.tiled`); here that
path runs on CPU tensors (``merged.MATH_ON_CPU``) and :class:`treelit.utils.dispatch.DispatchCounter`
counts, for one layer's forward and backward (float32, 4 query heads on 2 key/value heads), the
kernel launches, host syncs and uploads, and, for the plan built once per forward and shared by the
layers, its uploads and syncs. Also: tiles, and the (query, key) pairs computed over those visible
(the tiles' padding). Trees: GRPO groups, a conversation with a branch at every turn, an agent
fan-out of depth 2 to 4 (three children per node). With ``--step``, whole training steps of a
2-layer tiny model (``tree_loss`` and backward) on four of them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

import treelit
from treelit.attention import merged
from treelit.attention.segment import SegmentAttention
from treelit.attention.tiled import plan_tiles
from treelit.models.context import TreeLayout
from treelit.utils.dispatch import DispatchCounter


def grpo(completions: int, prompt: int = 64, length: int = 24):
    """``completions`` branches of ``length`` tokens under one ``prompt``."""
    token = iter(range(10, 10**7))
    head = [next(token) for _ in range(prompt)]
    return [head + [next(token) for _ in range(length)] for _ in range(completions)]


def turns(n: int, length: int = 12, seed: int = 0):
    """A conversation of ``n`` turns with an alternative turn branching off before each one."""
    rng = random.Random(seed)
    token = iter(range(10, 10**7))
    main, sides = [], []
    for _ in range(n):
        sides.append(main + [next(token) for _ in range(rng.randint(length // 2, length))])
        main = main + [next(token) for _ in range(rng.randint(length // 2, length))]
    return [main] + sides


def fanout(depth: int, k: int = 3, lengths=(3, 9, 17, 30), seed: int = 0):
    """An agent tree: every node has ``k`` children, ``k ** depth`` leaves; segment lengths drawn
    from ``lengths``."""
    rng = random.Random(seed)
    token = iter(range(10, 10**7))
    paths = [[next(token) for _ in range(rng.choice(lengths))]]
    for _ in range(depth):
        paths = [p + [next(token) for _ in range(rng.choice(lengths))] for p in paths for _ in range(k)]
    return paths


TREES = {
    **{f"grpo_{g}": (lambda g=g: grpo(g)) for g in (4, 16, 64)},
    **{f"turns_{n}": (lambda n=n: turns(n)) for n in (8, 32, 128)},
    **{f"fanout_depth_{d}": (lambda d=d: fanout(d, seed=d)) for d in (2, 3, 4)},
}
LARGE = {  # the padding of the tiles at sizes where attention costs something (plans only)
    "grpo_16 (prompt 1024, 512 each)": lambda: grpo(16, 1024, 512),
    "grpo_64 (prompt 1000, 300 each)": lambda: grpo(64, 1000, 300),
    "turns_32 (150-300 a turn)": lambda: turns(32, 300),
    "fanout_depth_3 (4 children, 30-300)": lambda: fanout(3, 4, (30, 100, 300), seed=1),
    "fanout_depth_4 (8-120)": lambda: fanout(4, 3, (8, 30, 120), seed=1),
}
QUICK = ["grpo_4", "grpo_64", "turns_8", "turns_32", "fanout_depth_2", "fanout_depth_4"]


def _layout(branches) -> TreeLayout:
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    return TreeLayout(batch, torch.arange(batch.num_tokens), batch.subtree_end, 0)


def plan_of(branches):
    """The math path's plan of a tree, and its row."""
    layout = _layout(branches)
    return plan_tiles(layout), layout.batch


def layer_counts(branches, heads: int = 4, kv_heads: int = 2, dim: int = 16) -> dict:
    """One layer's attention (forward + backward) and its plan, counted on the math path."""
    layout = _layout(branches)
    batch, N = layout.batch, layout.num_queries
    saved, merged.MATH_ON_CPU = merged.MATH_ON_CPU, True
    try:
        backend = SegmentAttention()
        with DispatchCounter() as planning:
            plan = backend.plan(layout)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, N, dim, generator=g, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, N, dim, generator=g, requires_grad=True) for _ in range(2))
        with DispatchCounter() as layer:
            torch.autograd.grad(backend(q, k, v, plan), (q, k, v), torch.ones(1, heads, N, dim))
    finally:
        merged.MATH_ON_CPU = saved
    visible = plan.exact_pairs()
    return dict(tokens=N, segments=batch.num_segments, tiles=plan.tiles, launches=layer.counts.launches,
                syncs=layer.counts.syncs, uploads=layer.counts.uploads, plan_syncs=planning.counts.syncs,
                plan_uploads=planning.counts.uploads, pairs=plan.cost, visible_pairs=visible,
                padded_over_visible=round(plan.cost / visible, 3))


def step_counts(branches, model) -> dict:
    """A whole training step (``tree_loss`` and its backward) of ``model`` on the math path, after
    one warm-up step."""
    tree = treelit.TokenTree.from_branches(branches)
    saved, merged.MATH_ON_CPU = merged.MATH_ON_CPU, True
    try:
        treelit.tree_loss(model, tree, attention="segment").backward()
        with DispatchCounter() as c:
            treelit.tree_loss(model, tree, attention="segment").backward()
    finally:
        merged.MATH_ON_CPU = saved
    return dict(launches=c.counts.launches, syncs=c.counts.syncs, uploads=c.counts.uploads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="six of the nine trees")
    p.add_argument("--json")
    p.add_argument("--step", action="store_true", help="also count whole steps of a 2-layer tiny model")
    args = p.parse_args(argv)
    rows = []
    print("| tree | segments | tokens | launches / layer (fwd+bwd) | syncs | uploads | plan: syncs, uploads "
          "| tiles | pairs computed / visible |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in QUICK if args.quick else TREES:
        row = dict(tree=name, **layer_counts(TREES[name]()))
        rows.append(row)
        print(f"| {name} | {row['segments']} | {row['tokens']} | {row['launches']} | {row['syncs']} | "
              f"{row['uploads']} | {row['plan_syncs']}, {row['plan_uploads']} | {row['tiles']} | "
              f"{row['padded_over_visible']:.2f} |", flush=True)
    large = []
    if not args.quick:
        print("\n| larger tree | segments | tokens | tiles | pairs computed / visible |\n|---|---|---|---|---|")
        for name, make in LARGE.items():
            plan, batch = plan_of(make())
            row = dict(tree=name, segments=batch.num_segments, tokens=batch.num_tokens, tiles=plan.tiles,
                       padded_over_visible=round(plan.cost / plan.exact_pairs(), 3))
            large.append(row)
            print(f"| {name} | {row['segments']} | {row['tokens']} | {row['tiles']} | "
                  f"{row['padded_over_visible']:.2f} |", flush=True)
    steps = []
    if args.step:
        torch.manual_seed(0)
        model = treelit.build_model("qwen2_tiny", vocab_size=4096)
        print("\n| tree | whole step (qwen2_tiny, 2 layers): launches | syncs | uploads |\n|---|---|---|---|")
        for name in ["grpo_64", "turns_32", "turns_128", "fanout_depth_4"]:
            row = dict(tree=name, **step_counts(TREES[name](), model))
            steps.append(row)
            print(f"| {name} | {row['launches']} | {row['syncs']} | {row['uploads']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, rows=rows, large=large, steps=steps), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
