"""A tiny random Qwen3.5-MoE-shaped vision checkpoint and GRPO-shaped image groups for the flagship recipe.

    python examples/tiny_flagship.py OUT

writes ``OUT/checkpoint``: a multimodal hybrid with the real layer pattern of Qwen3.5-MoE (Gated
DeltaNet layers with full attention every 4th layer, every MLP a mixture of 8 experts, top-2, with
a gated shared expert) and a 2-block vision tower, random weights, Qwen's tokenizer with its
vision tokens and a small image processor (4-pixel patches, merge size 2); and ``OUT/data``:
``squares/*.png`` and ``groups.jsonl``, rollout groups of a visual task whose reward depends on
the image: a prompt shows a 32x32 picture of a coloured square and asks for its colour, each
completion names a colour, the reward is 1 when it names the square's. Each record is one
prompt's group; each of its branches one completion with its ``reward``, one image token per
image in ``input_ids`` and ``images``, and the MoE routing its sampler recorded
(``routed_experts``, one entry per token the model ran, each image's placeholder tokens included;
drawn here as a function of the prefix, as a deterministic sampler's would be).

Use your own checkpoint (any Qwen3.5-MoE, or another vision family) and rollouts in place of these.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

from treelit.data.tokenizers import build_qwen_vl_tokenizer

ROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0, "mrope_interleaved": True,
        "partial_rotary_factor": 0.5}
# the text model: the layer pattern of Qwen3.5-MoE (full_attention_interval=4), tiny widths
TEXT = dict(hidden_size=32, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=8,
            shared_expert_intermediate_size=12, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
            rope_parameters=ROPE)
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=256)
SIDE = 32  # image side in pixels: an 8x8 patch grid, 16 placeholder tokens after the 2x2 merge
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220), "yellow": (230, 210, 30)}


def vision_tokens(tok) -> dict:
    return {t: tok.convert_tokens_to_ids(t)
            for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}


def checkpoint(out: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(build_qwen_vl_tokenizer(out))
    ids = vision_tokens(tok)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_moe", text_config=dict(TEXT, vocab_size=len(tok), tie_word_embeddings=True), vision_config=VISION,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                                          max_pixels=SIDE * SIDE).save_pretrained(out)


def routing_for(tokens, seed: int = 0) -> list:
    """``[len(tokens), MoE layers, top_k]`` expert ids, each token's a function of its prefix."""
    out = []
    for t in range(len(tokens)):
        rng = np.random.default_rng([seed, 7919, *tokens[: t + 1]])
        out.append([sorted(rng.choice(TEXT["num_experts"], TEXT["num_experts_per_tok"], replace=False).tolist())
                    for _ in range(TEXT["num_hidden_layers"])])
    return out


def records(out: Path, ckpt: Path, prompts: int = 8, completions: int = 4) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ids = vision_tokens(tok)
    placeholders = (SIDE // VISION["patch_size"]) ** 2 // VISION["spatial_merge_size"] ** 2
    rng = np.random.default_rng(0)
    (out / "squares").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    question = tok.encode("Which colour is the square?")
    with open(out / "groups.jsonl", "w") as f:
        for p in range(prompts):
            colour = names[p % len(names)]
            img = np.full((SIDE, SIDE, 3), 245, dtype=np.uint8)
            y, x = rng.integers(0, SIDE - 12, 2)
            img[y:y + 12, x:x + 12] = COLOURS[colour]
            Image.fromarray(img).save(out / "squares" / f"{p}.png")
            prompt = [ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"], *question]
            branches = []
            for c in range(completions):
                answer = names[(p + c) % len(names)] if c else colour  # every group has a right answer
                completion = tok.encode(" " + answer + ".")
                input_ids = prompt + completion
                # the tokens the sampler ran: the image token is its placeholders
                ran = prompt[:1] + [ids["<|image_pad|>"]] * placeholders + prompt[2:] + completion
                branches.append({"input_ids": input_ids, "loss_mask": [0] * len(prompt) + [1] * len(completion),
                                 "images": [f"squares/{p}.png"], "reward": float(answer == colour),
                                 "routed_experts": routing_for(ran)})
            f.write(json.dumps({"id": f"square{p}", "group": f"square{p}", "branches": branches}) + "\n")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-flagship")
    checkpoint(root / "checkpoint")
    records(root / "data", root / "checkpoint")
    print(f"checkpoint: {root / 'checkpoint'}\ndata: {root / 'data' / 'groups.jsonl'}")
