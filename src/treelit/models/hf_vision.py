"""Vision-language checkpoints in tree mode: each distinct image encoded once per row.

The families (``VISION_FAMILIES``: Qwen2.5-VL, Qwen3-VL, Qwen3.5 and Qwen3.5-MoE with their
vision tower, Qwen3-VL-MoE, GLM-4.5V, Gemma-3) share one shape: a vision tower turns an
image's pixels into embedding rows (``get_image_features``; Qwen / GLM: ``t*h*w / merge**2``
rows from pixel patches), the language model reads them in place of the image's placeholder
tokens. Positions are multimodal RoPE (M-RoPE) in all but Gemma-3: three rows (time, height,
width) that a position function (``get_rope_index``) derives from the token types and image
grids of a sequence. The mixture-of-experts families route, replay recorded routes
(``model.moe.routing=replay``) and take the router loss as their text models do
(:mod:`treelit.models.hf_adapter`).

Gemma-3 differs in two family-specific ways (:mod:`treelit.models.hf_gemma3`, chosen through
``_INPUTS``): plain positions, and a language model that attends bidirectionally inside each
image block, which the tree mask takes as one wider visibility interval per block key on the
backends that read intervals as they are (``sdpa_dense``, ``flex``; others refused by name).

In tree mode (an adapted model with :class:`VisionInputs`, ``model.vision``):

* the row's distinct images (:class:`~treelit.tree.images.ImageSet`) go through the tower
  once, and each image token gathers its row of their embeddings (``batch.image_row``); a
  tower that trains thus gets the sum of every branch's gradient, as per-branch training
  would after encoding each image once per branch. Qwen3-VL's deepstack features are
  gathered the same way.
* M-RoPE positions are the model's own ``get_rope_index`` run on every branch (its token
  types and image grids in order); a token shared by several branches must get the same
  positions from each (its prefix decides them), which is asserted, and the result is kept
  on the row (``batch.mrope_position_ids [3, N]``).
* everything else is the transformers model's own code, as for text models
  (:mod:`treelit.models.hf_adapter`): attention through the tree backends, Qwen3.5's Gated
  DeltaNet through treelit's tree kernels, the vision tower on its own sdpa attention (an
  image attends within itself, never across the tree).

In training the step's image encoder (:class:`~treelit.lightning.image_part.ImageEncoder`, a
step part) runs the tower once per micro-batch and hands every pass the rows it needs
(``batch.image_embeds``); the tower's backward then runs once, with the gradient the passes
summed. Without it (library use: ``tree_loss``, ``tree_backward``), a part of a row (a
partition; :meth:`TreeBatch.subset`) keeps the images its tokens show and encodes them
itself: an image shown in two partitions is encoded by each, and the tower's gradient is the
sum over them, as it is over branches. A part's positions are the whole row's (the part holds
no branches), computed once on the row and sliced.

``freeze_vision``: the tower's parameters stop requiring gradients (the common LoRA / RL
setting); the projector (the patch merger, part of the tower in these families) follows. With
LoRA (adapters on the language model only) the tower is part of the frozen base, unless
``model.lora.modules_to_save`` names it (``[visual]``): PEFT's trained copy of the tower then
trains in full beside the adapters, and is saved with them.

Refused by ``model_type`` (``_REFUSED``): Qwen2-VL, not among the families checked against
transformers.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Dict, Optional

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from treelit.models.errors import CheckpointError

__all__ = ["VISION_FAMILIES", "VisionInputs", "mrope_positions", "check_vision_config", "tower_blocks",
           "vision_inputs"]

VISION_FAMILIES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen3_5": "Qwen3.5",
                   "qwen3_5_moe": "Qwen3.5-MoE", "qwen3_vl_moe": "Qwen3-VL-MoE", "glm4v_moe": "GLM-4.5V",
                   "gemma3": "Gemma-3"}
# families whose inputs are not the M-RoPE ones of VisionInputs: "module:class"
_INPUTS = {"gemma3": "treelit.models.hf_gemma3:Gemma3Inputs"}
_REFUSED = {
    "qwen2_vl": "Qwen2-VL is not among the vision families treelit checks against transformers "
                f"({', '.join(VISION_FAMILIES.values())})",
}


def check_vision_config(cfg, where: str) -> None:
    """Raise :class:`CheckpointError` naming ``model_type`` for a vision checkpoint treelit cannot run."""
    mt = getattr(cfg, "model_type", "")
    if mt in _REFUSED:
        raise CheckpointError(f"{where}: config key 'model_type' = {mt!r}: {_REFUSED[mt]}")
    if mt not in VISION_FAMILIES:
        raise CheckpointError(f"{where}: config key 'model_type' = {mt!r}: model.vision=true runs the vision "
                              f"families {sorted(VISION_FAMILIES)} only")
    if getattr(cfg, "vision_config", None) is None:
        raise CheckpointError(f"{where}: config key 'vision_config' is missing: the checkpoint has no vision tower")


def vision_inputs(hf_model: nn.Module, freeze_vision: bool = False, images_per_pass: int = 0) -> "VisionInputs":
    """The :class:`VisionInputs` of ``hf_model``'s family."""
    spec = _INPUTS.get(getattr(hf_model.config, "model_type", ""))
    cls = VisionInputs
    if spec is not None:
        module, name = spec.split(":")
        cls = getattr(importlib.import_module(module), name)
    return cls(hf_model, freeze_vision, images_per_pass)


