"""LoRA vs full fine-tuning, tree vs per-branch: peak memory, step time, and publishing.

One process, one model shape (``--preset realistic``, bench_step's qwen2-style model: its
vocabulary head costs 0.42x the trunk per trained token, as in Qwen2.5-0.5B). The random model
is saved as a Hugging Face checkpoint and loaded as a user loads a real one: treelit's side with
``treelit.load_hf_model`` (``model=hf_auto``), the peer with ``transformers``. One training
update (forward, loss, backward, AdamW step) of one case runs six ways:

* ``full``: every parameter trains; ``lora``: :func:`treelit.models.lora.apply_lora` (rank 8,
  alpha 16, every linear layer but the head, the base frozen). The adapters start random
  (``init: false``), so that every adapter gradient is non-zero and the gradient check means
  something; PEFT's default (B = 0) costs the same;
* ``tree``: treelit's tree step; ``linear``: treelit's own per-branch path (padded micro-batches,
  a backward each); ``hf``: the loop users run today, the same weights in ``transformers``
  branch by branch (:mod:`hf_peer`), with LoRA wrapped by ``peft.get_peft_model`` with the same
  config and adapter weights.

Memory: each update's peak, split into parameters, gradients, AdamW state and the rest
(activations and temporaries). The optimizer state exists before the measured update, as in
any step after the first; gradients start unset (``zero_grad(set_to_none=True)``), so they are
allocated inside it. Peak = parameters + AdamW state + the peak of the tensors the update
allocates (followed on CPU by :mod:`treelit.utils.memory`); ``act`` = peak - parameters -
gradients - AdamW state. The AdamW steps run with learning rate 0 (the same work as any rate):
the weights never change, so every mode steps from the same weights and the gradients of
the first update compare across modes.

Step time: this process's CPU time on one thread, the median of ``--reps`` updates per mode.
Each repetition runs the six modes with full and LoRA of a path back to back (tree, per-branch,
transformers; odd repetitions in reverse order), so that a drift in machine speed falls on both
sides of a LoRA / full ratio alike; ``*_reps`` in the JSON are each repetition's own ratios.

Publishing: the LoRA model's adapter (:func:`~treelit.models.lora.save_adapter`) against its
merged full weights (:func:`~treelit.models.lora.merged_state_dict`, then
``save_hf_checkpoint``), in the publish dtype, every file and the folder fsync'ed; wall-clock
seconds (it writes to disk), median of ``--publish-reps``, and bytes on disk. For the benchmark
model and for the Qwen2.5-0.5B architecture (random weights, ``--publish-models``).

The default case is real: tau-bench airline task 0, its 4 trials' first model call each
(Qwen2 BPE ids re-indexed into the model's vocabulary, each call trained on its own output, as
in bench_step's ``tau_bench`` case); ``--case`` takes bench_step's synthetic cases too.

    python benchmarks/bench_lora.py --json benchmarks/results/bench_lora.json
    python benchmarks/bench_lora.py --quick           # a tiny model and case, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from bench_models import PRESETS, attention_model, compute_weighted_ideal, cost_model  # noqa: E402
from bench_step import BASE_LINEAR_TOKENS, load_case  # noqa: E402
from treelit.models.lora import apply_lora, merged_state_dict, save_adapter  # noqa: E402
from treelit.utils.memory import LiveBytes  # noqa: E402

MIB = 2**20
QUICK_PRESET = dict(dim=64, layers=2, heads=4, kv_heads=2, intermediate=192, vocab=2048)
TRAININGS = ("full", "lora")
PATHS = ("tree", "linear", "hf")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def lora_config(args) -> Dict:
    return dict(rank=args.rank, alpha=args.alpha, target_modules=args.targets, init=False)


def trainable(model) -> List[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load_peer(path: str):
    """The checkpoint in plain ``transformers`` (sdpa attention), in training mode."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    hf.train()
    return hf


def with_peft(hf, ours):
    """``hf`` wrapped by ``peft.get_peft_model`` with ``ours``' LoRA config, its adapter weights copied in."""
    import peft

    peer = peft.get_peft_model(hf, copy.deepcopy(ours.treelit_lora_config))
    mine = named_trainable(ours)
    theirs = named_trainable(peer)
    if mine.keys() != theirs.keys():
        raise RuntimeError(f"treelit's adapters and PEFT's differ: {sorted(set(mine) ^ set(theirs))[:4]}")
    with torch.no_grad():
        for k, p in theirs.items():
            p.copy_(mine[k])
    return peer


