"""Images in token-level records and the model they train: which token is an image, and whether
the model can see images at all.

A raw branch marks each of its ``images`` with one image token in ``input_ids``. That token is
the checkpoint's: ``image_token_id`` in the ``config.json`` of ``tree_builder.processor_path``
(Qwen2-VL and Qwen2.5-VL use 151655, Qwen3.5 248056), else the id of the image token
(``<|image_pad|>``) in that folder's tokenizer files. ``tree_builder.image_token_id`` may name it
for a folder that has neither; one that disagrees with the checkpoint is refused. Before training,
:func:`check_model_images` holds the builder against the model: images with a model that has no
vision tower, or an image token other than the model's, are refused before any record is read.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

from treelit.data.records import DataError, Record, is_int

__all__ = ["checkpoint_image_token", "raw_image_token", "check_model_images", "expand_raw_images",
           "image_token_without_image", "NO_VISION"]

MAX_CONFIG_BYTES = 64 << 20  # the largest tokenizer or config file read for the image token
NO_VISION = ("the model has no vision tower: records with images need model.vision=true and a vision-language "
             "checkpoint (model.hf_checkpoint=DIR)")


def _json(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.isfile(path) or os.path.getsize(path) > MAX_CONFIG_BYTES:
        return None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_image_token(folder: str) -> Optional[Tuple[int, str]]:
    """The image token id a checkpoint folder names and the file that names it: ``config.json``'s
    ``image_token_id``, else the id of its tokenizer's image token (``image_token`` in
    ``tokenizer_config.json`` or ``processor_config.json``, default ``<|image_pad|>``) among
    ``tokenizer.json``'s added tokens or ``tokenizer_config.json``'s ``added_tokens_decoder``.
    None: no file names one."""
    config = _json(os.path.join(folder, "config.json")) or {}
    for key in ("image_token_id", "image_token_index"):  # Gemma-3's config names it image_token_index
        if is_int(config.get(key)):
            return int(config[key]), "config.json"
    tok_config = _json(os.path.join(folder, "tokenizer_config.json")) or {}
    proc_config = _json(os.path.join(folder, "processor_config.json")) or {}
    name = next((c["image_token"] for c in (proc_config, tok_config) if isinstance(c.get("image_token"), str)),
                "<|image_pad|>")
    tokens = (_json(os.path.join(folder, "tokenizer.json")) or {}).get("added_tokens")
    for t in tokens if isinstance(tokens, list) else []:
        if isinstance(t, dict) and t.get("content") == name and is_int(t.get("id")):
            return int(t["id"]), "tokenizer.json"
    decoder = tok_config.get("added_tokens_decoder")
    for i, t in (decoder.items() if isinstance(decoder, dict) else ()):
        if isinstance(t, dict) and t.get("content") == name and str(i).isdigit():
            return int(i), "tokenizer_config.json"
    return None


def raw_image_token(processor_path: Optional[str], option: Optional[int]) -> Optional[int]:
    """The image token of raw records: the checkpoint's (``processor_path``), checked against
    ``tree_builder.image_token_id`` when both are given; None: neither is."""
    if option is not None and (not is_int(option) or option < 0):
        raise ValueError(f"tree_builder.image_token_id must be a token id (an integer >= 0) or null, got {option!r}")
    if not processor_path:
        return option
    found = checkpoint_image_token(processor_path)
    if found is None:
        if option is None:
            raise ValueError(f"tree_builder.processor_path {processor_path!r}: neither its config.json "
                             "(image_token_id) nor its tokenizer files name the image token; set "
                             "tree_builder.image_token_id")
        return option
    token, where = found
    if option is not None and option != token:
        raise ValueError(f"tree_builder.image_token_id={option} differs from the checkpoint's image token {token} "
                         f"({os.path.join(processor_path, where)}); leave tree_builder.image_token_id null to use "
                         "the checkpoint's")
    return token


def check_model_images(builder: Any, model: Any) -> None:
    """Hold the builder's images against ``model`` before any record is read: a processor with a
    model that has no vision tower, or an image token other than the model's, is refused (one
    line naming the options); records with images on a text-only model are refused naming the
    record (builders read ``builder.model_vision``)."""
    vision = getattr(model, "vision", None)
    builder.model_vision = vision is not None
    if vision is None:
        if getattr(builder, "images", None) is not None:
            raise ValueError(f"tree_builder.processor_path is set, but {NO_VISION}")
        return
    token = int(vision.image_token_id)
    ours = getattr(builder, "image_token_id", None)
    if ours is not None and int(ours) != token:
        source = ("the tokenizer's image token (tree_builder.tokenizer_path)" if hasattr(builder, "tok")
                  else "tree_builder.image_token_id / the processor's checkpoint")
        raise ValueError(f"the data's image token {ours} ({source}) differs from the model's image_token_id {token}: "
                         "the processor and the model must come from the same checkpoint")
    builder.image_token_id = token
    _check_markers(getattr(builder, "image_markers", None), vision)


MARKER_KEYS = (("vision_start_token_id", "vision_end_token_id"),  # Qwen
               ("image_start_token_id", "image_end_token_id"),  # GLM-4.5V
               ("boi_token_index", "eoi_token_index"))  # Gemma-3


def _check_markers(markers: Any, vision: Any) -> None:
    """The chat builder's image markers (:mod:`treelit.builders.image_text`) must be the ones the
    model's config names (its tokenizer and the model from one checkpoint)."""
    hf = getattr(vision, "_hf", None)
    config = getattr(hf[0], "config", None) if hf else None
    if markers is None or config is None:
        return
    for start, end in MARKER_KEYS:
        want = (getattr(config, start, None), getattr(config, end, None))
        if all(is_int(w) for w in want):
            if (markers.start_id, markers.end_id) != tuple(want):
                raise ValueError(f"the tokenizer's {markers.family} image markers ({markers.start_id}, "
                                 f"{markers.end_id}) differ from the model's {start}/{end} {want}: the tokenizer "
                                 "(tree_builder.tokenizer_path) and the model must come from the same checkpoint")
            return