class VisionInputs:
    """The part of an adapted vision-language model (:class:`~treelit.models.hf_adapter.HFTreeModel`
    with ``vision``) that makes its language model's inputs: embeddings with each image token's
    row of its once-encoded image, and M-RoPE positions.

    ``hf.model.visual`` is the vision tower (sdpa attention), ``hf.model.language_model`` the
    text model (``attn_implementation="treelit"``). Held by reference, not as a submodule: the
    parameters stay the wrapped model's (``hf.`` names)."""

    def __init__(self, hf_model: nn.Module, freeze_vision: bool = False, images_per_pass: int = 0) -> None:
        self._hf = [hf_model]  # a list: not registered as a submodule of the adapter a second time
        self.image_token_id = int(hf_model.config.image_token_id)
        self.freeze_vision = bool(freeze_vision)
        if isinstance(images_per_pass, bool) or not isinstance(images_per_pass, int) or images_per_pass < 0:
            raise ValueError(f"model.vision_images_per_pass must be an integer >= 0, got {images_per_pass!r}")
        self.images_per_pass = images_per_pass
        if self.freeze_vision:
            for p in self.visual.parameters():
                p.requires_grad_(False)
        self.images_encoded = 0  # distinct images run through the tower (for benchmarks and logs)

    @property
    def vlm(self) -> nn.Module:
        return self._hf[0].model

    @property
    def visual(self) -> nn.Module:
        return self._hf[0].model.visual

    @property
    def language_model(self) -> nn.Module:
        return self._hf[0].model.language_model

    def tower_trains(self) -> bool:
        """Whether any parameter of the tower (or LoRA's trained copy of it) requires a gradient."""
        return any(p.requires_grad for p in self.visual.parameters())

    def base_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx) -> Dict[str, Any]:
        batch = getattr(ctx, "batch", None)
        embeds = self.language_model.get_input_embeddings()(input_ids)
        if batch is None and getattr(ctx, "images", None) is not None:  # causal rows, each with its own images
            return self._causal_rows(input_ids, position_ids, ctx, embeds)
        if batch is None:  # causal rows of text (the plain forward): M-RoPE of text is the position thrice
            return {"inputs_embeds": embeds, "position_ids": position_ids[None].expand(3, -1, -1)}
        kw: Dict[str, Any] = {"position_ids": mrope_positions(self.vlm, batch)[:, None, :]}
        if batch.images is not None and batch.images.num_images:
            embeds, extra = self._with_images(batch, embeds)
            kw.update(extra)
        if not embeds.requires_grad and torch.is_grad_enabled() and self.tower_trains():
            # a row without images reads no tower rows: its inputs require a gradient all the same, as a
            # row with images does, so that under FSDP2 the first layer's gradient reduction runs at the
            # same point of every rank's backward (with LoRA the embeddings are frozen)
            embeds = embeds.detach().requires_grad_(True)
        kw["inputs_embeds"] = embeds
        return kw

    def _causal_rows(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx, embeds: torch.Tensor):
        """Right-padded causal rows ``[B, L]`` (the per-branch baseline), row ``r`` showing
        ``ctx.images[r]`` in order: each row's images encoded for that row alone (per-branch training
        encodes an image once per branch that shows it), its image tokens take their rows, and its
        M-RoPE positions are the model's ``get_rope_index`` on the row's real tokens."""
        B, L = input_ids.shape
        lengths = ctx.lengths.tolist() if ctx.lengths is not None else [L] * B
        is_img = input_ids == self.image_token_id
        pos = position_ids[None].expand(3, B, L).clone()
        out = embeds.clone()
        deep_rows = []
        for r, images in enumerate(ctx.images):
            if images is None or not images.num_images:
                continue
            n = lengths[r]
            rows, deep = self.encode(images)
            at = torch.nonzero(is_img[r, :n]).squeeze(1)
            if at.numel() != rows.shape[0]:
                raise ValueError(f"row {r}: {at.numel()} image tokens for {rows.shape[0]} embedding rows of its images")
            out[r, at] = rows.to(out.dtype)
            p, _ = self.vlm.get_rope_index(input_ids[r:r + 1, :n], mm_token_type_ids=is_img[r:r + 1, :n].int(),
                                           image_grid_thw=images.grid_thw.to(input_ids.device))
            pos[:, r, :n] = p[:, 0].to(pos.device)
            deep_rows.append(deep)
        kw: Dict[str, Any] = {"inputs_embeds": out, "position_ids": pos}
        if deep_rows and deep_rows[0]:  # Qwen3-VL: in the order of the image tokens, row by row
            kw["visual_pos_masks"] = is_img
            kw["deepstack_visual_embeds"] = [torch.cat([d[lvl] for d in deep_rows]).to(out.dtype)
                                             for lvl in range(len(deep_rows[0]))]
        return kw

    def _with_images(self, batch, embeds: torch.Tensor):
        """``embeds [1, N, D]`` with each image token's embedding row of its (once-encoded) image:
        the row's ``image_embeds`` of this tower when the step's image encoder encoded them for the micro-batch
        (:mod:`treelit.lightning.image_part`), else encoded here."""
        pre = (getattr(batch, "image_embeds", None) or {}).get(self)  # (another model's tower: not its rows)
        rows, deep = (pre.rows, pre.deep) if pre is not None else self.encode(batch.images)
        rows = rows.to(embeds.dtype)
        sel = batch.image_row >= 0
        at = batch.image_row.clamp(min=0)
        out = torch.where(sel[None, :, None], rows[at][None], embeds)
        extra: Dict[str, Any] = {}
        if deep:  # Qwen3-VL: features of early tower layers added to the first text layers' image tokens
            idx = batch.image_row[sel]
            extra["visual_pos_masks"] = sel[None]
            extra["deepstack_visual_embeds"] = [f.to(embeds.dtype)[idx] for f in deep]
        return out, extra

    def encode(self, images):
        """Embedding rows ``[sum tokens, D]`` of a row's distinct images (and Qwen3-VL's deepstack
        rows per level). With ``images_per_pass`` = k > 0 the tower runs k images at a time, each
        group's activations recomputed in the backward (activation checkpointing, exact): the
        tower's activation memory is that of k images, not of all of them, for one more forward."""
        self.images_encoded += images.num_images
        k = self.images_per_pass
        if not k or k >= images.num_images or not torch.is_grad_enabled():
            return self._features(images.pixel_values, images.grid_thw)
        modes = _function_modes()
        patches = torch.cat([images.grid_thw.new_zeros(1), torch.cumsum(images.grid_thw.prod(-1), 0)]).tolist()
        parts = []
        for i in range(0, images.num_images, k):
            j = min(i + k, images.num_images)
            pv, grid = images.pixel_values[patches[i]:patches[j]], images.grid_thw[i:j]
            parts.append(checkpoint(self._features, pv, grid, use_reentrant=False,
                                    context_fn=lambda: (contextlib.nullcontext(), _entered(modes))))
        rows = torch.cat([p[0] for p in parts])
        deep = [torch.cat([p[1][lvl] for p in parts]) for lvl in range(len(parts[0][1]))]
        return rows, deep

    def _features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        feats = self.vlm.get_image_features(pixel_values, grid_thw, return_dict=True)
        deep = getattr(feats, "deepstack_features", None) or []
        return torch.cat(feats.pooler_output), [torch.cat(f) for f in deep]


