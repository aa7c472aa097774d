"""Images named by records: read within the data file's folder (or ``image_root``), bounded, processed
once per record.

A record names an image as a path relative to its data file (``"shots/turn3.png"``), or to
``tree_builder.image_root`` (a folder of screenshots beside the data, say), or as a
``data:image/...;base64,`` URI, in a chat content part (``{"type": "image", "image": ...}``,
OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``) or in a raw branch's
``images`` list. Data files are written by others, so an image reference is data, never a
capability:

* a path resolves (symbolic links followed) inside the data file's folder or ``image_root``
  or is refused - ``../`` and absolute paths that leave both name the record and the path;
* URLs other than ``data:`` are refused (nothing is fetched);
* only PNG, JPEG, WEBP, GIF and BMP are decoded (no other Pillow plugin - EPS would run
  Ghostscript - ever sees the bytes);
* the file (or the decoded ``data:`` payload) may hold at most ``max_image_bytes`` bytes,
  checked before it is read whole;
* the decoded image may have at most ``max_image_pixels`` pixels, checked from the header
  before the pixels are decoded (Pillow's own decompression-bomb check is a warning below
  ~179 Mpx; this bound is an error at a size a training image never needs).

Errors are one line: ``file:line: field: image 'name': what is wrong (the option to raise)``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from PIL import Image

from treelit.data.records import DataError
from treelit.tree.images import ProcessedImage

__all__ = ["ImageLimits", "ImageReader", "image_ref", "load_image_processor", "tokens_per_image"]

MiB = 1 << 20
CACHE_BYTES = 256 * MiB  # processed pixel values kept per reader (a 1280x720 screenshot's are ~22 MB in float32)
MIN_IMAGE_BYTES = 8  # fewer bytes than any PNG, JPEG, WEBP, GIF or BMP file has
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow's decoders for these only: never EPS (Ghostscript) or others


def _format_of(raw: bytes) -> Optional[str]:
    """The Pillow format whose signature ``raw`` starts with (nothing is parsed); None: no format's.
    (A signature check that fails on a short prefix - the DIB one unpacks 4 bytes - is no match.)"""
    Image.init()
    prefix = raw[:16]
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        try:
            if accept is not None and accept(prefix):
                return fmt
        except Exception:  # noqa: BLE001 - a plugin's check on bytes it was not written for
            continue
    return None


def _one_line(exc: BaseException, n: int = 300) -> str:
    """``Type: message`` of ``exc`` on one line, at most ``n`` characters of the message."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:n]}{'...' if len(msg) > n else ''}"


@dataclass(frozen=True)
class ImageLimits:
    """``max_image_bytes`` (file or decoded data: URI), ``max_image_pixels`` (width x height)."""

    max_image_bytes: int = 32 * MiB
    max_image_pixels: int = 40_000_000


def image_ref(part: Any, where: str) -> Optional[str]:
    """The image reference of a chat content part (None: not an image part)."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "image":
        ref = part.get("image", part.get("url", part.get("path")))
    elif kind == "image_url":
        ref = part.get("image_url")
        ref = ref.get("url") if isinstance(ref, dict) else ref
    else:
        return None
    if not isinstance(ref, str) or not ref:
        raise DataError(f"{where}: an {kind} part needs a path or data: URI string, got {type(ref).__name__}")
    return ref


def load_image_processor(path: str):
    """A checkpoint's image processor from a local directory (never from the hub, never its code)."""
    if not os.path.isdir(path):
        raise ValueError(f"tree_builder.processor_path {path!r} is not a directory")
    from transformers import AutoImageProcessor  # optional and heavy (~1.5 s CPU): image data only

    try:
        return AutoImageProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tree_builder.processor_path {path!r}: no image processor can be loaded "
                         f"({' '.join(str(exc).split())[:300]})") from None