def common_name(name: str) -> str:
    """A parameter's transformers name, from treelit's adapter (``hf.``) or a PEFT model (``base_model.model.``)."""
    for prefix in ("hf.", "base_model.model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def named_trainable(model) -> Dict[str, torch.nn.Parameter]:
    return {common_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def named_grads(model) -> Dict[str, torch.Tensor]:
    return {common_name(n): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise RuntimeError(f"gradients of different parameters: {sorted(set(a) ^ set(b))[:4]}")
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


def warm_optimizer(model, opt) -> None:
    """Create AdamW's state (as any step after the first finds it) without changing the weights."""
    for p in trainable(model):
        p.grad = torch.zeros_like(p)
    opt.step()
    model.zero_grad(set_to_none=True)


def measure(model, opt, fwd_bwd: Callable[[], object]) -> Tuple[Dict, Dict[str, torch.Tensor]]:
    """One update (gradients unset before it) under the tensor tracker: the memory split and the
    gradients it leaves (cloned after the tracked region)."""
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        loss = fwd_bwd()
        peak_fwd_bwd = live.peak
        grads = nbytes(p.grad for p in trainable(model) if p.grad is not None)
    with LiveBytes() as live_step:
        opt.step()
    params = nbytes(model.parameters())
    state = nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    peak = params + state + max(peak_fwd_bwd, grads + live_step.peak)
    out = {"params_bytes": params, "grads_bytes": grads, "adamw_bytes": state,
           "act_bytes": peak - params - grads - state, "peak_bytes": peak,
           "peak_fwd_bwd_bytes": peak_fwd_bwd, "adamw_step_temp_bytes": live_step.peak, "loss": float(loss)}
    return out, named_grads(model)


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def publish_model(name: str, model, dtypes: List[str], reps: int, tmp: Path) -> List[Dict]:
    """Adapter vs merged full weights of a LoRA model, per publish dtype: seconds (wall, median) and bytes."""
    rows = []
    n_params = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
    n_adapter = sum(p.numel() for p in trainable(model))
    for dname in dtypes:
        dtype = DTYPES[dname]
        times = {"adapter": [], "merged": [], "merge": []}
        sizes = {}
        files = {}
        for r in range(reps):
            d = tmp / f"adapter_{r}"
            t0 = time.perf_counter()
            save_adapter(model, d, dtype=dtype)
            fsync_tree(d)
            times["adapter"].append(time.perf_counter() - t0)
            sizes["adapter"], files["adapter"] = disk_bytes(d), sorted(p.name for p in d.iterdir())
            shutil.rmtree(d)
            d = tmp / f"merged_{r}"
            t0 = time.perf_counter()
            merged = merged_state_dict(model, model.state_dict())
            times["merge"].append(time.perf_counter() - t0)
            treelit.save_hf_checkpoint(model, d, state_dict=merged, dtype=dtype)
            del merged
            fsync_tree(d)
            times["merged"].append(time.perf_counter() - t0)
            sizes["merged"], files["merged"] = disk_bytes(d), sorted(p.name for p in d.iterdir())
            shutil.rmtree(d)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"model": name, "params": n_params, "adapter_params": n_adapter, "dtype": dname,
                     "adapter_s": med["adapter"], "merged_s": med["merged"], "merge_s": med["merge"],
                     "adapter_bytes": sizes["adapter"], "merged_bytes": sizes["merged"],
                     "size_ratio": sizes["merged"] / sizes["adapter"], "time_ratio": med["merged"] / med["adapter"],
                     "times_s": times, "files": files})
        print(f"  publish {name} {dname}: adapter {med['adapter']:.3f}s {sizes['adapter'] / MIB:.1f} MiB, merged "
              f"{med['merged']:.2f}s {sizes['merged'] / MIB:.0f} MiB", flush=True)
    return rows


def qwen2_5_0_5b_lora(args, tmp: Path):
    """The Qwen2.5-0.5B architecture (random weights) as a checkpoint, loaded with ``load_hf_model``, with LoRA."""
    torch.manual_seed(0)
    native = treelit.build_model("qwen2_5_0_5b")
    d = tmp / "qwen2_5_0_5b"
    treelit.save_hf_checkpoint(native, d)
    del native
    model = treelit.load_hf_model(d)
    shutil.rmtree(d)
    return apply_lora(model, lora_config(args))


def fmt_mib(b) -> str:
    if b is None:
        return "-"
    m = b / MIB
    return f"{m:.1f}M" if m < 100 else f"{m:.0f}M"


def print_tables(rows: List[Dict], publish: List[Dict]) -> None:
    head = (f"{'train':<6}{'path':<8}{'step':>8}{'/tree':>7}{'lora/full':>10}{'params':>9}{'grads':>9}{'AdamW':>9}"
            f"{'act':>9}{'peak':>9}{'/tree':>7}{'lora/full':>10}{'grad_diff':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        gd = r.get("max_rel_grad_diff")
        print(f"{r['training']:<6}{r['path']:<8}{r['time_s']:>7.2f}s{r['time_vs_tree']:>6.2f}x"
              f"{(format(r['time_lora_over_full'], '.2f') + 'x') if 'time_lora_over_full' in r else '-':>10}"
              f"{fmt_mib(r['params_bytes']):>9}{fmt_mib(r['grads_bytes']):>9}{fmt_mib(r['adamw_bytes']):>9}"
              f"{fmt_mib(r['act_bytes']):>9}{fmt_mib(r['peak_bytes']):>9}{r['peak_vs_tree']:>6.2f}x"
              f"{(format(r['peak_lora_over_full'], '.2f') + 'x') if 'peak_lora_over_full' in r else '-':>10}"
              f"{format(gd, '.1e') if gd is not None else '-':>10}")
    if not publish:
        return
    print()
    head = (f"{'publish':<22}{'params':>9}{'dtype':>10}{'adapter':>9}{'size':>10}{'merged':>9}{'(merge)':>9}{'size':>10}"
            f"{'time x':>8}{'size x':>8}")
    print(head)
    print("-" * len(head))
    for p in publish:
        print(f"{p['model']:<22}{p['params'] / 1e6:>8.1f}M{p['dtype']:>10}{p['adapter_s']:>8.3f}s"
              f"{fmt_mib(p['adapter_bytes']):>10}{p['merged_s']:>8.2f}s{p['merge_s']:>8.2f}s"
              f"{fmt_mib(p['merged_bytes']):>10}{p['time_ratio']:>7.0f}x{p['size_ratio']:>7.0f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write results here")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model (dim 64, vocab 2048) on a small synthetic case, one repetition, publishing "
                        "the benchmark model only")
    p.add_argument("--case", default=None,
                   help="tau_bench (default: real trajectories) or one of bench_step's synthetic attention cases")
    p.add_argument("--tau-calls", type=int, default=1, help="tau_bench: first model calls kept per trial")
    p.add_argument("--scale", type=float, default=None, help="size of a synthetic case (default 0.1; quick 0.02)")
    p.add_argument("--mask", choices=["all", "assistant"], default="all", help="loss mask of a synthetic case")
    p.add_argument("--preset", default="realistic", choices=sorted(PRESETS), help="model shape (see bench_models)")
    for k in ("dim", "layers", "heads", "kv_heads", "intermediate", "vocab"):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"override the preset's {k}")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16, help="LoRA alpha")
    p.add_argument("--targets", default="all-linear", help="LoRA target modules: all-linear or comma-separated names")
    p.add_argument("--reps", type=int, default=None, help="timed updates per mode (default 3; quick 1)")
    p.add_argument("--linear-tokens", type=int, default=None,
                   help="padded tokens per per-branch micro-batch (default 8192; synthetic: 8192 x scale)")
    p.add_argument("--attention", default="auto", help="tree attention backend")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip the transformers (+ PEFT) loop")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--publish-models", default=None,
                   help="comma-separated: bench (the benchmark model), qwen2_5_0_5b (default both; quick: bench); "
                        "'none' skips publishing")
    p.add_argument("--publish-dtypes", default="bfloat16,float32", help="publish dtypes")
    p.add_argument("--publish-reps", type=int, default=None, help="publishes per kind (default 3; quick 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.case = args.case or ("multi_turn" if args.quick else "tau_bench")
    args.scale = args.scale if args.scale is not None else (0.02 if args.quick else 0.1)
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    args.publish_reps = args.publish_reps if args.publish_reps is not None else (1 if args.quick else 3)
    pub = args.publish_models if args.publish_models is not None else ("bench" if args.quick else "bench,qwen2_5_0_5b")
    args.publish = [] if pub == "none" else [m for m in pub.split(",") if m]
    if set(args.publish) - {"bench", "qwen2_5_0_5b"}:
        p.error(f"--publish-models: unknown {sorted(set(args.publish) - {'bench', 'qwen2_5_0_5b'})[0]!r}")
    args.dtypes = [d for d in args.publish_dtypes.split(",") if d]
    if set(args.dtypes) - set(DTYPES):
        p.error(f"--publish-dtypes: one of {', '.join(DTYPES)}")
    if args.case.startswith("hybrid/"):
        p.error("--case: attention cases only (the transformers loop runs qwen2)")
    if args.reps < 1 or args.publish_reps < 1:
        p.error("--reps and --publish-reps must be >= 1")
    if args.targets != "all-linear":
        args.targets = [t for t in args.targets.split(",") if t]
    base = QUICK_PRESET if args.quick else PRESETS[args.preset]
    args.model_cfg = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    args.hybrid_scale = 1.0
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    clock = time.process_time

    c = args.model_cfg
    native = attention_model(**c)
    cost = cost_model(native)
    case, _kind = load_case(args.case, args, c["vocab"])
    tree = treelit.TokenTree.from_branches(case.branches, case.masks)
    batch = tree.to_batch()
    stats = tree.stats()
    ideal = compute_weighted_ideal(cost, case.branches, case.masks, batch)
    micro = args.linear_tokens or (BASE_LINEAR_TOKENS if args.case == "tau_bench"
                                   else max(256, round(BASE_LINEAR_TOKENS * args.scale)))
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    try:
        ckpt = tmp / "base"
        treelit.save_hf_checkpoint(native, ckpt)
        del native
        models = {"full": treelit.load_hf_model(ckpt), "lora": apply_lora(treelit.load_hf_model(ckpt), lora_config(args))}
        peers = {}
        if args.peer:
            peers = {"full": load_peer(str(ckpt)), "lora": with_peft(load_peer(str(ckpt)), models["lora"])}
        n_params = sum(p.numel() for p in models["full"].parameters())
        n_adapter = sum(p.numel() for p in trainable(models["lora"]))
        env = {
            "torch": torch.__version__, "threads": torch.get_num_threads(), "timer": "cpu",
            "cpu": platform.processor() or platform.machine(),
            "model": (f"{'quick' if args.quick else args.preset}: qwen2-style, {c['layers']} layers, dim {c['dim']}, "
                      f"{c['heads']} heads ({c['kv_heads']} kv), MLP {c['intermediate']}, vocab {c['vocab']}, float32, "
                      f"{n_params / 1e6:.1f}M parameters; head/trunk per token {cost['head_over_trunk']:.2f}"),
            "lora": (f"rank {args.rank}, alpha {args.alpha:g}, targets "
                     f"{args.targets if isinstance(args.targets, str) else ','.join(args.targets)}: "
                     f"{n_adapter / 1e6:.2f}M adapter parameters ({100 * n_adapter / n_params:.2f}% of the model)"),
            "case": case.name, "linear_tokens": micro, "reps": args.reps, "attention": args.attention,
            "load_before": os.getloadavg()[0], "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        }
        print(f"# {env['model']}; LoRA {env['lora']}; torch {env['torch']}, {env['threads']} thread, CPU time; "
              f"load {env['load_before']:.1f}")
        print(f"# case {case.name}: {stats['flat_tokens']} flat tokens, {stats['tree_tokens']} tree tokens "
              f"({stats['branches']} branches), ideal_c {ideal['ideal_compute']:.2f}x; per-branch micro-batches of "
              f"{micro} padded tokens", flush=True)

        steps: Dict[Tuple[str, str], Callable[[], float]] = {}
        owners = {}
        for training in TRAININGS:
            model = models[training]

            def tree_step(model=model):
                loss = treelit.tree_loss(model, batch, "token-mean", attention=args.attention)
                loss.backward()
                return float(loss.detach())

            def linear_step(model=model):
                return treelit.linear_backward(model, case.branches, case.masks, aggregation="token-mean",
                                               max_tokens=micro)

            steps[training, "tree"], steps[training, "linear"] = tree_step, linear_step
            owners[training, "tree"] = owners[training, "linear"] = model
            if args.peer:
                from hf_peer import peer_step

                peer = peers[training]
                steps[training, "hf"] = lambda peer=peer: peer_step(peer, case.branches, case.masks, micro)
                owners[training, "hf"] = peer
        opts = {id(m): torch.optim.AdamW(trainable(m), lr=0.0) for m in owners.values()}
        for m in owners.values():
            if not opts[id(m)].state:
                warm_optimizer(m, opts[id(m)])

        # the first update of each mode: warm-up, memory split, gradients
        rows, grads = {}, {}
        order = [(training, path) for path in PATHS for training in TRAININGS if (training, path) in steps]
        for key in order:
            m = owners[key]
            rows[key], grads[key] = measure(m, opts[id(m)], steps[key])
            print(f"  {key[0]}/{key[1]}: peak {fmt_mib(rows[key]['peak_bytes'])}", flush=True)
        times = {key: [] for key in steps}
        for rep in range(args.reps):
            for key in (order if rep % 2 == 0 else order[::-1]):
                m = owners[key]
                m.zero_grad(set_to_none=True)
                t0 = clock()
                steps[key]()
                opts[id(m)].step()
                times[key].append(clock() - t0)
            print(f"  repetition {rep + 1}: " + ", ".join(f"{k[0]}/{k[1]} {times[k][-1]:.2f}s" for k in order),
                  flush=True)
        for m in owners.values():
            m.zero_grad(set_to_none=True)

        out_rows = []
        for (training, path) in order:
            r = {"training": training, "path": path, **rows[training, path], "times_s": times[training, path],
                 "time_s": statistics.median(times[training, path])}
            t_tree = statistics.median(times[training, "tree"])
            r["time_vs_tree"] = r["time_s"] / t_tree
            r["peak_vs_tree"] = r["peak_bytes"] / rows[training, "tree"]["peak_bytes"]
            r["time_vs_tree_reps"] = [a / b for a, b in zip(times[training, path], times[training, "tree"])]
            if path != "tree":
                r["max_rel_grad_diff"] = max_rel_diff(grads[training, path], grads[training, "tree"])
            if training == "lora":
                r["time_lora_over_full"] = r["time_s"] / statistics.median(times["full", path])
                r["peak_lora_over_full"] = r["peak_bytes"] / rows["full", path]["peak_bytes"]
                r["time_lora_over_full_reps"] = [a / b for a, b in zip(times["lora", path], times["full", path])]
            out_rows.append(r)
        summary = {}
        if args.peer:
            t = {k: statistics.median(v) for k, v in times.items()}
            peak = {k: r["peak_bytes"] for k, r in rows.items()}
            summary = {"lora_tree_vs_lora_hf_time": t["lora", "hf"] / t["lora", "tree"],
                       "lora_tree_vs_lora_hf_peak": peak["lora", "hf"] / peak["lora", "tree"],
                       "lora_tree_vs_full_hf_time": t["full", "hf"] / t["lora", "tree"],
                       "lora_tree_vs_full_hf_peak": peak["full", "hf"] / peak["lora", "tree"]}
        del grads, opts, steps, owners, peers, models["full"]

        publish = []
        for name in args.publish:
            if name == "bench":
                publish += publish_model("bench" if not args.quick else "quick", models["lora"], args.dtypes,
                                         args.publish_reps, tmp)
            else:
                big = qwen2_5_0_5b_lora(args, tmp)
                publish += publish_model("qwen2_5_0_5b", big, args.dtypes, args.publish_reps, tmp)
                del big
        env["load_after"] = os.getloadavg()[0]
        print_tables(out_rows, publish)
        if summary:
            print(f"# LoRA tree step against the transformers + PEFT loop: {summary['lora_tree_vs_lora_hf_time']:.2f}x "
                  f"faster, {summary['lora_tree_vs_lora_hf_peak']:.2f}x less peak memory; against full fine-tuning "
                  f"in the transformers loop: {summary['lora_tree_vs_full_hf_time']:.2f}x faster, "
                  f"{summary['lora_tree_vs_full_hf_peak']:.2f}x less")
        print(f"# load average {env['load_before']:.1f} before, {env['load_after']:.1f} after")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "case": {**stats, **ideal, "name": case.name}, "rows": out_rows,
                           "summary": summary, "publish": publish}, f, indent=2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
