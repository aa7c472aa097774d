"""What an image part of a chat message renders as: the checkpoint's markers around one
placeholder token, which the chat builder then repeats the processor's number of times.

The processor of each vision family writes an image as:

=========================  ========================================================================
Qwen2-VL ... Qwen3.5        ``<|vision_start|>`` ``<|image_pad|>`` x n ``<|vision_end|>`` (n from the grid)
GLM-4.5V                    ``<|begin_of_image|>`` ``<|image|>`` x n ``<|end_of_image|>`` (n from the grid)
Gemma-3                     ``\\n\\n<start_of_image>`` ``<image_soft_token>`` x ``mm_tokens_per_image``
                            ``<end_of_image>\\n\\n`` (the tokenizer's ``boi_token`` / ``image_token`` /
                            ``eoi_token``)
=========================  ========================================================================

For a processor that counts by grid (a ``merge_size``) the family is the first of Qwen's and
GLM's whose three tokens the tokenizer has (its own ``image_token`` first); for one with a fixed
count it is Gemma-3's. A tokenizer with neither set is refused by name, before any record is read.

A chat template that renders content parts (the vision checkpoints' own do) gets them as parts,
each image as a text part holding the builder's mark, so the text around an image renders
exactly as the processor's chat template renders it (Gemma-3's trims each text part); a template
that takes string content only gets the parts joined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

__all__ = ["ImageText", "image_text", "template_renders_parts", "content_for_template"]

# (family, start, placeholder, end) of the processors that count an image's tokens by its grid
GRID_FAMILIES: Tuple[Tuple[str, str, str, str], ...] = (
    ("Qwen", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    ("GLM-4.5V", "<|begin_of_image|>", "<|image|>", "<|end_of_image|>"),
)
GEMMA3 = ("Gemma-3", "<start_of_image>", "<image_soft_token>", "<end_of_image>")


@dataclass(frozen=True)
class ImageText:
    """``text``: what one image part renders as (one placeholder token); ``token_id``: the
    placeholder's id; ``start_id`` / ``end_id``: the markers' ids; ``family``: whose markers."""

    family: str
    text: str
    token_id: int
    start_id: int
    end_id: int


def _ids(tok, names: Sequence[str]) -> Dict[str, Any]:
    ids = {t: tok.convert_tokens_to_ids(t) for t in names}
    return {t: i for t, i in ids.items() if i is not None and i != tok.unk_token_id}


def image_text(tok, fixed_count: bool) -> ImageText:
    """The markers of the tokenizer's family (see the module docstring); ``fixed_count``: the
    image processor makes a fixed number of tokens per image (Gemma-3)."""
    if fixed_count:
        family, *names = GEMMA3
        names = [getattr(tok, attr, None) or default
                 for attr, default in zip(("boi_token", "image_token", "eoi_token"), names)]
        found = _ids(tok, names)
        if len(found) < 3:
            raise ValueError(f"the tokenizer has no {', '.join(t for t in names if t not in found)} token(s); an image "
                             "processor with a fixed number of tokens per image (Gemma-3) needs Gemma-3's image tokens "
                             "in the tokenizer (tree_builder.tokenizer_path)")
        start, pad, end = names
        return ImageText(family, f"\n\n{start}{pad}{end}\n\n", found[pad], found[start], found[end])
    own = getattr(tok, "image_token", None)
    sets = sorted(GRID_FAMILIES, key=lambda s: s[2] != own)  # the tokenizer's own placeholder first
    for family, start, pad, end in sets:
        found = _ids(tok, (start, pad, end))
        if len(found) == 3:
            return ImageText(family, start + pad + end, found[pad], found[start], found[end])
    listed = "; ".join(f"{f}: {s} {p} {e}" for f, s, p, e in GRID_FAMILIES)
    raise ValueError(f"the tokenizer has the image tokens of no vision family treelit reads ({listed}); images need "
                     "the vision checkpoint's tokenizer (tree_builder.tokenizer_path)")


def template_renders_parts(render: Callable[[List[Dict[str, Any]]], str], mark: str) -> bool:
    """Whether the chat template writes a text part's text (not the list) for list content."""
    try:
        return mark in render([{"role": "user", "content": [{"type": "text", "text": mark}]}])
    except Exception:  # noqa: BLE001 - a template that fails on list content takes strings
        return False


def content_for_template(parts: List[Dict[str, Any]], mark: str, as_parts: bool):
    """A message's content parts as the template gets them: images as ``mark``; text and
    image parts in order (``as_parts``), or joined into one string."""
    if as_parts:
        return [{"type": "text", "text": p["text"] if p["type"] == "text" else mark} for p in parts]
    return "".join(p["text"] if p["type"] == "text" else mark for p in parts)
