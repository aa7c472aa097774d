"""The step's image encoder (a :class:`~treelit.lightning.parts.StepPart`): each micro-batch's
distinct images through the vision tower once, whatever the executor cuts the row into.

Why a part: the tower's output is an input of every pass that shows an image, and its
gradient is the sum over every pass (every branch, every partition). Encoded inside each pass
(the library path, :mod:`treelit.models.hf_vision`), a partitioned row encodes an image once
per partition that shows it, and the tower's collectives (FSDP2) happen in some passes and not
in others. Encoded by this part, around the executor's work on one micro-batch:

1. before the passes: the row's distinct images (``mb.images``) go through the tower once,
   inside the model's forward (FSDP2's hooks see it); the passes get a detached leaf of the
   embedding rows (``mb.image_embeds[tower]``, :class:`~treelit.tree.images.EncodedImages`),
   which a partition indexes for its own images (:meth:`TreeBatch.subset`);
2. the passes run and backpropagate as they would: the leaf's gradient accumulates over all
   of them (the whole row, or every partition);
3. after the passes: one backward of the tower with that gradient.

The tower's gradient is then the sum over passes of what each pass sends back through the
rows it read: exactly what encoding in each pass gives (the tower is a function of the image
alone), with one tower forward and backward per micro-batch instead of one per pass. The cost:
the tower's activations live from the encode to its backward, across the micro-batch's passes
(``model.vision_images_per_pass`` bounds them to k images', recomputed in the backward).

No-gradient reads (values, rollout log-probs) get the rows too, without a leaf. A frozen tower
(``model.freeze_vision``) is run without gradient, and nothing runs after the passes.

``critic=separate``: the critic's trunk (a vision model of its own, e.g. ``critic.model=policy``
copies the policy, tower included) sees the images through its own tower, which its value loss
trains, as per-branch training of two models would: it gets an encoder of its own
(:func:`~treelit.lightning.parts.step_parts`), and each model reads the rows of its own tower
(``image_embeds`` is keyed by the tower).

Several processes: the step's collectives must match on every rank. Under FSDP2 / HSDP the
tower is sharded per block like the decoder (:meth:`HFTreeModel.fsdp_blocks`), so each of its
forwards all-gathers: a micro-batch whose row shows no image (a rank without images, a
padding micro-batch) runs the tower on a blank image of the smallest grid and backpropagates
zeros through it, so that every rank calls the tower once forward and once backward per
micro-batch (docs/distributed.md, "Images"). Under DDP the passes issue no collectives and
such a micro-batch encodes nothing (the gradients are summed once per update).

Context parallelism (a row split over a group, :meth:`ImageEncoder.rows`): the group's ranks
hold the same micro-batch and share its distinct images, each image encoded by one rank (its
owner); the rows are gathered to every rank of the group as the leaf, and the leaf's gradient
(each rank's passes' share) is summed over the group before each owner backpropagates its
images' rows (:mod:`treelit.partition.cp_images`).
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch

from treelit.lightning.step_part import StepPart
from treelit.models.forward import in_forward
from treelit.partition.cp_images import cp_encode
from treelit.tree.images import EncodedImages, ImageSet
from treelit.utils.distributed import is_sharded

__all__ = ["ImageEncoder", "has_vision_tower", "blank_images"]


def _inner(model):
    return getattr(model, "module", model)


def has_vision_tower(model) -> bool:
    """Whether ``model`` reads images (an adapted vision-language model, ``model.vision=true``)."""
    return getattr(_inner(model), "vision", None) is not None


def blank_images(visual, dtype, device) -> ImageSet:
    """One blank image of the tower's smallest grid (one merged token): what a micro-batch without
    images runs through a sharded tower, so that every rank calls it alike."""
    cfg = visual.config
    merge = int(getattr(cfg, "spatial_merge_size", 2))
    channels = int(getattr(cfg, "in_channels", getattr(cfg, "in_chans", 3)))
    per_patch = channels * int(getattr(cfg, "temporal_patch_size", 1)) * int(cfg.patch_size) ** 2
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return ImageSet(torch.zeros(merge * merge, per_patch, dtype=dtype, device=device), grid,
                    torch.ones(1, dtype=torch.long, device=device), ["blank"])


class ImageEncoder(StepPart):
    """Each micro-batch's distinct images encoded once, their gradient backpropagated once."""

    name = "images"
    adds = ("the images' embeddings and their gradient",)
    needs = ("a pass's image rows",)

    def __init__(self, model) -> None:
        self.model = model  # the policy, or a separate critic's trunk (each its own tower)
        self.vision = _inner(model).vision

    def encode(self, spec, images: ImageSet) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Embedding rows ``[R, D]`` of ``images`` (and Qwen3-VL's deepstack rows), inside the
        model's forward."""
        return in_forward(self.model, lambda m: self.vision.encode(images))

    def rows(self, spec, images: Optional[ImageSet], collective: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The micro-batch's image rows (``images`` None: a blank image's, for a sharded tower).
        A row split over a context-parallel group: each image encoded by one rank of the group,
        the rows shared, their gradient summed back to it (:func:`~treelit.partition.cp_images.cp_encode`)."""
        if images is not None and spec.cp_degree > 1:
            blank = self._blank if collective else None  # (a sharded tower: every rank runs it)
            return cp_encode(lambda ims: self.encode(spec, ims), images, spec.cp_group, blank)
        return self.encode(spec, images if images is not None else self._blank())

    def _blank(self) -> ImageSet:
        p = next(self.vision.visual.parameters())
        return blank_images(self.vision.visual, p.dtype, p.device)

    def backward(self, outputs: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
        """The tower's backward with the gradient the passes sent back to its rows (under context
        parallelism, through the group's sum to each image's owner)."""
        torch.autograd.backward(outputs, grads)

    # the hook ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, spec, mb, grad: bool):
        images = mb.images if mb.images is not None and mb.images.num_images else None
        collective = is_sharded(self.model)  # every rank calls the sharded tower alike
        if spec.mode != "tree":  # the per-branch baseline encodes each branch's own images (per-branch training)
            yield
            return
        if images is None and not collective:
            yield
            return
        trains = grad and torch.is_grad_enabled() and self.vision.tower_trains()
        with torch.set_grad_enabled(trains):
            rows, deep = self.rows(spec, images, collective)
        outputs = [rows, *deep]
        leaves = [x.detach().requires_grad_(True) for x in outputs] if trains else outputs
        if images is not None:
            mb.image_embeds = {**(mb.image_embeds or {}), self.vision: EncodedImages.of(images, leaves[0], leaves[1:])}
        try:
            yield
        finally:
            if images is not None:
                mb.image_embeds.pop(self.vision, None)
                mb.image_embeds = mb.image_embeds or None
        if trains:
            self.backward(outputs, [_grad(leaf) for leaf in leaves])


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    """The gradient the passes sent back (zeros where none reached the rows: a row whose image
    tokens train nothing, or the blank image)."""
    g: Optional[torch.Tensor] = leaf.grad
    return g if g is not None else torch.zeros_like(leaf)
