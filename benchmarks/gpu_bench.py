"""The training step users run, timed end to end on one GPU: tree vs per-branch vs transformers.

    python benchmarks/gpu_bench.py --out gpu_bench/           # JSON + compile caches under gpu_bench/
    python benchmarks/gpu_bench.py --dry-run --out /tmp/gb    # every row's setup on CPU, tiny shapes

Each row is one model on one tree, in bfloat16 with AdamW, ``attention=auto`` (``flex`` on CUDA)
and activation checkpointing on (``--no-checkpointing``: off), the way a user configures a long
tree. Three steps are timed, each ``zero_grad`` + forward + backward + ``optimizer.step()``, with
CUDA events after a warm-up, median of ``--reps`` (5):

* ``tree``: treelit's tree step (``tree_loss``);
* ``linear``: treelit's per-branch path on the same model (``linear_backward``, padded micro-batches
  of ``--micro-tokens`` tokens);
* ``hf``: the loop users run today: the same weights in ``transformers`` (sdpa attention), branch
  by branch in padded micro-batches (:mod:`hf_peer`).

Per row: step times, speedups, the compute-weighted ideal (:mod:`bench_models`) and the measured
speedup over ``linear`` as a share of it, tokens/s (the branches' tokens the step trains, per
second), an MFU estimate (the step's model FLOPs, forward + backward without the recomputation of
checkpointing, over ``--peak-tflops``, H100/H200 dense bfloat16 by default), each mode's peak memory
(``max_memory_allocated``) and the bfloat16 loss of every mode at the same weights (the warm-up,
before any optimizer step).

Models (random weights, built from their configs, real vocabularies): Qwen3-0.6B, Qwen3-1.7B and a
Qwen3.5-0.8B-shaped hybrid through the transformers adapter with ``ssm=torch`` and ``ssm=fla`` (fla
0.6.0 refuses the gated backward on Hopper under Triton < 3.7.1: that row then records the error).
Trees: a GRPO group (a 4,096-token prompt, 16 completions of 1,024), the tau-bench airline task 0
(real, Qwen-tokenized, 4 trials x 6 calls) and a deep agent tree (27 leaves, 20.8k tree tokens,
POR 0.84, ideal 6.3x by tokens). One more row runs the memory planner on the deep tree under
``torch.cuda.set_per_process_memory_fraction`` (half of the memory the unpartitioned step needed
above the resident state: the weights and AdamW's states, made before it is measured) and gives its
predicted peak against ``max_memory_allocated``: PASS when every step's is within 10%.

Time budget: ``--budget-s`` (420 s, compiles and imports included) from the start of the script, for an
8-minute run: a row starts only while the time it needs remains: ``--row-reserve-s`` (40 s; an
``ssm=fla`` row ``--fla-reserve-s``, 240 s, and never where fla refuses the machine's Triton) or what
the model's last row took (a model not run yet: what the previous row took), whichever is more; a row
stops its repetitions when the next would end past the budget; rows left out are recorded as skipped
(the most wanted run first; the dry run skips a row only once the budget is spent), and the JSON is
written after every row. Triton's and Inductor's caches live under ``<out>/compile_cache`` (reused by the next run
with the same ``--out``; its size is reported and should stay under 64 MiB).
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # the budget counts from here: imports and compiles included

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def _cache_env(out: str) -> str:
    """Point Triton's and Inductor's caches into ``out`` (before torch is imported)."""
    cache = os.path.join(os.path.abspath(out), "compile_cache")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # Triton's autotuning results (fla's kernels) on disk too
    os.environ.setdefault("FLA_CACHE_RESULTS", "1")
    return cache


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_bench", help="folder for gpu_bench.json and compile_cache/")
    p.add_argument("--dry-run", action="store_true", help="every row's setup on CPU with tiny shapes")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--row-reserve-s", type=float, default=40.0, help="start a row only with this much budget left")
    p.add_argument("--fla-reserve-s", type=float, default=240.0,
                   help="start an ssm=fla row only with this much left (fla's autotuning compiles, cold)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--micro-tokens", type=int, default=16384, help="padded tokens per per-branch micro-batch")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bfloat16 peak of the GPU (H100/H200 SXM)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--rows", nargs="*", help="only these rows (model/tree names, see the JSON)")
    return p.parse_args(argv)


if __name__ == "__main__":
    _ARGS = parse()
    _CACHE = _cache_env(_ARGS.out)

import statistics  # noqa: E402
import tempfile  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Callable, Dict, Optional  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from agentic import Case, _Gen  # noqa: E402
from bench_models import compute_weighted_ideal, cost_model  # noqa: E402
from bench_step import agent_tree, grpo_shape  # noqa: E402
from gpu_check import write_json  # noqa: E402

QWEN3_1_7B = dict(family="qwen3", vocab_size=151936, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                  embed_dim=2048, intermediate_dim=6144, max_seq_len=40960, rope_base=1000000.0, norm_eps=1e-6,
                  tie_word_embeddings=True)
# after Qwen3.5-0.8B's text model: 24 layers, (3 Gated DeltaNet : 1 gated attention) x 6
QWEN3_5_0_8B = dict(vocab_size=248320, hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                    max_position_embeddings=40960, tie_word_embeddings=True)
TINY_HYBRID = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                   layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=4096)
TINY_VOCAB = 4096


# -- models: (treelit model, transformers peer, cost model) ---------------------------------------------
def native(preset: Optional[str], cfg: Optional[dict], dev, dry: bool):
    from hf_peer import load_peer

    torch.manual_seed(0)
    if dry:
        model = treelit.build_model("qwen3_tiny", vocab_size=TINY_VOCAB)
    else:
        with torch.device(dev):
            model = treelit.build_model(preset, **(cfg or {}))
    model = model.to(torch.bfloat16)
    peer = load_peer(model, dtype=torch.bfloat16).to(dev)
    return model.to(dev), peer, cost_model(model)


def hybrid(ssm: str, dev, dry: bool):
    import transformers

    from hybrid_families import hf_cost
    from treelit.models.hf_kernels import bind_torch_kernels
    from treelit.ssm import set_ssm_backend

    config = transformers.AutoConfig.for_model("qwen3_5_text", **(TINY_HYBRID if dry else QWEN3_5_0_8B))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        with torch.device(dev):
            transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(d)
        model = treelit.load_hf_model(d, dtype=torch.bfloat16).to(dev)
        peer = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="sdpa")
    peer = peer.to(dev, torch.bfloat16)
    if ssm == "torch":
        bind_torch_kernels(peer)  # transformers' own torch functions; with ssm=fla its default (fla) kernels
    peer.train()
    set_ssm_backend(model, ssm)
    return model, peer, hf_cost(model)


MODELS: Dict[str, Callable] = {
    "qwen3_0.6b": lambda dev, dry: native("qwen3_0_6b", None, dev, dry),
    "qwen3_1.7b": lambda dev, dry: native("qwen3_0_6b", QWEN3_1_7B, dev, dry),
    "qwen3.5_0.8b ssm=torch": lambda dev, dry: hybrid("torch", dev, dry),
    "qwen3.5_0.8b ssm=fla": lambda dev, dry: hybrid("fla", dev, dry),
}


def get_model(name: str, built: dict, dev, dry: bool):
    """``MODELS[name]``, built once while it is on the device: one model at a time on the GPU; in
    the dry run every tiny model is kept, and the two native rows (the same tiny model there) share one."""
    key = "native (tiny)" if dry and name in ("qwen3_0.6b", "qwen3_1.7b") else name
    if key not in built:
        if not dry:
            built.clear()  # one model on the device at a time
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        built[key] = MODELS[name](dev, dry)
    return built[key]


# -- trees ----------------------------------------------------------------------------------------------
def tau_bench(vocab: int, dry: bool) -> Case:
    from real_data import tau_bench_case

    case = tau_bench_case(0, max_calls=1 if dry else 6)
    if dry:  # the trials' first 64 tokens (the shared prompt), then 16 of their own
        case.branches = [b[:64] + b[-16:] for b in case.branches]
        case.masks = [m[:64] + m[-16:] for m in case.masks]
    if max(t for b in case.branches for t in b) >= vocab:  # tiny dry-run vocabulary: re-index injectively
        used = sorted({t for b in case.branches for t in b})
        index = {t: i for i, t in enumerate(used)}
        case.branches = [[index[t] for t in b] for b in case.branches]
    return case


TREES: Dict[str, Callable[[int, bool], Case]] = {
    "grpo_4k_16x1k": lambda V, dry: Case("grpo_4k_16x1k", *grpo_shape(
        _Gen(0, V, 1.0), "assistant", 4 if dry else 16, 24 if dry else 1024, 96 if dry else 4096)),
    "tau_bench_t0": tau_bench,
    "agent_deep_27": lambda V, dry: Case("agent_deep_27", *agent_tree(_Gen(0, V, 0.005 if dry else 2.0), "assistant", 3, 3)),
}
_made: Dict[tuple, Case] = {}


def make_tree(name: str, vocab: int, dry: bool) -> Case:
    """The tree ``name`` for a model of ``vocab`` tokens (made once per run)."""
    if (name, vocab, dry) not in _made:
        _made[name, vocab, dry] = TREES[name](vocab, dry)
    return _made[name, vocab, dry]


# most wanted first: rows the time budget leaves out come last
ORDER = [("qwen3_0.6b", t) for t in TREES] + [("planner", "agent_deep_27"), ("qwen3.5_0.8b ssm=torch", "grpo_4k_16x1k")] + \
    [("qwen3_1.7b", t) for t in TREES] + [("qwen3.5_0.8b ssm=fla", "grpo_4k_16x1k"),
                                          ("qwen3.5_0.8b ssm=torch", "agent_deep_27"),
                                          ("qwen3.5_0.8b ssm=fla", "agent_deep_27")]


# -- timing ---------------------------------------------------------------------------------------------
class Clock:
    """Seconds of a call: CUDA events on a GPU, wall-clock time on CPU (dry run)."""

    def __init__(self, dev) -> None:
        self.cuda = dev.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def set_checkpointing(model, peer, on: bool) -> None:
    model.activation_checkpointing = on
    kind = "activation" if hasattr(peer, "activation_checkpointing_enable") else "gradient"
    if on:
        getattr(peer, f"{kind}_checkpointing_enable")({"use_reentrant": False})


def run_row(model_name: str, tree_name: str, built: dict, args, dev, deadline: float) -> dict:
    from hf_peer import peer_step

    dry = args.dry_run
    model, peer, cost = get_model(model_name, built, dev, dry)
    set_checkpointing(model, peer, args.checkpointing)
    case = make_tree(tree_name, model.vocab_size, dry)
    tree = treelit.TokenTree.from_branches(case.branches, case.masks)
    batch = tree.to_batch()
    stats = tree.stats()
    ideal = compute_weighted_ideal(cost, case.branches, case.masks, batch)
    micro = 512 if dry else args.micro_tokens
    opt = {"model": torch.optim.AdamW(model.parameters(), lr=1e-6), "peer": torch.optim.AdamW(peer.parameters(), lr=1e-6)}
    gpu_batch = batch.to(dev)
    def tree_step():
        loss = treelit.tree_loss(model, gpu_batch, attention="auto")
        loss.backward()
        return float(loss.detach())

    modes = {  # each accumulates the gradients of one step and returns its loss
        "tree": ("model", tree_step),
        "linear": ("model", lambda: treelit.linear_backward(model, case.branches, case.masks, max_tokens=micro)),
        "hf": ("peer", lambda: peer_step(peer, case.branches, case.masks, micro)),
    }
    row = dict(model=model_name, tree=tree_name, **stats, ideal_compute=ideal["ideal_compute"],
               flops_tree=ideal["flops_tree"], flops_flat=ideal["flops_flat"], checkpointing=args.checkpointing,
               micro_tokens=micro, attention="auto")
    clock = Clock(dev)
    losses = {}
    for mode, (which, step) in modes.items():  # warm-up (compiles) at equal weights: the losses, the peaks
        m = model if which == "model" else peer
        m.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out = []
        try:
            row[f"warmup_{mode}_s"] = clock(lambda step=step, out=out: out.append(float(step())))
        except Exception as exc:  # noqa: BLE001 - out of memory, a kernel refused: the other modes still run
            row[f"error_{mode}"] = f"{type(exc).__name__}: {exc}"[:500]
            m.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            continue
        losses[mode] = out[0]
        row[f"peak_mem_{mode}_bytes"] = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
        m.zero_grad(set_to_none=True)
    for mode in losses:
        row[f"loss_{mode}"] = losses[mode]
    if "tree" in losses and "linear" in losses:
        row["loss_rel_diff_tree_linear"] = abs(losses["tree"] - losses["linear"]) / abs(losses["linear"])
    if "tree" in losses and "hf" in losses:
        row["loss_rel_diff_tree_hf"] = abs(losses["tree"] - losses["hf"]) / abs(losses["hf"])
    times = {mode: [] for mode in losses}
    rep_s = 0.0
    for rep in range(1 if dry else args.reps):  # interleaved, so drifts hit every mode
        if rep and time.monotonic() + rep_s > deadline:  # the next repetition would end past the budget
            row["reps_cut_by_budget"] = rep
            break
        t_rep = time.monotonic()
        for mode in times:
            which, step = modes[mode]
            o = opt[which]

            def full_step(o=o, step=step):
                o.zero_grad(set_to_none=True)
                step()
                o.step()
            times[mode].append(clock(full_step))
        rep_s = time.monotonic() - t_rep
    flat_tokens = stats["flat_tokens"]
    for mode, ts in times.items():
        t = statistics.median(ts)
        flops = ideal["flops_tree"] if mode == "tree" else ideal["flops_flat"]
        row.update({f"time_{mode}_s": t, f"times_{mode}_s": ts, f"tokens_per_s_{mode}": flat_tokens / t,
                    f"mfu_{mode}": flops / t / (args.peak_tflops * 1e12)})
    if "time_tree_s" in row:
        for other in ("linear", "hf"):
            if f"time_{other}_s" in row:
                row[f"speedup_vs_{other}"] = row[f"time_{other}_s"] / row["time_tree_s"]
        if "speedup_vs_linear" in row:
            row["efficiency_vs_ideal"] = row["speedup_vs_linear"] / ideal["ideal_compute"]
    for o in opt.values():
        o.zero_grad(set_to_none=True)
    return row


# -- the memory planner under a capped process --------------------------------------------------------
PLANNER_TOLERANCE = 0.10  # the planner's predicted peak against max_memory_allocated


def init_adamw_states(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """AdamW's states (``exp_avg``, ``exp_avg_sq``, ``step``) made now rather than lazily in the first
    step, so that the resident memory measured next holds them: one step on zero gradients with
    weight decay off, which leaves every weight as it was."""
    decay = [g["weight_decay"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, wd in zip(opt.param_groups, decay):
        g["weight_decay"] = wd
    opt.zero_grad(set_to_none=True)
    return opt


def planner_row(built: dict, args, dev) -> dict:
    """Three partitioned steps on the deep tree with the planner choosing the budget, the process
    capped at half the memory the unpartitioned step needed above the resident state."""
    from treelit.lightning.planner import MemoryPlanner
    from treelit.objectives import make_objective
    from treelit.partition import PartitionStats
    from treelit.utils.distributed import Collectives
    from treelit.utils.memory import LiveBytes

    model = get_model("qwen3_0.6b", built, dev, args.dry_run)[0]
    case = make_tree("agent_deep_27", model.vocab_size, args.dry_run)
    batch = treelit.TokenTree.from_branches(case.branches, case.masks).to_batch().to(dev)
    opt = init_adamw_states(torch.optim.AdamW(model.parameters(), lr=1e-6))
    cuda = dev.type == "cuda"
    model.zero_grad(set_to_none=True)
    if cuda:  # the unpartitioned step's peak above the resident state (weights, the peer, AdamW states)
        torch.cuda.empty_cache()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        treelit.tree_loss(model, batch).backward()
        whole = torch.cuda.max_memory_allocated() - resident
    else:
        resident = 0
        with LiveBytes() as live:
            treelit.tree_loss(model, batch).backward()
        whole = live.peak
    model.zero_grad(set_to_none=True)
    cap = resident + whole // 2
    row = dict(row="planner", model="qwen3_0.6b", tree="agent_deep_27", planner=True, unpartitioned_peak_bytes=whole,
               resident_bytes=resident, cap_bytes=cap, steps=[])
    # the planner starts from the unpartitioned step's bytes per token (as after one step it saw)
    per_token = whole / batch.num_tokens
    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        row["memory_fraction"] = cap / total
        torch.cuda.set_per_process_memory_fraction(cap / total)
        planner = MemoryPlanner(fraction=0.9, margin=1.1, initial_bytes_per_token=per_token)
    else:
        planner = MemoryPlanner(memory_limit_bytes=whole // 2, fraction=0.9, margin=1.1, initial_bytes_per_token=per_token)
    # (the model and the objective: the planner's head term, one row of logits per target up to a chunk)
    module = SimpleNamespace(device=dev, budget_tokens=None, last_partition_stats=None, model=model,
                             objective=make_objective("sft"), chunk_rows=None,
                             _comm=lambda: Collectives(device=dev), log_dict=lambda metrics: None)
    mb = SimpleNamespace(micro_batches=[batch])
    try:
        for step in range(1 if args.dry_run else 3):
            predicted_per_token = planner.bytes_per_token
            planner.on_train_batch_start(None, module, mb, step)
            stats = PartitionStats()
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = treelit.tree_backward(model, batch, budget_tokens=module.budget_tokens, stats=stats)
            opt.step()
            module.last_partition_stats = stats
            planner.on_train_batch_end(SimpleNamespace(global_step=step + 1), module, None, mb, step)
            measured = planner.history[-1]["peak"]
            head = planner.head_bytes * planner.head_rows(stats.max_pass_targets)
            predicted = predicted_per_token * stats.max_chain_tokens + head
            row["steps"].append(dict(budget=module.budget_tokens, partitions=stats.partitions,
                                     chain_tokens=stats.max_chain_tokens, pass_targets=stats.max_pass_targets,
                                     head_bytes=head, loss=loss, seconds=time.perf_counter() - t0,
                                     predicted_peak_bytes=predicted, measured_peak_bytes=measured,
                                     measured_over_predicted=measured / predicted if predicted else None,
                                     within_10pct=bool(predicted) and abs(measured / predicted - 1) <= PLANNER_TOLERANCE))
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"OutOfMemoryError: {exc}"[:300]
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    # the check: every step's predicted peak within 10% of the measured one
    row["prediction_within_10pct"] = bool(row["steps"]) and "error" not in row and all(
        s["within_10pct"] for s in row["steps"])
    return row


def fla_refusal(dev) -> Optional[str]:
    """Why fla 0.6.0 will not run its gated backward here (Hopper under Triton 3.4 to 3.7.0), or None."""
    if dev.type != "cuda":
        return None
    import triton
    from packaging.version import Version

    v = Version(triton.__version__)
    if torch.cuda.get_device_capability(dev)[0] == 9 and Version("3.4.0") <= v < Version("3.7.1"):
        return f"fla 0.6.0 refuses the gated backward on Hopper under Triton {v} (< 3.7.1)"
    return None


def row_need(model_name: str, took: Dict[str, float], args) -> float:
    """Seconds to keep in hand before starting a row: the reserve (``--fla-reserve-s`` for an
    ``ssm=fla`` row), or what this model's last row took, or for a model not run yet what the
    previous row took (it also paid for building its model), whichever is more; a row that cannot
    fit is skipped rather than run past the budget."""
    reserve = args.fla_reserve_s if "ssm=fla" in model_name else args.row_reserve_s
    last = took.get(model_name, took.get("", 0.0))
    return max(reserve, last)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main(args=None, cache: Optional[str] = None) -> int:
    args = args if args is not None else parse()
    cache = cache or _cache_env(args.out)
    t_start = _T0
    deadline = t_start + args.budget_s
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if args.dry_run:
        torch.set_num_threads(1)  # tiny shapes: threads cost more than they give
    if dev.type != "cuda" and not args.dry_run:
        print("gpu_bench: no CUDA device (--dry-run runs every row's setup on CPU)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_bench.json")
    results = dict(device=torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (dry run)",
                   torch=torch.__version__, dry_run=args.dry_run, budget_s=args.budget_s, reps=args.reps,
                   peak_tflops=args.peak_tflops, compile_cache=cache, rows=[])
    if dev.type == "cuda":
        import triton

        results["triton"] = triton.__version__
    built: dict = {}
    rows = [r for r in ORDER if not args.rows or r[0] in args.rows or r[1] in args.rows]
    results["elapsed_s"] = time.monotonic() - t_start
    results["compile_cache_bytes"] = dir_bytes(cache) if os.path.isdir(cache) else 0
    took: Dict[str, float] = {}  # the last row's seconds per model ("planner" its own; "": the previous row)
    for model_name, tree_name in rows:
        left = deadline - time.monotonic()
        fla = "ssm=fla" in model_name
        skip = fla_refusal(dev) if fla else None
        need = 0.0 if args.dry_run else row_need(model_name, took, args)  # dry run: only a spent budget skips
        if not skip and left < need:
            skip = f"time budget ({left:.0f} s left, the row needs about {need:.0f} s)"
        if skip:
            results["rows"].append(dict(model=model_name, tree=tree_name, skipped=skip))
            results["elapsed_s"] = time.monotonic() - t_start
            write_json(path, results)
            print(summary(results["rows"][-1]), flush=True)
            continue
        t0 = time.monotonic()
        try:
            if model_name == "planner":
                row = planner_row(built, args, dev)
            else:
                row = run_row(model_name, tree_name, built, args, dev, deadline)
        except Exception as exc:  # noqa: BLE001 - one row's failure must not lose the others
            row = dict(model=model_name, tree=tree_name, error=f"{type(exc).__name__}: {exc}"[:1000])
        row["row_s"] = took[model_name] = took[""] = time.monotonic() - t0
        results["rows"].append(row)
        results["elapsed_s"] = time.monotonic() - t_start
        results["compile_cache_bytes"] = dir_bytes(cache) if os.path.isdir(cache) else 0
        write_json(path, results)
        print(summary(row), flush=True)
    over = results["compile_cache_bytes"] > 64 * 2**20
    print(f"gpu_bench: {results['elapsed_s']:.0f} s of a {args.budget_s:.0f} s budget; compile cache "
          f"{results['compile_cache_bytes'] / 2**20:.1f} MiB{' (over 64 MiB)' if over else ''}; {path}")
    return 0


def summary(row: dict) -> str:
    head = f"{row['model']:<24} {row['tree']:<15}"
    if "skipped" in row or ("error" in row and not row.get("steps")):
        return f"{head} {row.get('skipped') or row.get('error')}"
    if row.get("planner"):
        verdict = "PASS" if row.get("prediction_within_10pct") else "FAIL"
        return head + f" planner {verdict} (predicted peak within 10%): " + "; ".join(
            f"budget {s['budget']} ({s['partitions']} partitions) measured/predicted {s['measured_over_predicted']:.2f}"
            if s["measured_over_predicted"] else f"budget {s['budget']}" for s in row["steps"])
    parts = [f"{m} {row[f'time_{m}_s']:.3f}s" for m in ("tree", "linear", "hf") if f"time_{m}_s" in row]
    extra = f" eff {row['efficiency_vs_ideal']:.2f} of ideal {row['ideal_compute']:.2f}x" if "efficiency_vs_ideal" in row else ""
    return f"{head} {' '.join(parts)}{extra} loss diff {row.get('loss_rel_diff_tree_linear', float('nan')):.1e}"


if __name__ == "__main__":
    sys.exit(main(_ARGS, _CACHE))
