"""Hybrid transformers families on the step-benchmark cases: Qwen3.5- and Nemotron-H-shaped models.

Each shape is a random transformers model (``from_config``, transformers' own initialisation,
float32) with a real checkpoint's layer pattern and proportions, scaled down so that a CPU run
finishes, and with that checkpoint's vocabulary-head share of the work per trained token
(``d x V`` over the layers' matrix parameters):

* ``qwen3_5``, after Qwen3.5-0.8B (24 layers, 3 Gated DeltaNet : 1 gated attention, every layer
  with a SwiGLU MLP of 3.5x the width; head/trunk about 0.5, counting 16 GDN heads of 128):
  8 layers ``[GDN, GDN, GDN, attention] x 2``, dim 512, attention 8 heads / 2 KV of 128 (output
  gate, partial RoPE), GDN 4 key / 8 value heads of 128, MLP 1792, vocab 32768: head/trunk 0.44;
* ``nemotron_h``, after Nemotron-H-8B (52 blocks of one mixer each: 24 Mamba2, 24 squared-ReLU
  MLPs of 5.25x the width, 4 attention; head/trunk 0.08): 13 blocks ``M-M-M*-M-M-M-`` (6 Mamba2,
  6 MLP, 1 attention), dim 512, Mamba2 16 heads of 64 in 2 groups with state 64, MLP 2688,
  attention 8 heads / 2 KV of 64, vocab 4096: head/trunk 0.08 (a 16k vocabulary at this width
  would give the head 4x the real model's share).

Every case is timed three ways (one step: forward, loss, backward; this process's CPU time, one
thread; ``--reps`` interleaved repetitions, the tree step sampled ``--tree-reps`` times in each;
medians): treelit's tree step through the transformers adapter (``tree``), treelit's per-branch
path on the same model (``linear``: padded causal rows through the same kernels), and the
transformers model itself on its own torch kernels (``bind_torch_kernels``: never fla) branch
by branch in padded micro-batches (``hf``, :mod:`hf_peer`). The compute-weighted ideal is
:mod:`bench_models`' (trunk per token, attention per pair, head per target; the recurrent scans
are not counted).

One extra pass of each mode, before the timed ones, splits its step per layer kind: attention,
recurrent (Gated DeltaNet / Mamba2), MLP, head and the rest (:mod:`layer_split`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Dict, Tuple

import torch

import treelit
from bench_models import compute_weighted_ideal
from bench_step import BASE_LINEAR_TOKENS, case_scale, load_case
from hf_peer import peer_step
from layer_split import mixers, split

HYBRID_CASES = ["hybrid/grpo_group", "hybrid/multi_turn"]

SHAPES: Dict[str, Tuple[str, dict, str]] = {
    "qwen3_5": ("qwen3_5_text", dict(
        vocab_size=32768, hidden_size=512, num_hidden_layers=8, intermediate_size=1792,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=32768, tie_word_embeddings=False),
        "Qwen3.5-shaped: 8 layers (GDN,GDN,GDN,attention)x2, dim 512, attn 8/2 heads x128, GDN 4 k / 8 v heads x128, "
        "MLP 1792, vocab 32768"),
    "nemotron_h": ("nemotron_h", dict(
        vocab_size=4096, hidden_size=512, layers_block_type=[
            {"M": "mamba", "-": "mlp", "*": "attention"}[c] for c in "M-M-M*-M-M-M-"],
        intermediate_size=2688, num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_num_heads=16,
        mamba_head_dim=64, n_groups=2, ssm_state_size=64, conv_kernel=4, chunk_size=128, expand=2,
        max_position_embeddings=32768, tie_word_embeddings=False),
        "Nemotron-H-shaped: 13 blocks M-M-M*-M-M-M- (6 Mamba2, 6 MLP, 1 attention), dim 512, Mamba2 16 heads x64, "
        "2 groups, state 64, MLP 2688 (relu2), attn 8/2 heads x64, vocab 4096"),
}


def build(shape: str, dtypes=(torch.float32,)):
    """``{dtype: (tree model, transformers model on its torch kernels)}``, all with the same
    random weights (one float32 checkpoint)."""
    import transformers

    from treelit.models.hf_kernels import bind_torch_kernels

    model_type, cfg, _ = SHAPES[shape]
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        for dtype in dtypes:
            ours = treelit.load_hf_model(d, dtype=dtype)
            # (.to: parameters a family keeps in float32 follow dtype, as in the adapter)
            peer = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="sdpa")
            peer = peer.to(dtype)
            if bind_torch_kernels(peer) == 0:
                raise RuntimeError(f"{shape}: no hybrid layer bound to transformers' torch kernels")
            peer.train()
            out[dtype] = (ours, peer)
    return out


def hf_cost(model) -> Dict[str, float]:
    """:func:`bench_models.cost_model` for an adapted transformers model (FLOPs, forward + backward)."""
    c = model.hf.config
    trunk = sum(p.numel() for n, p in model.named_parameters()
                if n.startswith("hf.model.layers.") and p.dim() >= 2)
    n_attn = len(mixers(model.layers)["attention"])
    d, V = c.hidden_size, c.vocab_size
    return {"per_token": 3 * 2.0 * trunk, "per_pair": 3 * 4.0 * c.num_attention_heads * c.head_dim * n_attn,
            "per_target": 3 * 2.0 * d * V, "trunk_params": float(trunk), "head_over_trunk": d * V / trunk}


# -- one case ------------------------------------------------------------------------------------------
def grads_of(model, strip: str = "") -> Dict[str, torch.Tensor]:
    g = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return g


def max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise RuntimeError(f"gradients of different parameters: {sorted(set(a) ^ set(b))[:4]}")
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


def run_case(shape: str, name: str, ours, peer, args) -> Dict:
    case, kind = load_case(name, args, ours.vocab_size)
    tree = treelit.TokenTree.from_branches(case.branches, case.masks)
    batch = tree.to_batch()
    micro = max(256, round(BASE_LINEAR_TOKENS * case_scale(kind, args)))
    ideal = compute_weighted_ideal(hf_cost(ours), case.branches, case.masks, batch)

    def tree_step():
        treelit.tree_loss(ours, batch).backward()

    def linear_step():
        treelit.linear_backward(ours, case.branches, case.masks, max_tokens=micro)

    def hf_step():
        peer_step(peer, case.branches, case.masks, micro)

    modes = {"tree": (ours, tree_step, "treelit", "hf."), "linear": (ours, linear_step, "treelit", "hf."),
             "hf": (peer, hf_step, "hf", "")}
    tree_step()  # warm-up at this case's size (the per-branch modes' micro-batches warmed up in warm_up)
    ours.zero_grad(set_to_none=True)
    parts, split_grads = {}, {}
    for mode, (m, step, head, strip) in modes.items():  # the split pass
        parts[mode] = split(step, m, head)
        split_grads[mode] = grads_of(m, strip)
    times = {mode: [] for mode in modes}
    grads = {}
    for rep in range(args.reps):
        for mode, (m, step, _, strip) in modes.items():  # interleaved: drifts in machine load hit every mode
            # the tree step, several times shorter than the others, is sampled --tree-reps times per repetition
            for _ in range(args.tree_reps if mode == "tree" else 1):
                m.zero_grad(set_to_none=True)
                t0 = time.process_time()
                step()
                times[mode].append(time.process_time() - t0)
                if mode not in grads:
                    grads[mode] = grads_of(m, strip)
            m.zero_grad(set_to_none=True)
    med = {mode: statistics.median(t) for mode, t in times.items()}
    stats = tree.stats()
    return {
        "model": shape, "name": case.name, "flat_tokens": stats["flat_tokens"], "tree_tokens": stats["tree_tokens"],
        "segments": int(batch.num_segments), "linear_tokens": micro, **ideal, "times_s": times,
        **{f"time_{m}_s": t for m, t in med.items()},
        "measured_speedup": med["linear"] / med["tree"], "efficiency": med["linear"] / med["tree"] / ideal["ideal_compute"],
        "speedup_vs_hf": med["hf"] / med["tree"], "split": parts,
        "grad_diff_linear": max_rel_diff(grads["tree"], grads["linear"]),
        "grad_diff_hf": max_rel_diff(grads["tree"], grads["hf"]),
        "split_grad_diff": max(max_rel_diff(split_grads[m], grads[m]) for m in modes),
    }


def warm_up(ours, peer) -> None:
    """One tiny step of each mode (one-time costs: imports, kernel binding, allocator)."""
    branches = [[1, 5, 6, 7, 8] * 40, [1, 5, 6, 9, 10, 11] * 30]
    masks = [[1] * len(b) for b in branches]
    treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks).to_batch()).backward()
    treelit.linear_backward(ours, branches, masks, max_tokens=256)
    peer_step(peer, branches, masks, 256)
    ours.zero_grad(set_to_none=True)
    peer.zero_grad(set_to_none=True)


def print_rows(rows) -> None:
    head = (f"{'model':<11}{'case':<19}{'flat':>6}{'tree':>6}{'ideal_c':>8}{'t_tree':>8}{'t_lin':>8}{'t_hf':>8}"
            f"{'measured':>9}{'eff':>6}{'vs_hf':>7}{'grad_lin':>9}{'grad_hf':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<11}{r['name']:<19}{r['flat_tokens']:>6}{r['tree_tokens']:>6}{r['ideal_compute']:>7.2f}x"
              f"{r['time_tree_s']:>7.2f}s{r['time_linear_s']:>7.2f}s{r['time_hf_s']:>7.2f}s"
              f"{r['measured_speedup']:>8.2f}x{r['efficiency']:>6.2f}{r['speedup_vs_hf']:>6.2f}x"
              f"{r['grad_diff_linear']:>9.1e}{r['grad_diff_hf']:>9.1e}")
    print()
    cols = ("attention", "recurrent", "mlp", "head", "other", "total")
    print(f"{'split (CPU s)':<30}{'mode':<8}" + "".join(f"{c:>10}" for c in cols))
    for r in rows:
        label = f"{r['model']} {r['name']}"
        for mode in ("tree", "linear", "hf"):
            p = r["split"][mode]
            print(f"{label:<30}{mode:<8}" + "".join(f"{p[c]:>9.2f}s" for c in cols))
            label = ""
        t, lin = r["split"]["tree"], r["split"]["linear"]
        print(f"{'':<30}{'lin/tree':<8}" + "".join(f"{lin[c] / t[c]:>9.2f}x" if t[c] > 0 else f"{'-':>10}" for c in cols)
              + f"   (tokens {r['flat_tokens'] / r['tree_tokens']:.2f}x, targets "
                f"{r['targets_flat'] / r['targets_tree']:.2f}x, ideal_c {r['ideal_compute']:.2f}x)")


def main(args) -> Dict:
    """Every case of ``args.cases`` on every shape of ``args.hybrid``; returns the JSON document."""
    import json
    import os
    import platform
    import sys

    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "scale": args.scale,
           "hybrid_scale": args.scale * args.hybrid_scale, "reps": args.reps, "tree_reps": args.tree_reps,
           "load_before": os.getloadavg()[0],
           "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "models": {}}
    rows = []
    doc = {"env": env, "cases": rows, "complete": False}
    for shape in args.hybrid.split(","):
        ours, peer = build(shape)[torch.float32]
        cost = hf_cost(ours)
        env["models"][shape] = {"description": SHAPES[shape][2], "trunk_params": cost["trunk_params"],
                                "head_over_trunk": cost["head_over_trunk"]}
        print(f"# {SHAPES[shape][2]}; trunk {cost['trunk_params'] / 1e6:.1f}M parameters, head/trunk per token "
              f"{cost['head_over_trunk']:.2f}; torch {env['torch']}, 1 thread, CPU time; cases at scale "
              f"{env['hybrid_scale']:g}; load {os.getloadavg()[0]:.1f}", flush=True)
        warm_up(ours, peer)
        for name in args.cases.split(","):
            rows.append(run_case(shape, name, ours, peer, args))
            r = rows[-1]
            print(f"  {shape} {r['name']}: {r['measured_speedup']:.2f}x vs per-branch (ideal_c "
                  f"{r['ideal_compute']:.2f}x, eff {r['efficiency']:.2f}), {r['speedup_vs_hf']:.2f}x vs transformers",
                  flush=True)
            if args.json:  # partial results survive an interrupted run
                with open(args.json, "w") as f:
                    json.dump(doc, f, indent=2)
        del ours, peer
    env["load_after"] = os.getloadavg()[0]
    print_rows(rows)
    print(f"# load average {env['load_before']:.1f} before, {env['load_after']:.1f} after; split pass gradients vs "
          f"timed passes max rel diff {max(r['split_grad_diff'] for r in rows):.1e}")
    doc["complete"] = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


def precision(args) -> None:
    """Float32 gradients of both sides against a float64 reference (``--precision``): the tree step
    and the transformers loop on each case, every model in float32 and in float64 (transformers'
    float32 upcasts kept in float64, ``tests/float64_mode.py``); prints the largest relative
    parameter-gradient differences and where they are."""
    import contextlib
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from float64_mode import KeepFloat64

    for shape in args.hybrid.split(","):
        models = build(shape, (torch.float32, torch.float64))
        for name in args.cases.split(","):
            case, kind = load_case(name, args, models[torch.float32][0].vocab_size)
            batch = treelit.TokenTree.from_branches(case.branches, case.masks).to_batch()
            micro = max(256, round(BASE_LINEAR_TOKENS * case_scale(kind, args)))
            g = {}
            for dtype, (ours, peer) in models.items():
                with KeepFloat64() if dtype == torch.float64 else contextlib.nullcontext():
                    treelit.tree_loss(ours, batch).backward()
                    peer_step(peer, case.branches, case.masks, micro)
                g["tree", dtype], g["hf", dtype] = grads_of(ours, "hf."), grads_of(peer)
            ref = g["tree", torch.float64]

            def worst(a):
                r = {k: ((a[k].double() - ref[k]).norm() / ref[k].norm().clamp_min(1e-300)).item() for k in ref}
                k = max(r, key=r.get)
                return f"{r[k]:.1e} ({k})"

            print(f"{shape} {case.name}: float64 tree vs transformers "
                  f"{max_rel_diff(g['tree', torch.float64], g['hf', torch.float64]):.1e}; against float64, "
                  f"float32 tree {worst(g['tree', torch.float32])}, float32 transformers "
                  f"{worst(g['hf', torch.float32])}", flush=True)
