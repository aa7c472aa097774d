"""Image prompts for ``treelit-rollout``: a vision-language policy sampled with images in the prompt,
and rollout files that carry them in the record format the trainer reads.

A prompt record shows images in one of the two forms the trainer's data takes (docs: Training,
"Images"): a raw record ``{"id", "input_ids", "images": [...]}`` with one image token (the
checkpoint's ``image_token_id``) per image, or a chat record ``{"id", "messages"}`` whose content
parts name images (``{"type": "image", "image": ...}``, OpenAI's ``image_url``), rendered with the
published tokenizer's chat template: each image part becomes the tokenizer's image text
(``<|vision_start|><|image_pad|><|vision_end|>``), one image token per image. Images are read as
the trainer reads them (:class:`~treelit.data.images.ImageReader`): a path relative to the prompts
file's folder (or ``--image-root``), or a ``data:image/...;base64,`` URI; bounded in bytes and
pixels, PNG/JPEG/WEBP/GIF/BMP only, and a bad one is one line naming ``file:line`` and the field.

Sampling. Each image token becomes the published image processor's placeholder tokens and the
first forward gets the pixel patches (``pixel_values``, ``image_grid_thw``); later tokens run from
the KV cache. The image and video placeholder tokens are never sampled (their probability is set
to zero: a completion holding one would name an image it does not have); the log-probs recorded
are those of the distribution sampled from.

Writing. A branch keeps the compact form, one image token per image, with the prompt's
``images`` as paths ``images/<sha256>.<ext>`` relative to the rollout file: the image's own bytes,
written once per content into ``<--out>/images/`` (under a temporary name, then renamed) before the
step file that names them. The files a rollout folder hands the trainer never reach outside it.
The reward gets the record's images, decoded (PIL, RGB, in order), as the keyword ``images``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["ImagePrompts", "VisionPrompt", "has_images", "vision_config", "load_vision_model", "check_routing"]

EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}
FOLDER = "images"  # under --out: the images the rollout files name


def vision_config(config: Dict[str, Any]) -> bool:
    """Whether a checkpoint's ``config.json`` is a vision-language model's (it has a tower)."""
    return config.get("vision_config") is not None


def has_images(rec: Dict[str, Any]) -> bool:
    """Whether a prompt record shows images (an ``images`` field, or an image content part)."""
    from treelit.data.images import image_ref

    if rec.get("images"):
        return True
    msgs = rec.get("messages")
    for m in msgs if isinstance(msgs, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for p in content if isinstance(content, list) else []:
            try:
                if image_ref(p, "") is not None:
                    return True
            except ValueError:  # a malformed image part: an image part all the same (its error comes later)
                return True
    return False


def load_vision_model(path: Path, dtype: Any):
    """The transformers model of a vision-language checkpoint (its tower included)."""
    from transformers import AutoModelForImageTextToText  # heavy: vision checkpoints only
    from transformers.utils import logging as hf_logging  # as above

    from treelit.models.hf_kernels import no_hub_kernels

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per version otherwise
    kw = no_hub_kernels()
    text = json.loads((Path(path) / "config.json").read_text()).get("text_config") or {}
    if text.get("num_experts_per_tok"):
        kw["experts_implementation"] = "eager"  # MoE: grouped_mm has no float64 / CPU-portable kernel
    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype, trust_remote_code=False,
                                                       local_files_only=True, **kw).eval()


@dataclass
class VisionPrompt:
    """One prompt's images: ``ids`` the prompt with each image token expanded to its placeholders
    (what the model runs), ``pixels`` the processed images, ``raw`` their bytes and file suffixes."""

    ids: List[int]
    pixels: List[Any]
    raw: List[Tuple[bytes, str]]
    refs: List[str] = field(default_factory=list)  # set by ImagePrompts.store

    def model_inputs(self, rows: int, model: Any, ids: Any) -> Dict[str, Any]:
        """The first forward's image inputs for ``rows`` copies of the prompt (``ids [rows, T]``)."""
        import torch  # cli: treelit-rollout --help pays for no torch

        dtype = next(model.parameters()).dtype
        pv = torch.cat([p.pixel_values for p in self.pixels]).to(dtype)
        grid = torch.tensor([list(p.grid_thw) for p in self.pixels])
        out = {"pixel_values": pv.repeat(rows, 1), "image_grid_thw": grid.repeat(rows, 1)}
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            out["mm_token_type_ids"] = (ids == self.pixels[0].token_id).int()
        return out