def tokens_per_image(path: Optional[str]) -> Optional[int]:
    """The fixed number of placeholder tokens per image a processor folder names (Gemma-3:
    ``image_seq_length`` in ``processor_config.json``, else ``mm_tokens_per_image`` in
    ``config.json``); None: neither does (the Qwen and GLM processors count by grid)."""
    for name, key in (("processor_config.json", "image_seq_length"), ("config.json", "mm_tokens_per_image")):
        full = os.path.join(path, name) if path else ""
        if not full or not os.path.isfile(full) or os.path.getsize(full) > 64 * MiB:
            continue
        try:
            with open(full, "rb") as f:
                value = json.loads(f.read().decode("utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            if value <= 0:
                raise ValueError(f"{full}: {key}={value} must be a positive number of image tokens")
            return value
    return None


class ImageReader:
    """Reads, bounds and processes the images of records (one reader per builder; each image of a
    record is processed once however many branches show it; processed images are kept, least
    recently used dropped first, up to ``cache_bytes`` of pixel values).

    ``processor``: the checkpoint's processor (``image_processor`` attribute) or image processor.
    An image becomes ``t*h*w / merge**2`` placeholder tokens for a processor with a ``merge_size``
    (the Qwen and GLM families), else ``tokens_per_image`` of them (Gemma-3's
    ``mm_tokens_per_image``; default: the processor's ``image_seq_length``) from one
    ``[1, 3, H, W]`` pixel block, its grid ``(1, 1, 1)``."""

    def __init__(self, processor: Any, limits: Optional[ImageLimits] = None, cache_bytes: int = CACHE_BYTES,
                 image_root: Optional[str] = None, tokens_per_image: Optional[int] = None) -> None:
        self.image_processor = getattr(processor, "image_processor", processor)
        self.image_root = None
        if image_root is not None:
            if not isinstance(image_root, str) or not image_root or "\x00" in image_root \
                    or not os.path.isdir(image_root):
                raise ValueError(f"tree_builder.image_root {image_root!r} is not a directory")
            self.image_root = os.path.realpath(image_root)
        self.limits = limits or ImageLimits()
        merge = getattr(self.image_processor, "merge_size", None)
        self.merge = None if merge is None else int(merge)
        self.fixed = None
        if merge is None:
            name = type(self.image_processor).__name__
            fixed = tokens_per_image if tokens_per_image is not None else getattr(processor, "image_seq_length", None)
            if fixed is None:
                raise ValueError(f"{name}: treelit reads images for processors with a merge_size (the Qwen and GLM "
                                 "vision families) or a fixed number of tokens per image (Gemma-3: image_seq_length "
                                 "in processor_config.json, or mm_tokens_per_image in config.json); the folder names "
                                 "neither")
            if getattr(self.image_processor, "do_pan_and_scan", False):
                raise ValueError(f"{name}: do_pan_and_scan=true is not read (an image would become several crops, "
                                 "each its own image block); set do_pan_and_scan to false in the processor's config")
            self.fixed = int(fixed)
        self.cache_bytes = int(cache_bytes)
        self._cache: "OrderedDict[str, Tuple[Any, Tuple[int, ...], int]]" = OrderedDict()  # least recently used first
        self._cached = 0  # bytes of the pixel values held

    def load_bytes(self, ref: str, data_path: Optional[str], where: str) -> Tuple[bytes, str]:
        """The encoded bytes of ``ref`` and a short name for messages."""
        lim = self.limits
        if "\x00" in ref:
            raise DataError(f"{where}: image {ref!r}: a path or URI cannot contain a NUL byte")
        if ref.startswith("data:"):
            head, _, payload = ref.partition(",")
            if ";base64" not in head or not head[5:].startswith("image/"):
                raise DataError(f"{where}: a data: URI image must be data:image/<type>;base64,<payload>")
            if len(payload) > 4 * (lim.max_image_bytes // 3 + 1):
                raise DataError(f"{where}: data: URI image larger than tree_builder.max_image_bytes={lim.max_image_bytes}")
            try:
                raw = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise DataError(f"{where}: data: URI image is not valid base64 ({exc})") from None
            return raw, "data: URI"
        if "://" in ref:
            raise DataError(f"{where}: image {ref!r}: only paths relative to the data file and data: URIs are read "
                            "(nothing is downloaded)")
        full = self._resolve(ref, data_path, where)
        size = os.path.getsize(full)
        if size > lim.max_image_bytes:
            raise DataError(f"{where}: image {ref!r} has {size} bytes, more than tree_builder.max_image_bytes="
                            f"{lim.max_image_bytes}")
        with open(full, "rb") as f:
            return f.read(lim.max_image_bytes + 1), ref

    def _resolve(self, ref: str, data_path: Optional[str], where: str) -> str:
        """The real path of image ``ref``: relative to the data file's folder, else to ``image_root``
        (symbolic links followed); it must lie in one of the two folders and be a file."""
        roots = [] if data_path is None else [os.path.realpath(os.path.dirname(os.path.abspath(data_path)))]
        if self.image_root is not None:
            roots.append(self.image_root)
        if not roots:
            raise DataError(f"{where}: image {ref!r}: a path needs a data file (or tree_builder.image_root) to be "
                            "relative to")
        inside, escapes = [], False  # folders it would be missing from; whether an existing path leaves them
        for base in roots:
            path = os.path.join(base, ref)
            full = os.path.realpath(path)
            if any(os.path.commonpath([r, full]) == r for r in roots):
                if os.path.isfile(full):
                    return full
                inside.append(base)
            elif os.path.lexists(path):  # a file or link outside both folders
                escapes = True
        names = (f"the data file's folder {roots[0]}" if data_path is not None else "") + (
            f"{' and ' if data_path is not None else ''}tree_builder.image_root {self.image_root}"
            if self.image_root is not None else "")
        if escapes or not inside:
            raise DataError(f"{where}: image {ref!r} resolves outside {names}; images are read from "
                            f"{'that folder' if len(roots) == 1 else 'those folders'} only")
        raise DataError(f"{where}: image {ref!r} does not exist (relative to {' or '.join(inside)})")

    def decode(self, raw: bytes, name: str, where: str):
        if len(raw) < MIN_IMAGE_BYTES:
            raise DataError(f"{where}: image {name!r} has {len(raw)} byte(s), too few to be an image (an empty or "
                            "truncated file?)")
        fmt = _format_of(raw)
        if fmt is not None and fmt not in FORMATS:
            raise DataError(f"{where}: image {name!r} is {fmt}; only {', '.join(FORMATS)} images are read")
        try:
            with warnings.catch_warnings():  # the size is checked here, with one error line (Pillow's own
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # warning would print before it)
                img = Image.open(io.BytesIO(raw), formats=list(FORMATS))
                w, h = img.size
                if w * h > self.limits.max_image_pixels:
                    raise DataError(f"{where}: image {name!r} has {w}x{h} = {w * h} pixels, more than "
                                    f"tree_builder.max_image_pixels={self.limits.max_image_pixels}")
                img.load()
                return img.convert("RGB")
        except (DataError, MemoryError):
            raise
        except Image.DecompressionBombError as exc:
            raise DataError(f"{where}: image {name!r} is refused by Pillow's decompression-bomb limit "
                            f"({_one_line(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - any decoder failure on bytes from a data file is the data's
            raise DataError(f"{where}: image {name!r} cannot be decoded ({_one_line(exc)})") from None

    def read(self, ref: str, data_path: Optional[str], where: str, token_id: int):
        """The :class:`~treelit.tree.images.ProcessedImage` of ``ref`` (processed once per content)."""
        raw, name = self.load_bytes(ref, data_path, where)
        key = hashlib.sha256(raw).hexdigest()
        if key in self._cache:
            self._cache.move_to_end(key)
            pv, grid, n = self._cache[key]
        else:
            img = self.decode(raw, name, where)
            try:
                out = self.image_processor(images=[img], return_tensors="pt")
            except MemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. Qwen's aspect-ratio limit (at most 200:1)
                raise DataError(f"{where}: image {name!r} ({img.width}x{img.height}) is refused by the image "
                                f"processor ({_one_line(exc)})") from None
            pv = out["pixel_values"]
            if self.fixed is not None:  # one pixel block per image (no pan-and-scan crops: refused above)
                if pv.ndim != 4 or pv.shape[0] != 1:
                    raise DataError(f"{where}: image {name!r}: the image processor made {tuple(pv.shape)} pixel values, "
                                    "not one [1, 3, H, W] block")
                grid, n = (1, 1, 1), self.fixed
            else:
                grid = tuple(int(x) for x in out["image_grid_thw"][0])
                n = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            self._remember(key, (pv, grid, n))
        return ProcessedImage(pv, grid, n, int(token_id), name=name)

    def _remember(self, key: str, entry: Tuple[Any, Tuple[int, ...], int]) -> None:
        """Keep ``entry`` while the cache holds at most ``cache_bytes`` of pixel values, dropping the
        least recently used first (one larger than the whole bound is not kept)."""
        size = _nbytes(entry[0])
        if size > self.cache_bytes:
            return
        while self._cache and self._cached + size > self.cache_bytes:
            self._cached -= _nbytes(self._cache.popitem(last=False)[1][0])
        self._cache[key] = entry
        self._cached += size


def _nbytes(pixel_values: Any) -> int:
    return int(pixel_values.numel()) * int(pixel_values.element_size())
