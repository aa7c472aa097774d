"""``segment``'s CUDA code path in bfloat16, measured on CPU against float64 and two references.

    python benchmarks/segment_half.py [--json out.json] [--scale 0.25] [--case NAME ...]

On CUDA, ``segment`` runs a layer as one batch of tiles in plain math (:mod:`treelit.attention.tiled`;
on CPU it takes torch's CPU flash kernels instead). This script runs that CUDA path
on CPU (:func:`cuda_path` sets ``merged.MATH_ON_CPU``) on gpu_check's attention cases (the same trees,
external keys and windows; q ``[1, 8, N, 64]``, k and v ``[1, 2, E + N, 64]``) and gives, per case,
the relative error (max over the output and the q, k, v gradients, for one fixed output gradient)
against float64 attention on the same bfloat16-rounded inputs, of

* ``segment``: the CUDA path in bfloat16;
* ``flash_like``: what flash and flex kernels compute: float32 scores and softmax, the
  probabilities rounded to bfloat16 for ``p @ v`` and the score gradients rounded to bfloat16 for
  ``dq`` and ``dk``, every product accumulated in float32 (:func:`reference_attention`);
* ``fp32_softmax``: everything in float32, only the results rounded to bfloat16.

What this is not: a GPU measurement. CPU matmuls on bfloat16-rounded values stand in for tensor-core
ones (both accumulate in float32, in different orders), and flex's own kernel is emulated, not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from treelit.attention import get_backend, merged  # noqa: E402


@contextlib.contextmanager
def cuda_path():
    """Run ``segment`` on CPU tensors down the path CUDA tensors take (``merged.MATH_ON_CPU``: its
    plans are :mod:`treelit.attention.tiled`'s tiles)."""
    saved = merged.MATH_ON_CPU
    merged.MATH_ON_CPU = True
    try:
        yield
    finally:
        merged.MATH_ON_CPU = saved


def reference_attention(q, k, v, g, mask, work: torch.dtype, round_to: Optional[torch.dtype] = None):
    """Output and q, k, v gradients of masked attention for the output gradient ``g``, computed
    head by head in ``work`` precision (``mask [N, E + N]`` bool, grouped kv heads). With
    ``round_to``, the probabilities are rounded to it before ``p @ v`` and ``p^T g``, and the score
    gradients before ``dq`` and ``dk`` (as flash and flex kernels do); results come back in q's dtype."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    rd = (lambda t: t.to(round_to).to(work)) if round_to is not None else (lambda t: t)  # noqa: E731
    scale = 1.0 / math.sqrt(D)
    o, dq = torch.empty_like(q[0], dtype=work), torch.empty_like(q[0], dtype=work)
    dk, dv = torch.zeros_like(k[0], dtype=work), torch.zeros_like(v[0], dtype=work)
    hidden = ~mask
    for h in range(H):
        j = h // (H // Hkv)
        qh, kh, vh, gh = q[0, h].to(work), k[0, j].to(work), v[0, j].to(work), g[0, h].to(work)
        s = (qh @ kh.T) * scale
        s = s.masked_fill(hidden, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o[h] = rd(p) @ vh
        dv[j] += rd(p).T @ gh
        dp = gh @ vh.T
        ds = p * (dp - (gh * o[h].to(q.dtype).to(work)).sum(-1, keepdim=True))
        dq[h] = (rd(ds) @ kh) * scale
        dk[j] += (rd(ds).T @ qh) * scale
    return tuple(t.to(q.dtype).unsqueeze(0) for t in (o, dq, dk, dv))


def rel_err(got, want) -> float:
    """Max over the tensors of ``|got - want| / |want|`` (Frobenius norms)."""
    return max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(got, want))


def segment_grads(q, k, v, g, layout):
    """``segment`` (on whichever path is active): output and q, k, v gradients for ``g``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    b = get_backend("segment")
    out = b(q, k, v, b.plan(layout))
    return (out.detach(),) + torch.autograd.grad(out, (q, k, v), g)


def case_errors(layout, dtype=torch.bfloat16, heads=8, kv_heads=2, dim=64, seed=0) -> dict:
    """Errors of ``segment``'s CUDA path, the flash-like and the float32-softmax references
    against float64, on random inputs rounded to ``dtype``."""
    N, E = layout.num_queries, layout.num_external
    gen = torch.Generator().manual_seed(seed)
    q, g = (torch.randn(1, heads, N, dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, E + N, dim, generator=gen).to(dtype) for _ in range(2))
    mask = layout.dense_mask()
    truth = reference_attention(q.double(), k.double(), v.double(), g.double(), mask, torch.float64)
    with cuda_path():
        seg = segment_grads(q, k, v, g, layout)
    flash = reference_attention(q, k, v, g, mask, torch.float32, round_to=dtype)
    fp32 = reference_attention(q, k, v, g, mask, torch.float32)
    return dict(tokens=N, external=E, segment=rel_err(seg, truth), flash_like=rel_err(flash, truth),
                fp32_softmax=rel_err(fp32, truth))


def gpu_check_cases(scale: float = 0.25, cases=None):
    """gpu_check's attention cases: ``(case, external keys, window, layout)``."""
    from agentic import make_case
    from gpu_check import layout_with_external

    for case, shape in [("tool_fanout", {}), ("grpo_group", dict(G=16)), ("wide_fanout", {})]:
        if cases and case not in cases:
            continue
        c = make_case(case, scale=scale, **shape)
        batch = treelit.TokenTree.from_branches(c.branches).to_batch()
        for n_ext in (0, 37):
            for window in (None, 64, 300):
                yield case, n_ext, window, layout_with_external(batch, n_ext, window)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--scale", type=float, default=0.25, help="gpu_check's tree scale (0.25)")
    p.add_argument("--case", action="append", help="only this gpu_check case (repeatable)")
    args = p.parse_args(argv)
    rows = []
    for case, n_ext, window, layout in gpu_check_cases(args.scale, args.case):
        row = dict(case=case, window=window, **case_errors(layout))
        row["segment_over_flash_like"] = row["segment"] / row["flash_like"]
        rows.append(row)
        print(f"{case:<12} ext={n_ext:<3} window={str(window):<4} N={row['tokens']:<5} segment {row['segment']:.2e} "
              f"flash-like {row['flash_like']:.2e} fp32-softmax {row['fp32_softmax']:.2e} "
              f"ratio {row['segment_over_flash_like']:.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f, indent=2)
    worst = max(r["segment_over_flash_like"] for r in rows)
    print(f"worst segment / flash-like: {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
