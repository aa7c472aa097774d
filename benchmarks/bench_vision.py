"""Images in trees on a GUI-agent shape: one training step, tree against per-branch.

The shape: an agent episode of ``--turns`` turns, a screenshot (``--width`` x ``--height``, real
size by default: 1280x720) at the start of every turn, then a short instruction and a short
action; the rollout branches in two at turns ``--branch-at`` (2, 4, 6), so 8 branches share their
first two turns, pairs share four, and so on. Every branch node shows its own screenshot (the
screen changes after a different action), so the tree holds each distinct screenshot once.

The model is a Qwen2.5-VL with tiny but proportioned parts (random weights, float32, saved and
loaded as ``model=hf_auto model.vision=true`` loads a checkpoint): a 14-pixel-patch tower with
merge size 2 (a 1280x720 screenshot is 4,784 patches, 1,196 placeholder tokens), window
attention with one full-attention block, and a small text model. Its processor is transformers'
Qwen2-VL image processor (PIL backend).

One step (forward and backward of the token-mean loss over all branches) three ways:

- ``tree``: treelit's tree step, each distinct screenshot encoded once;
- ``branch``: treelit, each branch a row of its own (what per-branch training computes, the same
  code path);
- ``hf``: transformers branch by branch with the processor's inputs (what users run today).

``--family qwen3_5_moe`` runs the same shape on the flagship's model instead (docs/models.md, "The
flagship"): Qwen3.5-MoE-shaped, Gated DeltaNet layers with full attention every 4th, a mixture of
8 experts (top-2) with a shared expert in every layer, a 16-pixel-patch tower; every branch
carries recorded MoE routes (a function of each token's position and id, so branches agree on
their shared prefix) replayed by ``model.moe.routing=replay``, and ``--lora R`` trains LoRA
adapters on the language model and the tower in full (``modules_to_save: [visual]``) as the
flagship does. transformers has no routing replay, so
the ``hf`` row is left out there; ``branch`` is the per-branch reference.

Columns: CPU time of the step (``--threads`` threads, median of ``--reps``), screenshots encoded,
peak tensor memory of the step (:mod:`treelit.utils.memory`; for the per-branch loops the peak of
the whole loop, gradients included), tokens, and the largest relative gradient difference from the
tree step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import treelit  # noqa: E402
from treelit.tree.images import ProcessedImage  # noqa: E402
from treelit.utils.memory import peak_memory  # noqa: E402

IMAGE, VIDEO, START, END = 4000, 4001, 4002, 4003
VOCAB = 4096


ROPE = {"rope_type": "default", "rope_theta": 1e6}
PATCH = {"qwen2_5_vl": 14, "qwen3_5_moe": 16}


def model_config(quick: bool, family: str = "qwen2_5_vl"):
    if family == "qwen3_5_moe":
        width, head = (64, 16) if quick else (128, 32)
        text = dict(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                    num_key_value_heads=2, head_dim=head, linear_key_head_dim=head, linear_value_head_dim=head,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                    moe_intermediate_size=width // 2, shared_expert_intermediate_size=width, num_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=32768,
                    rope_parameters=dict(ROPE, mrope_section=[2, 1, 1] if quick else [2, 3, 3], mrope_interleaved=True,
                                         partial_rotary_factor=0.5))
        vision = dict(depth=2 if quick else 4, hidden_size=32 if quick else 64, intermediate_size=64 if quick else 128,
                      num_heads=2 if quick else 4, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      out_hidden_size=width, num_position_embeddings=2304)
        return text, vision
    text = dict(vocab_size=VOCAB, hidden_size=64 if quick else 128, intermediate_size=128 if quick else 384,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16 if quick else 32,
                max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3] if quick else [4, 6, 6],
                                 "rope_theta": 1e6})
    vision = dict(depth=2 if quick else 4, hidden_size=32 if quick else 64, intermediate_size=64 if quick else 128,
                  num_heads=2 if quick else 4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=text["hidden_size"], window_size=112, fullatt_block_indexes=[1 if quick else 3])
    return text, vision


def checkpoint(path: str, quick: bool, family: str = "qwen2_5_vl") -> None:
    import transformers

    text, vision = model_config(quick, family)
    cfg = transformers.AutoConfig.for_model(family, text_config=text, vision_config=vision,
                                            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                            vision_end_token_id=END)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def screenshot(rng, w: int, h: int):
    from PIL import Image

    img = np.full((h, w, 3), rng.integers(0, 255, 3), dtype=np.uint8)
    for _ in range(12):  # windows, buttons
        y, x = int(rng.integers(0, h - h // 8)), int(rng.integers(0, w - w // 8))
        img[y:y + h // 8, x:x + w // 8] = rng.integers(0, 255, 3)
    img = (img.astype(np.int16) + rng.integers(-8, 8, img.shape)).clip(0, 255).astype(np.uint8)  # noise
    return Image.fromarray(img)


def episode(args):
    """Branches (token ids, loss masks) and their screenshots, as the tree of turns described above."""
    import transformers

    proc = transformers.Qwen2VLImageProcessorPil(patch_size=PATCH[args.family], merge_size=2, temporal_patch_size=2)
    rng = np.random.default_rng(0)
    nodes = {}  # (turn, path bits so far) -> (ProcessedImage, instruction, action)

    def node(turn, bits):
        if (turn, bits) not in nodes:
            out = proc(images=[screenshot(rng, args.width, args.height)], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            im = ProcessedImage(out["pixel_values"], grid, grid[0] * grid[1] * grid[2] // 4, IMAGE)
            nodes[turn, bits] = (im, rng.integers(10, 3900, args.user_tokens).tolist(),
                                 rng.integers(10, 3900, args.action_tokens).tolist())
        return nodes[turn, bits]

    cuts = sorted(args.branch_at)
    n_branches = 2 ** len(cuts)
    branches, masks, images = [], [], []
    for b in range(n_branches):
        ids, mask, ims = [1, 2, 3], [0, 0, 0], []
        for turn in range(args.turns):
            bits = tuple((b >> k) & 1 for k, c in enumerate(cuts) if c <= turn)
            im, user, action = node(turn, bits)
            ids += [START] + [IMAGE] * im.num_tokens + [END] + user
            mask += [0] * (im.num_tokens + 2 + len(user))
            ids += action
            mask += [1] * len(action)
            ims.append(im)
        branches.append(ids)
        masks.append(mask)
        images.append(ims)
    return branches, masks, images


def routes(ids, layers: int = 4, k: int = 2, experts: int = 8) -> np.ndarray:
    """``[len(ids), layers, k]`` distinct sorted expert ids, a function of each token's (position,
    id): branches through a prefix record the same routes for it, as a sampler's would."""
    pos = np.arange(len(ids), dtype=np.int64)[:, None]
    h = (pos * 1_000_003 + np.asarray(ids, dtype=np.int64)[:, None] * 7919 + np.arange(layers)[None] * 104_729)
    h = (h * 2_654_435_761) % (2 ** 31 - 1)
    first = h % experts
    second = (first + 1 + (h // experts) % (experts - 1)) % experts
    return np.sort(np.stack([first, second], -1), -1)[..., :k]


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def max_rel(a, b):
    worst = 0.0
    for k in b:
        d = (a[k] - b[k]).norm().item()
        worst = max(worst, d / max(b[k].norm().item(), 1e-6 * max(g.norm().item() for g in b.values())))
    return worst


def flagship(model, args):
    """The flagship's training set-up on a loaded model: recorded routes replayed, LoRA adapters on
    the language model with the tower trained in full beside them (PEFT's copy)."""
    from treelit.models.factory import set_moe_routing
    from treelit.models.lora import apply_lora

    set_moe_routing(model, "replay")
    if args.lora:
        torch.manual_seed(0)
        apply_lora(model, {"rank": args.lora, "alpha": 2 * args.lora, "init": False, "modules_to_save": ["visual"]})
    return model


def run(args):
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    moe = args.family == "qwen3_5_moe"
    with tempfile.TemporaryDirectory() as d:
        checkpoint(d, args.quick, args.family)
        ours = flagship(treelit.load_hf_model(d, dtype=torch.float32, vision=True), args) if moe else \
            treelit.load_hf_model(d, dtype=torch.float32, vision=True)
        grouped = (treelit.load_hf_model(d, dtype=torch.float32, vision=True,
                                         vision_images_per_pass=args.images_per_pass)
                   if args.images_per_pass else None)
        if grouped is not None and moe:
            grouped = flagship(grouped, args)
        hf = None if moe else transformers.AutoModelForImageTextToText.from_pretrained(
            d, dtype=torch.float32, attn_implementation="sdpa", use_kernels=False)
    if moe and "hf" not in args.skip:
        args.skip = [*args.skip, "hf"]  # (transformers has no routing replay)
    branches, masks, images = episode(args)
    routing = [routes(b) for b in branches] if moe else None
    tree = treelit.TokenTree.from_branches(branches, masks, images=images, routed_experts=routing)
    batch = tree.to_batch()
    Z = float(batch.num_targets)
    stats = tree.stats()
    occurrences = sum(len(i) for i in images)

    def tree_step(model=ours):
        loss = treelit.tree_loss(model, batch, "token-mean", args.attention)
        loss.backward()
        return loss.item()

    def branch_step():
        total = 0.0
        for i, (br, m, ims) in enumerate(zip(branches, masks, images)):
            one = treelit.TokenTree.from_branches([br], [m], images=[ims],
                                                  routed_experts=None if routing is None else [routing[i]]).to_batch()
            loss = treelit.tree_loss(ours, one, "token-mean", args.attention, normalizer=Z)
            loss.backward()
            total += loss.item()
        return total

    def hf_step():
        total = 0.0
        for br, m, ims in zip(branches, masks, images):
            ids = torch.tensor([br])
            hf.model.rope_deltas = None
            out = hf(input_ids=ids, pixel_values=torch.cat([i.pixel_values for i in ims]),
                     image_grid_thw=torch.tensor([list(i.grid_thw) for i in ims]),
                     mm_token_type_ids=(ids == IMAGE).int())
            logp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None]).squeeze(1)
            loss = -(logp * torch.tensor(m[1:], dtype=logp.dtype)).sum() / Z
            loss.backward()
            total += loss.item()
        return total

    rows = []
    ref = None
    modes = [("tree", tree_step, ours, "hf.", tree.images.num_images)]
    if grouped is not None:
        modes.append((f"tree/k{args.images_per_pass}", lambda: tree_step(grouped), grouped, "hf.",
                      tree.images.num_images))
    modes += [("branch", branch_step, ours, "hf.", occurrences), ("hf", hf_step, hf, "", occurrences)]
    for name, fn, model, strip, encoded in modes:
        if name in args.skip:
            continue
        times, peak, loss = [], 0, None
        for _ in range(args.reps):
            model.zero_grad(set_to_none=True)
            before = model.vision.images_encoded if model is not hf else 0
            t0 = time.process_time()
            p, loss = peak_memory(fn, torch.device("cpu"))
            times.append(time.process_time() - t0)
            peak = max(peak, p)
            if model is not hf:
                assert model.vision.images_encoded - before == encoded
        grads = _grads(model, strip)
        if ref is None:
            ref = grads
        rows.append({"mode": name, "step_s": statistics.median(times), "times_s": times, "images_encoded": encoded,
                     "peak_bytes": peak, "loss": loss,
                     "tokens": stats["tree_tokens"] if name.startswith("tree") else stats["flat_tokens"],
                     "max_rel_grad_diff": 0.0 if grads is ref else max_rel(grads, ref)})
    base = rows[0]
    for r in rows:
        r["time_over_tree"] = r["step_s"] / base["step_s"]
        r["peak_over_tree"] = r["peak_bytes"] / base["peak_bytes"]
    text, vision = model_config(args.quick, args.family)
    # (a tower trained beside LoRA adapters is PEFT's copy of it: the model's size counts it once)
    n_params = sum(p.numel() for n, p in ours.named_parameters() if "modules_to_save." not in n)
    n_vis = sum(p.numel() for n, p in ours.vision.visual.named_parameters() if "modules_to_save." not in n)
    return {
        "shape": {"turns": args.turns, "branch_at": sorted(args.branch_at), "width": args.width, "height": args.height,
                  "branches": len(branches), "image_tokens": images[0][0].num_tokens,
                  "patches": int(np.prod(images[0][0].grid_thw)), "distinct_images": tree.images.num_images,
                  "image_occurrences": occurrences, "flat_tokens": stats["flat_tokens"],
                  "tree_tokens": stats["tree_tokens"], "ideal_speedup": stats["ideal_speedup"]},
        "model": {"family": args.family, "text": text, "vision": vision, "params": n_params, "vision_params": n_vis,
                  "lora_rank": args.lora,
                  "trained_params": sum(p.numel() for p in ours.parameters() if p.requires_grad),
                  "routing": "replay" if moe else "live"},
        "env": {"torch": torch.__version__, "threads": args.threads, "clock": "process_time",
                "machine": platform.machine(), "load_before": load_before, "load_after": os.getloadavg()[0]},
        "rows": rows,
    }


