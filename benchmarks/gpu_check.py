"""CUDA check of the tree attention backends, prepared to run in one short command.

    python benchmarks/gpu_check.py [--json gpu_check.json] [--step NAME ...] [--dry-run]

On a CUDA machine this:
1. compares ``flex`` and ``segment`` with ``sdpa_dense`` on outputs and q/k/v gradients
   (random trees, GQA, with and without external ancestor keys, without and with sliding
   windows), float32 and bfloat16 (there ``segment`` within 1.5x ``flex``'s error);
2. compares tiny models' tree-mode loss and every parameter gradient with ``flex``
   against the per-branch (linearized) baseline: Qwen2, Qwen3-MoE with its router loss
   and a sliding window, and a Qwen3 checkpoint through the transformers adapter;
3. times one attention layer forward+backward per backend on 8k/16k/32k-token trees;
4. compares the fla-kernel recurrent backend with the exact torch backend for Gated
   DeltaNet, Mamba2 and a hybrid model (loss, every gradient) and times both;
5. the same for transformers' hybrids through the adapter (tiny Qwen3.5, Nemotron-H and
   Kimi-Linear checkpoints): ``ssm=fla`` (fla's ``chunk_gated_delta_rule`` / ``chunk_kda``,
   mamba-ssm's ``mamba_chunk_scan_combined``) vs ``ssm=torch``, unpartitioned and
   partitioned, loss and every gradient, timed (needs the ``cuda`` extra: fla, mamba-ssm).

Each of the steps (``attention``, ``models``, ``timings``, ``ssm``, ``hybrid_adapters``) runs on its
own: an exception fails that step only, the JSON is written after every step, and a failed step
prints the command that reruns it (``--step NAME``). ``--dry-run`` goes through every step's
wrapper and JSON write without running the checks (on any machine; the test suite runs it).

float32 is compared like with like: Triton's ``tl.dot`` defaults to TF32 on NVIDIA, which puts fla's
and mamba-ssm's float32 kernels ~1e-3..1e-2 away from IEEE torch (measured under Triton's
interpreter with TF32 emulated: 1.9e-3 gdn_tiny, 9.7e-3 mamba2_tiny); ``TRITON_F32_DEFAULT=ieee``
is set before anything imports Triton. fla's optional FlashQLA / FlashKDA backends
(``flash_qla`` / ``flash_kda`` packages, taken for bf16/fp16 with K = V = 128 when installed) are
switched off with ``FLA_FLASH_QLA=0`` / ``FLA_FLASH_KDA=0``: ``ssm=fla`` is checked on fla's own
Triton kernels, the ones its routing was written against.

Exits with status 1 if any step fails; prints a table and writes JSON.
"""

from __future__ import annotations

import os

# before torch / Triton / fla are imported (see the module docstring)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_FLASH_KDA", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Callable, Dict, Optional  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from agentic import make_case  # noqa: E402
from treelit.attention import get_backend  # noqa: E402
from treelit.models.context import TreeLayout  # noqa: E402
from treelit.models.factory import set_router_aux_loss  # noqa: E402


def layout_with_external(batch, n_ext: int, window=None):
    """Row keys plus ``n_ext`` external keys standing for an ancestor path above the row (at
    depths -n_ext..-1: the row's positions are shifted by n_ext), optionally windowed."""
    N = batch.num_tokens
    dev = batch.device
    idx = torch.arange(N, device=dev)
    if n_ext == 0:
        return TreeLayout(batch, idx, batch.subtree_end, 0, batch.position_ids).with_window(window)
    batch = treelit.TreeBatch(**{**batch.__dict__, "position_ids": batch.position_ids + n_ext})
    lo = torch.zeros(n_ext, dtype=torch.long, device=dev)
    hi = torch.full((n_ext,), N, dtype=torch.long, device=dev)
    kv_pos = torch.cat([torch.arange(n_ext, device=dev), batch.position_ids])
    return TreeLayout(batch, torch.cat([lo, idx]), torch.cat([hi, batch.subtree_end]), n_ext, kv_pos).with_window(window)


def model_check(results, what, model, tree, branches, masks) -> bool:
    """Tree mode with ``flex`` vs the per-branch baseline: loss and every parameter gradient."""
    model.zero_grad()
    loss = treelit.tree_loss(model, tree, attention="flex")
    loss.backward()
    g_tree = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = treelit.linear_loss(model, branches, masks)
    ref.backward()
    g_ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    scale = max(g.norm().item() for g in g_ref.values())
    worst = max(((g_tree[n] - g).norm() / g.norm().clamp_min(1e-5 * scale)).item() for n, g in g_ref.items())
    passed = abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-4 and worst < 1e-3 and g_tree.keys() == g_ref.keys()
    results.setdefault("end_to_end", []).append(dict(model=what, loss_tree=loss.item(), loss_linear=ref.item(),
                                                     max_rel_grad_diff=worst, passed=passed))
    print(f"end to end {what} (flex vs per-branch): loss {loss.item():.6f} vs {ref.item():.6f}, grad diff {worst:.2e} "
          f"{'ok' if passed else 'FAIL'}")
    return passed


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


