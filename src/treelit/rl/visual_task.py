"""A synthetic visual task for the online RL loop: name the colour of the square in the picture.

Each prompt shows one image: a square of one of :data:`PALETTE`'s colours, at a random place on a
grey background. The answer is the colour's token (:data:`ANSWER_TOKENS`); the reward
``square_colour`` (registered here, registry kind ``reward``) reads the colour from the image's
pixels (never from a field of the record), so a policy can only earn it by looking at the image. A tiny vision-language
model learns it in a few dozen GRPO updates (docs: Streaming, "Images in the loop").

    python -m treelit.rl.visual_task --out DIR --n 16 --image-token 35 --vision-start 37 --vision-end 38

writes ``DIR/prompts.jsonl`` (raw prompt records ``{"id", "input_ids", "images"}``, one image token
per image) and the pictures under ``DIR/squares/``, for ``treelit-rollout --prompts DIR/prompts.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from PIL import Image

from treelit.rl.rewards import REWARDS

__all__ = ["PALETTE", "ANSWER_TOKENS", "square_image", "colour_of", "colour_token", "write_prompts", "square_colour"]

PALETTE = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
ANSWER_TOKENS = {"red": 10, "green": 11, "blue": 12, "yellow": 13}  # the token that names each colour
BACKGROUND = (128, 128, 128)
ASK, QUESTION = 5, 6  # the prompt's text tokens around the image: "look" <image> "what colour?"


def square_image(rng: np.random.Generator, colour: str, size: int = 16):
    """A ``size`` x ``size`` PIL image: grey, with a square of ``colour`` (half the side) at a random place."""
    px = np.empty((size, size, 3), dtype=np.uint8)
    px[:] = BACKGROUND
    side = size // 2
    y, x = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    px[y:y + side, x:x + side] = PALETTE[colour]
    return Image.fromarray(px)


def colour_of(image: Any) -> Optional[str]:
    """The palette colour nearest to the mean of ``image``'s non-background pixels (None: all grey)."""
    px = np.asarray(image.convert("RGB"), dtype=np.float64).reshape(-1, 3)
    fg = px[np.abs(px - BACKGROUND).sum(1) > 30]
    if not len(fg):
        return None
    mean = fg.mean(0)
    return min(PALETTE, key=lambda c: float(((mean - PALETTE[c]) ** 2).sum()))


def colour_token(image: Any) -> Optional[int]:
    """The answer token of ``image``'s square (None: no square)."""
    c = colour_of(image)
    return None if c is None else ANSWER_TOKENS[c]


@REWARDS.register("square_colour")
def square_colour(prompt_ids: List[int], completion_ids: List[int], images: Any = None, **record: Any) -> float:
    """1 if the first completion token names the colour of the square in the prompt's first image, else 0."""
    if not images:
        raise ValueError("reward square_colour needs the prompt's image (a prompt record with images, sampled from a "
                         "vision-language checkpoint)")
    return float(bool(completion_ids) and completion_ids[0] == colour_token(images[0]))


def task_prompt(image_token: int, vision_start: Optional[int], vision_end: Optional[int]) -> List[int]:
    """``ASK <vision_start> <image> <vision_end> QUESTION`` (the start/end tokens where the family has them)."""
    image = [t for t in (vision_start, image_token, vision_end) if t is not None]
    return [ASK, *image, QUESTION]


def write_prompts(out: Path, n: int, image_token: int, vision_start: Optional[int] = None,
                  vision_end: Optional[int] = None, seed: int = 0, size: int = 16,
                  colours: Sequence[str] = tuple(PALETTE)) -> Path:
    """``n`` prompt records with one picture each (colours in turn, places at random) in ``out``;
    returns the prompts file."""
    out = Path(out)
    (out / "squares").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records: List[Dict[str, Any]] = []
    for i in range(n):
        name = f"squares/{i}.png"
        square_image(rng, colours[i % len(colours)], size).save(out / name)
        records.append({"id": f"sq{i}", "input_ids": task_prompt(image_token, vision_start, vision_end),
                        "images": [name]})
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder for prompts.jsonl and squares/")
    p.add_argument("--n", type=int, default=16, help="prompts (pictures)")
    p.add_argument("--image-token", type=int, required=True, help="the checkpoint's image_token_id")
    p.add_argument("--vision-start", type=int, default=None, help="the checkpoint's vision_start_token_id")
    p.add_argument("--vision-end", type=int, default=None, help="the checkpoint's vision_end_token_id")
    p.add_argument("--size", type=int, default=16, help="the pictures' side, in pixels")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(write_prompts(Path(a.out), a.n, a.image_token, a.vision_start, a.vision_end, a.seed, a.size))


if __name__ == "__main__":
    main()