NAMES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_5_moe": "Qwen3.5-MoE"}


def _extras(m) -> str:
    out = ""
    if m.get("routing") == "replay":
        out += ", MoE routes replayed"
    if m.get("lora_rank"):
        out += f", LoRA rank {m['lora_rank']} ({m['trained_params'] / 1e3:.1f}k trained)"
    return out


def report(res):
    s, m = res["shape"], res["model"]
    print(f"# GUI-agent episode: {s['turns']} turns, a {s['width']}x{s['height']} screenshot per turn "
          f"({s['patches']} patches, {s['image_tokens']} tokens), branching at turns {s['branch_at']}: "
          f"{s['branches']} branches, {s['distinct_images']} distinct screenshots of {s['image_occurrences']} shown")
    print(f"# {s['flat_tokens']} flat tokens, {s['tree_tokens']} in the tree, ideal speedup {s['ideal_speedup']:.2f}x; "
          f"{NAMES[m.get('family', 'qwen2_5_vl')]}-shaped, {m['params'] / 1e6:.2f}M parameters "
          f"({m['vision_params'] / 1e6:.2f}M in the tower){_extras(m)}, "
          f"float32; torch {res['env']['torch']}, {res['env']['threads']} thread(s), CPU time; "
          f"load {res['env']['load_before']:.1f}")
    print(f"{'mode':9}{'step':>9} {'/tree':>6} {'encoded':>8} {'tokens':>8} {'peak':>9} {'/tree':>6} {'grad_diff':>9}")
    print("-" * 72)
    for r in res["rows"]:
        print(f"{r['mode']:9}{r['step_s']:8.2f}s {r['time_over_tree']:5.2f}x {r['images_encoded']:8d} "
              f"{r['tokens']:8d} {r['peak_bytes'] / 2**20:8.0f}M {r['peak_over_tree']:5.2f}x "
              f"{r['max_rel_grad_diff']:9.1e}")
    print(f"# load average {res['env']['load_before']:.1f} before, {res['env']['load_after']:.1f} after")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--branch-at", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 6])
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--action-tokens", type=int, default=16)
    p.add_argument("--attention", default="segment")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--images-per-pass", type=int, default=0,
                   help="k > 0: also the tree step with model.vision_images_per_pass=k (row tree/kK)")
    p.add_argument("--skip", type=lambda s: s.split(","), default=[], help="modes to leave out (branch,hf)")
    p.add_argument("--family", choices=sorted(PATCH), default="qwen2_5_vl",
                   help="qwen3_5_moe: the flagship's model (Gated DeltaNet + attention, MoE, routes replayed)")
    p.add_argument("--lora", type=int, default=0,
                   help="R > 0: LoRA adapters of rank R and the tower trained (the flagship's set-up)")
    p.add_argument("--quick", action="store_true", help="a smaller model (tests); the shape is set by the options")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if "tree" in args.skip:
        p.error("--skip: the tree step is the reference of every row")
    res = run(args)
    given = sys.argv[1:] if argv is None else argv
    res["env"]["command"] = " ".join(["python", "benchmarks/bench_vision.py", *given])
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
