"""A tiny random Qwen3.5 vision checkpoint and screenshot records to try image training on.

    python examples/tiny_vision_agent.py OUT

writes ``OUT/checkpoint`` (a Qwen3.5 with a 2-block vision tower and a Gated DeltaNet /
attention text model, random weights, Qwen's tokenizer with its vision tokens and a small
image processor: 4-pixel patches, images scaled to at most 64x64 pixels) and ``OUT/data``
(``screens/*.png`` and ``agent.jsonl``: GUI-agent conversations, a screenshot per user turn, the
trials of one task sharing their first screenshots). Use your own checkpoint folder (any
Qwen2.5-VL, Qwen3-VL or Qwen3.5) and records in place of these.
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


def checkpoint(out: Path) -> None:
    tok = build_qwen_vl_tokenizer(out)
    ids = {t: transformers.AutoTokenizer.from_pretrained(tok).convert_tokens_to_ids(t)
                     for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(vocab_size=151680, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                rope_parameters=ROPE, tie_word_embeddings=True)
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=256)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5", text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16,
                                          max_pixels=64 * 64).save_pretrained(out)


def screenshot(rng: np.random.Generator, path: Path) -> str:
    """A 64x48 'screen': a background and a few coloured windows."""
    img = np.full((48, 64, 3), rng.integers(0, 255, 3), dtype=np.uint8)
    for _ in range(3):
        y, x = rng.integers(0, 40), rng.integers(0, 56)
        img[y:y + 8, x:x + 12] = rng.integers(0, 255, 3)
    Image.fromarray(img).save(path)
    return path.name


def records(out: Path, tasks: int = 4, trials: int = 2, turns: int = 3) -> None:
    rng = np.random.default_rng(0)
    (out / "screens").mkdir(parents=True, exist_ok=True)
    with open(out / "agent.jsonl", "w") as f:
        for task in range(tasks):
            first = screenshot(rng, out / "screens" / f"task{task}-start.png")
            for trial in range(trials):
                msgs = [{"role": "system", "content": "You operate a desktop. Answer with one action."}]
                for turn in range(turns):
                    shot = first if turn == 0 else screenshot(rng, out / "screens" / f"task{task}-{trial}-{turn}.png")
                    msgs.append({"role": "user", "content": [{"type": "image", "image": f"screens/{shot}"},
                                                             {"type": "text", "text": f"Step {turn}: open the menu."}]})
                    msgs.append({"role": "assistant", "content": f"click({rng.integers(0, 64)}, {rng.integers(0, 48)})"})
                f.write(json.dumps({"id": f"task{task}/trial{trial}", "group": f"task{task}", "messages": msgs}) + "\n")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-vision")
    checkpoint(root / "checkpoint")
    records(root / "data")
    print(f"checkpoint: {root / 'checkpoint'}\ndata: {root / 'data' / 'agent.jsonl'}")