def tower_blocks(visual: nn.Module) -> list:
    """The vision tower's blocks (FSDP2's units: :meth:`HFTreeModel.fsdp_blocks`). A tower that
    LoRA trains in full (``model.lora.modules_to_save`` naming it) is PEFT's wrapper: the frozen
    original's blocks (what runs with the adapters off) and the trained copy's."""
    towers = [visual]
    if hasattr(visual, "original_module") and hasattr(visual, "modules_to_save"):
        towers = [visual.original_module, *visual.modules_to_save.values()]
    return [b for t in towers for b in t.blocks]


def _function_modes() -> list:
    """The torch-function modes active now (outermost first)."""
    return list(_get_current_function_mode_stack())


@contextlib.contextmanager
def _entered(modes):
    """Recompute under the torch-function modes the forward ran under, as the forward saw them
    (the backward runs outside them)."""
    with contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        yield


def _branch_grids(batch, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """The grids of the images a branch shows, in order (None: no image)."""
    rows = batch.image_row[tokens]
    starts = batch.images.row_offsets.to(rows.device)
    first = torch.isin(rows, starts[:-1]) & (rows >= 0)
    if not bool(first.any()):
        return None
    which = torch.searchsorted(starts, rows[first], right=True) - 1
    return batch.images.grid_thw.to(rows.device)[which]


def mrope_positions(vlm: nn.Module, batch) -> torch.Tensor:
    """M-RoPE positions ``[3, N]`` of the row: the model's ``get_rope_index`` (``vlm``: the
    transformers ``*Model`` holding it) on every branch,
    checked to agree on every shared token; kept on the row (``batch.mrope_position_ids``)."""
    if batch.mrope_position_ids is not None:
        return batch.mrope_position_ids
    if batch.mrope_parent is not None:  # a part of a row: its parent's positions at its tokens
        parent, tokens = batch.mrope_parent
        batch.mrope_position_ids = mrope_positions(vlm, parent)[:, tokens.to(parent.device)].to(batch.device)
        return batch.mrope_position_ids
    N, dev = batch.num_tokens, batch.device
    if batch.num_branches == 0 and batch.image_row is None:  # a part of a row of text: the position thrice
        return batch.position_ids[None].expand(3, -1)
    if batch.num_branches == 0:
        raise ValueError("M-RoPE positions need the row's branch tables (a row cut from a tree has none)")
    pos = torch.full((3, N), -1, dtype=torch.long, device=dev)
    is_img = (batch.image_row >= 0) if batch.image_row is not None else torch.zeros(N, dtype=torch.bool, device=dev)
    ptr = batch.branch_ptr.tolist()
    for b in range(batch.num_branches):
        tokens = batch.branch_tokens[ptr[b]:ptr[b + 1]]
        ids = batch.input_ids[tokens][None]
        grids = _branch_grids(batch, tokens) if batch.images is not None else None
        if grids is None:
            p = torch.arange(ids.shape[1], device=dev).expand(3, -1)  # text: transformers' own default
        else:
            p, _ = vlm.get_rope_index(ids, mm_token_type_ids=is_img[tokens][None].int(), image_grid_thw=grids)
            p = p[:, 0].to(dev)
        seen = pos[0, tokens] >= 0
        if bool(seen.any()) and not torch.equal(pos[:, tokens][:, seen], p[:, seen]):
            t = int(torch.nonzero(seen & (pos[:, tokens] != p).any(0))[0])
            raise AssertionError(f"branch {b}: M-RoPE positions of its token {t} differ from another branch's "
                                 "through the same token")
        pos[:, tokens] = p
    batch.mrope_position_ids = pos
    return pos
