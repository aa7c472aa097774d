"""Images in trees: placeholder tokens keyed by content, each distinct image stored once.

A vision-language checkpoint's processor turns every image into ``n`` copies of one
placeholder token id (Qwen: ``<|image_pad|>``; ``n = t*h*w / merge**2`` from its
``image_grid_thw``) and a block of pixel patches. Two screenshots of the same size give the
same placeholder ids, so a trie keyed by token id alone would merge them and train one
branch on the other's pixels. Here a placeholder token's identity is ``(token id, content
digest of its image)``: the trie is built over *merge keys* - the token id for text, a
negative key per distinct image for placeholders - and the real ids are put back after.
Two branches share an image span only when the images' digests agree; the digest is over the
processor's output (grid and pixel values), which is exactly what the vision tower sees, so
a merge never changes what any branch computes.

Each distinct image of a row is kept once (:class:`ImageSet`): its pixel patches, its grid
and its digest. ``image_row [N]`` gives each tree token its row in the concatenated
embeddings of the row's images (``-1`` for text tokens), so the model encodes every
distinct image once and gathers its embeddings to each token that shows it; the gradient
reaching the vision tower is then the sum over every branch (and every occurrence) of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from treelit.tree.errors import TreeInputError

__all__ = ["ProcessedImage", "ImageSet", "EncodedImages", "image_counts", "image_digest", "merge_keys"]


def image_digest(pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> str:
    """SHA-256 over the grid and the pixel values' bytes (dtype and shape included)."""
    h = hashlib.sha256()
    pv = pixel_values.detach().cpu().contiguous()
    h.update(repr((tuple(int(g) for g in grid_thw), str(pv.dtype), tuple(pv.shape))).encode())
    h.update(pv.view(torch.uint8).numpy().tobytes() if pv.numel() else b"")
    return h.hexdigest()


@dataclass
class ProcessedImage:
    """One image as the checkpoint's processor made it.

    ``pixel_values [P, C]`` (P patches of C values), ``grid_thw`` (t, h, w in patches),
    ``num_tokens`` placeholder tokens it becomes, ``token_id`` the placeholder id, ``digest``
    (:func:`image_digest`), ``name`` where it came from (for messages)."""

    pixel_values: torch.Tensor
    grid_thw: Tuple[int, int, int]
    num_tokens: int
    token_id: int
    digest: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = image_digest(self.pixel_values, self.grid_thw)