def check_ssm(results, dev="cuda") -> bool:
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


ADAPTER_BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
ADAPTER_HYBRIDS = {  # name -> (model_type, config): the layers ssm=fla routes to fla / mamba-ssm
    "qwen3_5 (Gated DeltaNet, grouped value heads)": ("qwen3_5_text", dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4)),
    "nemotron_h (Mamba2, n_groups 2)": ("nemotron_h", dict(
        layers_block_type=["mamba", "attention", "moe", "mamba"], ssm_state_size=64, mamba_num_heads=8,
        mamba_head_dim=32, n_groups=2, conv_kernel=4, chunk_size=64, use_conv_bias=True, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, moe_shared_expert_intermediate_size=128)),
    "kimi_linear (KDA)": ("kimi_linear", dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_num_heads=4, linear_head_dim=64,
        linear_conv_kernel_dim=4, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=1)),
}


def _backend_run(model, tree, budget, sync):
    """(loss, gradients, seconds) of one forward+backward, after a warm-up pass."""
    for _ in range(2):  # warm-up (Triton compiles on first use), then the timed pass
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        if budget is None:
            loss = treelit.tree_loss(model, tree)
            loss.backward()
            loss = loss.item()
        else:
            loss = treelit.tree_backward(model, tree, budget_tokens=budget)
        sync()
        seconds = time.perf_counter() - t0
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, seconds


def check_hybrid_adapters(results, dev="cuda") -> bool:
    """Tiny transformers hybrids through the adapter: ssm=fla vs ssm=torch (loss 1e-4, every
    gradient 1e-3 relative), unpartitioned and partitioned at the longest branch, each timed.
    A family that raises is reported as failed and the others still run."""
    import tempfile

    import transformers
    from treelit.ssm import set_ssm_backend

    ok = True
    results["hybrid_adapters"] = []
    c = make_case("tool_fanout", scale=0.25, vocab=ADAPTER_BASE["vocab_size"])
    tree = treelit.TokenTree.from_branches(c.branches, c.masks)
    longest = max(len(b) for b in c.branches)
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    for what, (model_type, cfg) in ADAPTER_HYBRIDS.items():
        model = None
        for budget in (None, longest):
            row = dict(model=what, tree_tokens=tree.num_tokens, partition_budget=budget)
            try:
                if model is None:  # a transformers-written checkpoint, loaded by the adapter
                    with tempfile.TemporaryDirectory() as d:
                        torch.manual_seed(0)
                        config = transformers.AutoConfig.for_model(model_type, **ADAPTER_BASE, **cfg)
                        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)
                        model = treelit.load_hf_model(d, dtype=torch.float32).to(dev)
                out = {b: _backend_run(set_ssm_backend(model, b), tree, budget, sync) for b in ("torch", "fla")}
                (ref, g_ref, t_ref), (got, g_fla, t_fla) = out["torch"], out["fla"]
                scale = max(g.norm().item() for g in g_ref.values())
                worst = max(((g_fla[n] - g).norm() / g.norm().clamp_min(1e-5 * scale)).item()
                            for n, g in g_ref.items())
                rel = abs(got - ref) / abs(ref)
                row.update(loss_rel_diff=rel, max_rel_grad_diff=worst, time_torch_s=t_ref, time_fla_s=t_fla,
                           passed=rel < 1e-4 and worst < 1e-3 and g_fla.keys() == g_ref.keys())
            except Exception as exc:  # noqa: BLE001 - reported, and the other families still run
                row.update(error=f"{type(exc).__name__}: {exc}"[:500], passed=False)
            ok &= row["passed"]
            results["hybrid_adapters"].append(row)
            print("hybrid adapter", row)
    return ok


SEGMENT_OVER_FLEX = 1.5  # segment's bfloat16 error at most this times flex's on the same case


