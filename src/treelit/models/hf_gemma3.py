"""Gemma-3 with its vision tower in tree mode: bidirectional image blocks in the tree mask.

Gemma-3's processor writes an image as ``<start_of_image>``, ``mm_tokens_per_image`` copies of
the image token and ``<end_of_image>``; its SigLIP tower (a fixed image size) and its projector
(average pooling, a norm, a projection) give those tokens their embeddings
(``get_image_features``: ``[images, mm_tokens_per_image, D]``). Positions are plain: a token's
depth. What sets it apart is the language model's mask: the tokens of one image block (a run
of image tokens, ``token_type_ids == 1``) see each other, before and after, in every layer -
``causal OR same block`` in the global layers, ``(causal OR same block) AND window`` in the
sliding ones (transformers' ``create_masks_for_vision_model``).

In a tree an image block is a run of consecutive row indices on one path: an image's tokens
share their content key, so branches never fork inside one. Key ``j`` of a block is then seen
by the queries ``[start_j, subtree_end_j)``: the earlier tokens of its block and its subtree,
one interval, which the interval backends (``sdpa_dense``, ``flex``) take as it is
(:meth:`~treelit.models.context.TreeContext.see_blocks`); the structure-planned ones
(``segment``) are refused by name. Every branch through a block holds all of it, so each sees
the block exactly as per-branch training does; a window acts on positions as before (a later
token of the block is never out of it).

A row part (a partition) holds whole blocks, or the block is refused: a block cut by the
part's start or end would need keys of another part. Two images with no token between them
would be one block in transformers: refused as well (the processor always writes the markers).
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from treelit.models.hf_vision import VisionInputs

__all__ = ["Gemma3Inputs", "image_blocks"]


def image_blocks(batch) -> torch.Tensor:
    """``start [N]``: the first row index of each token's image block (the token itself for text)."""
    N, dev = batch.num_tokens, batch.device
    idx = torch.arange(N, device=dev)
    rows = batch.image_row
    if rows is None or batch.images is None or not bool((rows >= 0).any()):
        return idx
    img = rows >= 0
    offsets = batch.images.row_offsets.to(dev)
    which = batch.images.image_of_rows(rows.clamp(min=0))
    off = torch.where(img, rows - offsets[which], torch.zeros_like(rows))  # place inside its image
    last = torch.where(img, offsets[which + 1] - 1 - rows, torch.zeros_like(rows))  # tokens of the image after it
    parent = batch.parent
    prev = parent.clamp(min=0)
    inner = img & (off > 0)
    if bool((inner & (parent < 0)).any()):
        t = int(torch.nonzero(inner & (parent < 0))[0])
        raise ValueError(f"row token {t}: an image block of Gemma-3 starts before this row part (a partition or "
                         "a shard cut it); its tokens would need keys of another part")
    if bool((inner & ((parent != idx - 1) | (rows[prev] != rows - 1))).any()):
        raise ValueError("an image's tokens are not one run on a path of the row")
    if bool((img & (off == 0) & (parent >= 0) & img[prev]).any()):
        t = int(torch.nonzero(img & (off == 0) & (parent >= 0) & img[prev])[0])
        raise ValueError(f"row token {t}: two images with no token between them form one bidirectional block in "
                         "Gemma-3; write each image with its start and end markers")
    cut = img & (last > 0)
    nxt = torch.clamp(idx + 1, max=N - 1)
    if bool((cut & ((idx + 1 >= N) | (parent[nxt] != idx))).any()):
        raise ValueError("an image block of Gemma-3 ends past this row part (a partition or a shard cut it); its "
                         "tokens would need keys of another part")
    return torch.where(img, idx - off, idx)


class Gemma3Inputs(VisionInputs):
    """:class:`~treelit.models.hf_vision.VisionInputs` of Gemma-3: plain positions, image rows
    from ``get_image_features`` (one ``[1, 3, H, W]`` pixel block per image, its grid ``(1, 1, 1)``),
    and the image blocks handed to the tree context before the language model runs."""

    @property
    def visual(self) -> nn.Module:
        """The tower and its projector (what ``freeze_vision`` freezes)."""
        return nn.ModuleList([self.vlm.vision_tower, self.vlm.multi_modal_projector])

    def base_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> Dict[str, Any]:
        batch = getattr(ctx, "batch", None)
        emb = self.language_model.get_input_embeddings()
        ids = input_ids.masked_fill(input_ids >= emb.num_embeddings, 0)  # an out-of-vocabulary image id, as Gemma-3
        embeds = emb(ids)
        if batch is not None and batch.images is not None and batch.images.num_images:
            embeds, _ = self._with_images(batch, embeds)
            see = getattr(ctx, "see_blocks", None)
            if see is None:
                raise ValueError(f"{type(ctx).__name__} cannot attend bidirectionally inside Gemma-3's image blocks")
            see(image_blocks(batch))
        return {"inputs_embeds": embeds, "position_ids": position_ids}

    def _features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        feats = self.vlm.get_image_features(pixel_values, return_dict=True)
        return feats.pooler_output.flatten(0, 1), []