def image_token_without_image(ids: List[int], token: Optional[int], where: str) -> None:
    """A branch without ``images`` must not hold the image token (one image token per image)."""
    if token is not None and token in ids:
        pos = ids.index(token)
        raise DataError(f"{where}.input_ids[{pos}]: image token {token} in a branch without 'images' (one image "
                        "token per image, in order: give the branch its images, or drop the token)")


PER_TOKEN = ("old_logprobs", "ref_logprobs", "token_rewards", "policy_versions")  # one entry per input_ids token


def expand_raw_images(reader: Any, token: int, br: Dict[str, Any], refs: List[str], record: Record,
                      where: str) -> Dict[str, Any]:
    """One ``token`` per image in ``input_ids`` becomes the image's placeholder tokens (never targets);
    the branch's per-token fields (:data:`PER_TOKEN`) grow with it: null on every placeholder (the
    entry at the image token must be null: nothing is sampled, scored or rewarded there)."""
    ids, mask = list(br["input_ids"]), br.get("loss_mask")
    at = [t for t, i in enumerate(ids) if i == token]
    if len(at) != len(refs):
        raise DataError(f"{where}.input_ids: {len(at)} image token(s) {token} for {len(refs)} "
                        "image(s) (one token per image, in order)")
    glued = next((k for k in range(1, len(at)) if at[k] == at[k - 1] + 1), None)
    if glued is not None and getattr(reader, "fixed", None) is not None:  # Gemma-3: one bidirectional block
        raise DataError(f"{where}.input_ids[{at[glued]}]: images {glued - 1} and {glued} have no token between them, "
                        "which makes them one bidirectional image block in Gemma-3; write each image token between "
                        "the start and end of image markers, as its processor does")
    per_token = {k: br[k] for k in PER_TOKEN if br.get(k) is not None}
    for key, values in per_token.items():
        for t in at:
            if values[t] is not None:
                raise DataError(f"{where}.{key}[{t}]: must be null at an image token (got {values[t]!r}): the "
                                "image's placeholder tokens are never sampled or trained")
    images = [reader.read(r, record.path, f"{where}.images[{k}]", token) for k, r in enumerate(refs)]
    mask = [1] * len(ids) if mask is None else [int(m) for m in mask]
    out: Dict[str, List[Any]] = {"input_ids": [], "loss_mask": [], **{k: [] for k in per_token}}
    fill = {"input_ids": token, "loss_mask": 0}
    prev = 0
    for t, im in zip(at + [len(ids)], images + [None]):
        for key, values in (("input_ids", ids), ("loss_mask", mask), *per_token.items()):
            out[key] += values[prev:t] + ([] if im is None else [fill.get(key)] * im.num_tokens)
        prev = t + 1
    return {**out, "images": images}