@dataclass
class ImageSet:
    """The distinct images of one row. ``pixel_values [sum P, C]`` (concatenated in order),
    ``grid_thw [I, 3]`` long, ``num_tokens [I]`` long (embedding rows per image), ``digests``."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    num_tokens: torch.Tensor
    digests: List[str]

    @classmethod
    def of(cls, images: Sequence[ProcessedImage]) -> "ImageSet":
        return cls(pixel_values=torch.cat([im.pixel_values for im in images]),
                   grid_thw=torch.tensor([list(im.grid_thw) for im in images], dtype=torch.long),
                   num_tokens=torch.tensor([im.num_tokens for im in images], dtype=torch.long),
                   digests=[im.digest for im in images])

    @property
    def num_images(self) -> int:
        return len(self.digests)

    @property
    def row_offsets(self) -> torch.Tensor:
        """``[I+1]``: where each image's embedding rows start in the concatenation."""
        return torch.cat([self.num_tokens.new_zeros(1), torch.cumsum(self.num_tokens, 0)])

    def to(self, device: Any) -> "ImageSet":
        return ImageSet(self.pixel_values.to(device), self.grid_thw.to(device), self.num_tokens.to(device),
                        list(self.digests))

    def take(self, which: torch.Tensor) -> "ImageSet":
        """The images ``which`` (indices, in that order, repeats kept) as a set of their own."""
        patches = torch.cat([self.grid_thw.new_zeros(1), torch.cumsum(self.grid_thw.prod(-1), 0)]).tolist()
        idx = [int(i) for i in which]
        return ImageSet(torch.cat([self.pixel_values[patches[i]:patches[i + 1]] for i in idx]), self.grid_thw[idx],
                        self.num_tokens[idx], [self.digests[i] for i in idx])

    def image_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The image each embedding row (``>= 0``) belongs to."""
        return torch.searchsorted(self.row_offsets.to(rows.device), rows, right=True) - 1

    def select(self, rows: torch.Tensor) -> Tuple[Optional["ImageSet"], torch.Tensor]:
        """The images the embedding rows ``rows`` (``-1``: text) come from, as a set of their own,
        and ``rows`` renumbered into it (None, all ``-1``, when no row is an image's)."""
        shown = rows >= 0
        if not bool(shown.any()):
            return None, torch.full_like(rows, -1)
        img = self.image_of_rows(rows[shown])
        keep = torch.unique(img).cpu()
        patches = torch.cat([self.grid_thw.new_zeros(1), torch.cumsum(self.grid_thw.prod(-1), 0)]).tolist()
        starts = self.row_offsets.tolist()
        sub = ImageSet(torch.cat([self.pixel_values[patches[i]:patches[i + 1]] for i in keep.tolist()]),
                       self.grid_thw[keep], self.num_tokens[keep], [self.digests[i] for i in keep.tolist()])
        new_start = sub.row_offsets[:-1].to(rows.device)
        where = torch.searchsorted(keep.to(rows.device), img)  # position of each row's image among the kept
        out = torch.full_like(rows, -1)
        old_start = torch.tensor(starts, device=rows.device)[img]
        out[shown] = new_start[where] + (rows[shown] - old_start)
        return sub, out

    @staticmethod
    def merge(sets: Sequence["ImageSet"]) -> Tuple["ImageSet", List[torch.Tensor]]:
        """One set of the distinct images of ``sets`` and, per set, the new row of each of its
        embedding rows: an image in several sets (same digest) is kept once."""
        first: Dict[str, Tuple[int, int]] = {}  # digest -> (set, image)
        for si, s in enumerate(sets):
            for i, d in enumerate(s.digests):
                first.setdefault(d, (si, i))
        order = list(first)
        parts, grids, counts, start, total = [], [], [], {}, 0
        for d in order:
            si, i = first[d]
            s = sets[si]
            p = torch.cat([s.grid_thw.new_zeros(1), torch.cumsum(s.grid_thw.prod(-1), 0)])
            parts.append(s.pixel_values[int(p[i]):int(p[i + 1])])
            grids.append(s.grid_thw[i])
            counts.append(s.num_tokens[i])
            start[d] = total
            total += int(s.num_tokens[i])
        maps = [torch.cat([torch.arange(start[d], start[d] + int(n)) for d, n in zip(s.digests, s.num_tokens)])
                for s in sets]
        return ImageSet(torch.cat(parts), torch.stack(grids), torch.stack(counts), order), maps


@dataclass
class EncodedImages:
    """A row's images already through the vision tower (the step's image encoder,
    :mod:`treelit.lightning.image_part`): ``rows [R, D]`` the embedding rows of the row's
    :class:`ImageSet` in its order (Qwen3-VL: ``deep``, its deepstack rows per level, ``[R, D]``
    each), and ``digests`` / ``row_offsets`` of that set. The model reads them instead of
    encoding the images itself; a part of the row (:meth:`for_set`) reads the rows of its own images."""

    rows: torch.Tensor
    deep: List[torch.Tensor]
    digests: List[str]
    row_offsets: List[int]

    @classmethod
    def of(cls, images: ImageSet, rows: torch.Tensor, deep: Sequence[torch.Tensor]) -> "EncodedImages":
        return cls(rows, list(deep), list(images.digests), images.row_offsets.tolist())

    def for_set(self, images: ImageSet) -> "EncodedImages":
        """The rows of ``images`` (a subset of this row's images, by digest), in its order."""
        if list(images.digests) == self.digests:
            return self
        where = {d: i for i, d in enumerate(self.digests)}
        at = self.rows.device
        idx = torch.cat([torch.arange(self.row_offsets[where[d]], self.row_offsets[where[d] + 1], device=at)
                         for d in images.digests])
        return EncodedImages(self.rows[idx], [f[idx] for f in self.deep], list(images.digests),
                             images.row_offsets.tolist())


def merge_keys(ids: np.ndarray, images: Sequence[ProcessedImage], table: Dict[str, int], source: str,
               b: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge keys of one branch and, per token, its distinct image (-1: text) and its offset
    inside that image's tokens. ``table`` maps ``(placeholder id, digest)`` to distinct-image indices
    (extended here): the content key of every placeholder token.

    The branch's placeholder tokens are taken in order, ``num_tokens`` per image; a count that
    does not add up is an error naming the branch."""
    keys = ids.copy()
    img = np.full(len(ids), -1, dtype=np.int64)
    off = np.zeros(len(ids), dtype=np.int64)
    if not images:
        return keys, img, off
    token_ids = {im.token_id for im in images}
    slots = np.flatnonzero(np.isin(ids, list(token_ids)))
    need = sum(im.num_tokens for im in images)
    if len(slots) != need:
        raise TreeInputError(f"{source}branch {b}: {len(images)} image(s) need {need} placeholder tokens, "
                             f"the branch has {len(slots)}")
    at = 0
    for im in images:
        span = slots[at:at + im.num_tokens]
        if np.any(ids[span] != im.token_id) or (len(span) and span[-1] - span[0] != im.num_tokens - 1):
            raise TreeInputError(f"{source}branch {b}: the placeholder tokens of image {im.name or at} are not one "
                                 f"run of {im.num_tokens} token(s) {im.token_id}")
        j = table.setdefault((im.token_id, im.digest), len(table))
        keys[span] = -(j + 1)  # token ids are >= 0: a negative key never equals a text token
        img[span] = j
        off[span] = np.arange(im.num_tokens)
        at += im.num_tokens
    return keys, img, off


def image_counts(tree: Any) -> Dict[str, int]:
    """A tree's images (``TokenTree`` with ``images`` / ``image_row``): ``images`` the branches
    show in all (an image once per branch that shows it), ``distinct_images`` the tree holds (each
    encoded once), ``shared_images`` of those shown by more than one branch. All 0 without images."""
    out = {"images": 0, "distinct_images": 0, "shared_images": 0}
    images, rows = getattr(tree, "images", None), getattr(tree, "image_row", None)
    if images is None or rows is None:
        return out
    starts = images.row_offsets.numpy()
    shown = np.zeros(images.num_images, dtype=np.int64)
    ptr = tree.branch_ptr
    for b in range(len(ptr) - 1):
        r = rows[tree.branch_tokens[ptr[b]:ptr[b + 1]]]
        r = r[r >= 0]
        if r.size:
            shown[np.unique(np.searchsorted(starts, r, side="right") - 1)] += 1
    out.update(images=int(shown.sum()), distinct_images=int((shown > 0).sum()), shared_images=int((shown > 1).sum()))
    return out