class ImagePrompts:
    """Reads the images of prompt records with a published checkpoint's image processor and writes
    them into the rollout folder (see the module docstring)."""

    def __init__(self, checkpoint: Path, image_root: Optional[str] = None) -> None:
        from treelit.builders.vision import checkpoint_image_token
        from treelit.data.images import ImageReader, load_image_processor, tokens_per_image

        checkpoint = Path(checkpoint)
        if not (checkpoint / "preprocessor_config.json").is_file():
            raise ValueError(f"{checkpoint}: a vision-language checkpoint without preprocessor_config.json (its image "
                             "processor): publish with publish.tokenizer naming the checkpoint folder that has it")
        try:
            self.reader = ImageReader(load_image_processor(str(checkpoint)), image_root=image_root,
                                      tokens_per_image=tokens_per_image(str(checkpoint)))
        except ValueError as exc:
            raise ValueError(str(exc).replace("tree_builder.image_root", "--image-root")) from None
        found = checkpoint_image_token(str(checkpoint))
        if found is None:
            raise ValueError(f"{checkpoint}: config.json names no image_token_id")
        self.token = found[0]
        cfg = json.loads((checkpoint / "config.json").read_text())
        self.never = sorted({self.token} | {int(cfg[k]) for k in ("video_token_id",) if isinstance(cfg.get(k), int)})

    def prepare(self, rec: Dict[str, Any], path: str, where: str, tok: Any = None) -> None:
        """Turn ``rec`` (a raw record with ``images`` or chat ``messages`` with image parts) into
        ``input_ids`` (one image token per image), ``images`` (decoded, for the reward) and
        ``_vision`` (a :class:`VisionPrompt`); errors name ``where`` (``file:line``) and the field."""
        if "messages" in rec:
            if tok is None:
                raise ValueError(f"{where}: chat messages need a tokenizer in the published checkpoint")
            ids, refs = self._render(rec.pop("messages"), tok, where)
            rec["input_ids"] = ids
        else:
            refs = rec.get("images")
            if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
                raise ValueError(f"{where}: images: must be a list of image paths or data: URIs")
            refs = [(r, f"{where}: images[{k}]") for k, r in enumerate(refs)]
            ids = rec.get("input_ids")
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{where}: input_ids must be a non-empty list of token ids")
        at = [t for t, i in enumerate(ids) if i == self.token]
        if len(at) != len(refs):
            raise ValueError(f"{where}: input_ids: {len(at)} image token(s) {self.token} for {len(refs)} image(s) "
                             "(one token per image, in order)")
        pixels, raw, decoded = [], [], []
        for ref, at_field in refs:
            data, name = self.reader.load_bytes(ref, path, at_field)
            pixels.append(self.reader.read(ref, path, at_field, self.token))
            decoded.append(self.reader.decode(data, name, at_field))
            raw.append((data, EXTENSIONS.get(_format(data) or "", "png")))
        expanded: List[int] = []
        prev = 0
        for t, im in zip(at, pixels):
            expanded += ids[prev:t] + [self.token] * im.num_tokens
            prev = t + 1
        rec["images"] = decoded
        rec["_vision"] = VisionPrompt(expanded + ids[prev:], pixels, raw)

    def _render(self, messages: Any, tok: Any, where: str) -> Tuple[List[int], List[Tuple[str, str]]]:
        from treelit.builders.chat import _IMAGE_MARK, _normalise, _refs
        from treelit.builders.image_text import image_text, template_renders_parts

        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{where}: messages: must be a list of message objects")
        refs = _refs(messages, range(len(messages)), f"{where}: messages")
        text = image_text(tok, fixed_count=self.reader.fixed is not None).text  # as the trainer's chat builder
        parts = template_renders_parts(lambda msgs: tok.apply_chat_template(msgs, tokenize=False), _IMAGE_MARK)
        try:
            rendered = tok.apply_chat_template([_normalise(m, keep_thinking=True, parts=parts) for m in messages],
                                               add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a malformed message or part: the record's error, in one line
            raise ValueError(f"{where}: messages: the chat template cannot render them ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]})") from None
        return list(tok(rendered.replace(_IMAGE_MARK, text), add_special_tokens=False)["input_ids"]), refs

    def store(self, out: Path, prompt: VisionPrompt) -> List[str]:
        """Write ``prompt``'s images into ``out/images/`` (once per content) and return their paths
        relative to ``out`` (what the rollout file's branches name)."""
        if prompt.refs:
            return prompt.refs
        folder = out / FOLDER
        folder.mkdir(exist_ok=True)
        for data, ext in prompt.raw:
            name = f"{hashlib.sha256(data).hexdigest()}.{ext}"
            final = folder / name
            if not final.is_file():
                tmp = folder / f".{name}.tmp-{os.getpid()}"
                tmp.write_bytes(data)
                os.replace(tmp, final)
            prompt.refs.append(f"{FOLDER}/{name}")
        return prompt.refs


def _format(data: bytes) -> Optional[str]:
    from treelit.data.images import _format_of

    return _format_of(data)


def check_routing(vision: Optional[VisionPrompt], record: bool) -> None:
    """Routing replay records per token of the branch as run; with an image prompt those include the
    placeholders, which the written (compact) branch does not have: refused in one line."""
    if record and vision is not None:
        raise ValueError("--record-routing (or a policy published with model.moe.routing=replay) with image prompts: "
                         "the routing of an image's placeholder tokens has no place in the written branch")
