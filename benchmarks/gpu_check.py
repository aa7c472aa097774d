"""CUDA check of the tree attention backends, prepared to run in one short command.

    python benchmarks/gpu_check.py [--json gpu_check.json]

On a CUDA machine this:
1. compares ``flex`` and ``segment`` with ``sdpa_dense`` on outputs and q/k/v gradients
   (random trees, GQA, with and without external ancestor keys), float32 and bfloat16;
2. compares a tiny model's tree-mode loss and every parameter gradient with ``flex``
   against the per-branch (linearized) baseline;
3. times one attention layer forward+backward per backend on 8k/16k/32k-token trees;
4. compares the fla-kernel recurrent backend with the exact torch backend for Gated
   DeltaNet, Mamba2 and a hybrid model (loss, every gradient) and times both.

Exits with status 1 if any comparison fails; prints a table and writes JSON.
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
from agentic import make_case  # noqa: E402
from treelit.attention import get_backend  # noqa: E402
from treelit.models.context import TreeLayout  # noqa: E402


def layout_with_external(batch, n_ext: int):
    N = batch.num_tokens
    idx = torch.arange(N, device=batch.device)
    if n_ext == 0:
        return TreeLayout(batch, idx, batch.subtree_end, 0)
    lo = torch.zeros(n_ext, dtype=torch.long, device=batch.device)
    hi = torch.full((n_ext,), N, dtype=torch.long, device=batch.device)
    return TreeLayout(batch, torch.cat([lo, idx]), torch.cat([hi, batch.subtree_end]), n_ext)


def compare_attention(name, layout, dtype, seed=0):
    dev = layout.kv_lo.device
    g = torch.Generator(device=dev).manual_seed(seed)
    N, E = layout.num_queries, layout.num_external
    mk = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = mk(1, 8, N, 64), mk(1, 2, E + N, 64), mk(1, 2, E + N, 64)
    ref_b, b = get_backend("sdpa_dense"), get_backend(name)
    ref = ref_b(q, k, v, ref_b.plan(layout))
    gref = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    out = b(q, k, v, b.plan(layout))
    gout = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    errs = [((out - ref).float().norm() / ref.float().norm()).item()]
    errs += [((a - r).float().norm() / r.float().norm()).item() for a, r in zip(gout, gref)]
    return max(errs)


def time_backend(name, layout, reps=3):
    dev = layout.kv_lo.device
    N = layout.num_queries
    q = torch.randn(1, 8, N, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, N, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, N, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = get_backend(name)
    plan = b.plan(layout)
    for i in range(reps + 1):
        if i == 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        b(q, k, v, plan).sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def check_ssm(results) -> bool:
    from treelit.ssm import set_ssm_backend

    ok = True
    results["ssm"] = []
    c = make_case("tool_fanout", scale=0.25, vocab=512)
    tree = treelit.TokenTree.from_branches(c.branches, c.masks)
    for name in ("gdn_tiny", "mamba2_tiny", "hybrid_tiny"):
        torch.manual_seed(0)
        model = treelit.build_model(name, max_seq_len=8192).cuda()
        out = {}
        for backend in ("torch", "fla"):
            set_ssm_backend(model, backend)
            model.zero_grad()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = treelit.tree_loss(model, tree)
            loss.backward()
            torch.cuda.synchronize()
            out[backend] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, time.perf_counter() - t0)
        worst = max(((out["fla"][1][n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in out["torch"][1].items())
        rel = abs(out["fla"][0] - out["torch"][0]) / abs(out["torch"][0])
        passed = rel < 1e-4 and worst < 1e-3
        ok &= passed
        row = dict(model=name, loss_rel_diff=rel, max_rel_grad_diff=worst, time_torch_s=out["torch"][2], time_fla_s=out["fla"][2], passed=passed)
        results["ssm"].append(row)
        print("ssm", row)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    dev = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": [], "timings": []}
    ok = True
    for case, shape in [("tool_fanout", {}), ("grpo_group", dict(G=16)), ("wide_fanout", {})]:
        c = make_case(case, scale=0.25, **shape)
        batch = treelit.TokenTree.from_branches(c.branches).to_batch().to(dev)
        for n_ext in (0, 37):
            layout = layout_with_external(batch, n_ext)
            for name in ("flex", "segment"):
                for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
                    err = compare_attention(name, layout, dtype)
                    passed = err <= tol
                    ok &= passed
                    results["checks"].append(dict(case=case, external=n_ext, backend=name, dtype=str(dtype), rel_err=err, passed=passed))
                    print(f"{case:<12} ext={n_ext:<3} {name:<8} {str(dtype):<15} rel err {err:.2e} {'ok' if passed else 'FAIL'}")
    # end to end: tiny model, flex vs per-branch
    torch.manual_seed(0)
    model = treelit.build_model("qwen2_tiny", vocab_size=512).to(dev)
    c = make_case("dropped_thinking", scale=0.1, vocab=512)
    tree = treelit.TokenTree.from_branches(c.branches, c.masks)
    model.zero_grad()
    loss = treelit.tree_loss(model, tree, attention="flex")
    loss.backward()
    g_tree = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = treelit.linear_loss(model, c.branches, c.masks)
    ref.backward()
    worst = max(((g_tree[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item() for n, p in model.named_parameters())
    passed = abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-4 and worst < 1e-3
    ok &= passed
    results["end_to_end"] = dict(loss_tree=loss.item(), loss_linear=ref.item(), max_rel_grad_diff=worst, passed=passed)
    print(f"end to end (flex vs per-branch): loss {loss.item():.6f} vs {ref.item():.6f}, grad diff {worst:.2e} {'ok' if passed else 'FAIL'}")
    for case, shape in [("wide_fanout", dict(turns=4, k=8)), ("wide_fanout", dict(turns=5, k=16)), ("wide_fanout", dict(turns=9, k=20))]:
        c = make_case(case, **shape)
        batch = treelit.TokenTree.from_branches(c.branches).to_batch().to(dev)
        layout = layout_with_external(batch, 0)
        row = {"tree_tokens": batch.num_tokens, "segments": batch.num_segments}
        for name in ("flex", "segment", "sdpa_dense"):
            try:
                row[name] = time_backend(name, layout)
            except torch.cuda.OutOfMemoryError:
                row[name] = None
                torch.cuda.empty_cache()
        results["timings"].append(row)
        print("timing", row)
    ok &= check_ssm(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print("gpu_check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