def step_attention(results, dev) -> bool:
    """``flex`` and ``segment`` against ``sdpa_dense``: outputs and q/k/v gradients; in bfloat16,
    ``segment``'s error also within :data:`SEGMENT_OVER_FLEX` times ``flex``'s on the same case."""
    ok = True
    results["checks"] = []
    for case, shape in [("tool_fanout", {}), ("grpo_group", dict(G=16)), ("wide_fanout", {})]:
        c = make_case(case, scale=0.25, **shape)
        batch = treelit.TokenTree.from_branches(c.branches).to_batch().to(dev)
        for n_ext in (0, 37):
            for window in (None, 64, 300):
                layout = layout_with_external(batch, n_ext, window)
                flex_err = {}
                for name in ("flex", "segment"):
                    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
                        err = compare_attention(name, layout, dtype)
                        passed = err <= tol
                        row = dict(case=case, external=n_ext, window=window, backend=name, dtype=str(dtype),
                                   rel_err=err)
                        if name == "flex":
                            flex_err[dtype] = err
                        elif dtype == torch.bfloat16:
                            row["over_flex"] = err / flex_err[dtype]
                            passed &= row["over_flex"] <= SEGMENT_OVER_FLEX
                        ok &= passed
                        results["checks"].append(dict(row, passed=passed))
                        print(f"{case:<12} ext={n_ext:<3} window={str(window):<4} {name:<8} {str(dtype):<15} "
                              f"rel err {err:.2e}" + (f" ({row['over_flex']:.2f}x flex)" if "over_flex" in row else "")
                              + f" {'ok' if passed else 'FAIL'}")
    return ok


def step_models(results, dev) -> bool:
    """Tiny models end to end: tree mode with ``flex`` against per-branch training."""
    import tempfile

    c = make_case("dropped_thinking", scale=0.1, vocab=512)
    tree = treelit.TokenTree.from_branches(c.branches, c.masks)
    torch.manual_seed(0)
    ok = model_check(results, "qwen2_tiny", treelit.build_model("qwen2_tiny", vocab_size=512).to(dev), tree,
                     c.branches, c.masks)
    torch.manual_seed(0)
    moe = treelit.build_model("qwen3_moe_tiny", vocab_size=512, sliding_window=48).to(dev)
    set_router_aux_loss(moe, 0.01, "sequence")
    ok &= model_check(results, "qwen3_moe_tiny (router loss, window 48)", moe, tree, c.branches, c.masks)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        treelit.save_hf_checkpoint(treelit.build_model("qwen3_tiny", vocab_size=512), d)
        adapted = treelit.load_hf_model(d).to(dev)
        ok &= model_check(results, "qwen3 through the transformers adapter", adapted, tree, c.branches, c.masks)
    return ok


def step_timings(results, dev) -> bool:
    """One attention layer forward+backward per backend on 8k-32k-token trees (timed, not checked)."""
    results["timings"] = []
    for case, shape in [("wide_fanout", dict(turns=4, k=8)), ("wide_fanout", dict(turns=5, k=16)),
                        ("wide_fanout", dict(turns=9, k=20))]:
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
    return True


STEPS: Dict[str, Callable[..., bool]] = {
    "attention": step_attention,
    "models": step_models,
    "timings": step_timings,
    "ssm": check_ssm,
    "hybrid_adapters": check_hybrid_adapters,
}


def write_json(path: Optional[str], results: dict) -> None:
    """``results`` to ``path`` through a temporary name (a run stopped mid-write keeps the previous file)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)


def run_steps(steps: Dict[str, Callable[..., bool]], results: dict, json_path: Optional[str], dev,
              dry_run: bool = False) -> bool:
    """Run each step on its own: an exception fails that step only (its traceback is kept), the JSON
    is written after every step, and a failed step prints the command that reruns it."""
    ok = True
    status = results.setdefault("steps", {})
    for name, fn in steps.items():
        t0 = time.perf_counter()
        row: dict = {}
        try:
            passed = True if dry_run else bool(fn(results, dev))
            row["status"] = "dry-run" if dry_run else ("passed" if passed else "FAILED")
        except Exception as exc:  # noqa: BLE001 - one step's failure must not lose the others
            passed = False
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:1000],
                       traceback=traceback.format_exc()[-4000:])
            print(f"step {name}: {type(exc).__name__}: {exc}")
        row["seconds"] = round(time.perf_counter() - t0, 2)
        status[name] = row
        ok &= passed
        write_json(json_path, results)
        if not passed:
            rerun = f"python benchmarks/gpu_check.py --step {name}" + (f" --json {json_path}" if json_path else "")
            print(f"step {name} {row['status']}; rerun it alone: {rerun}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--step", action="append", choices=sorted(STEPS), help="run only this step (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="go through every step's wrapper and JSON write without running the checks")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print("gpu_check: no CUDA device; nothing to check (--dry-run exercises the steps' wrappers)")
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (dry run)",
               "torch": torch.__version__, "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
               "dry_run": args.dry_run}
    steps = {k: v for k, v in STEPS.items() if not args.step or k in args.step}
    ok = run_steps(steps, results, args.json, dev, dry_run=args.dry_run)
    print("gpu_check:", "PASSED" if ok else "FAILED", {k: v["status"] for k, v in results["steps"].items()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
