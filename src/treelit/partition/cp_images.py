"""Images under context parallelism: each distinct image of a row encoded by one rank of the
group, its embedding rows shared with every rank, their gradient summed back to that rank.

Under context parallelism (:mod:`treelit.partition.context_parallel`) the ranks of a group hold
the same micro-batch and each runs the model on its range of the row: an image's placeholder
rows may fall on several ranks, or on a rank that did not encode it. The step's image encoder
(:class:`~treelit.lightning.image_part.ImageEncoder`) calls :func:`cp_encode` instead of
running the tower on every image:

1. **Owners.** Every rank computes the same owner for each distinct image of the row
   (:func:`image_owners`: the largest first, each to the rank with the fewest patches so far).
   A rank encodes its own images only, so each image goes through the tower once in the group.
2. **Forward.** The owners' embedding rows (with Qwen3-VL's deepstack rows, side by side) are
   all-gathered, padded to the largest rank's share, and every rank assembles the row's full
   ``[R, D]`` rows in the row's image order: the detached leaf its passes read
   (``batch.image_embeds``), whatever range of the row it holds.
3. **Backward** (:class:`_SharedRows`). After the passes each rank's leaf holds the gradient
   of its own passes; the leaves' gradients are summed over the group (one all-reduce) and each
   owner backpropagates its images' rows of that sum through the tower. The tower's gradient
   is then the one-process gradient, held by the owners; the caller sums the parameters'
   gradients over the group, as it does for the decoder's (FSDP2 does).

Every rank issues the same collectives whether or not it owns an image: a small all-reduce of
the rows' widths and dtype (a rank without images does not know them), the all-gather, and
in the backward the all-reduce. A rank that owns no image runs no tower, unless the tower is
sharded (FSDP2): then it runs the blank image the caller gives (``blank``), whose rows join
nothing and whose backward carries zeros, so that every rank calls the tower once forward and
once backward per micro-batch.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from treelit.partition.cp_exchange import TRAFFIC
from treelit.tree.images import ImageSet

__all__ = ["image_owners", "take_images", "cp_encode"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MAX_LEVELS = 14  # outputs per image row: the embedding and at most 13 deepstack levels

Encode = Callable[[ImageSet], Tuple[torch.Tensor, List[torch.Tensor]]]


def image_owners(images: ImageSet, C: int) -> List[int]:
    """The rank of ``C`` that encodes each image: the largest (most patches) first, each to the
    rank with the fewest patches so far (ties: the lowest rank). The same on every rank."""
    patches = [int(n) for n in images.grid_thw.prod(-1).tolist()]
    load = [0] * C
    owner = [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        r = min(range(C), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += patches[i]
    return owner


def take_images(images: ImageSet, keep: Sequence[int]) -> ImageSet:
    """The images ``keep`` (indices, ascending) of ``images``, as a set of their own."""
    patches = torch.cat([images.grid_thw.new_zeros(1), torch.cumsum(images.grid_thw.prod(-1), 0)]).tolist()
    return ImageSet(torch.cat([images.pixel_values[patches[i]:patches[i + 1]] for i in keep]),
                    images.grid_thw[list(keep)], images.num_tokens[list(keep)], [images.digests[i] for i in keep])


def cp_encode(encode: Encode, images: ImageSet, group, blank: Optional[Callable[[], ImageSet]] = None
              ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Embedding rows ``[R, D]`` of every image of ``images`` (and the deepstack rows), the same
    on every rank of ``group``, each image encoded by its owner only (``encode``: the tower on a
    set of images). Under grad mode the result backpropagates into the owners' towers (after a
    sum over the group). ``blank``: what a rank that owns no image runs through the tower (a
    sharded tower), or None (it runs nothing)."""
    C, rank = dist.get_world_size(group), dist.get_rank(group)
    owners = image_owners(images, C)
    mine = [i for i, r in enumerate(owners) if r == rank]
    own: List[torch.Tensor] = []
    if mine:
        rows, deep = encode(take_images(images, mine))
        own = [rows, *deep]
    elif blank is not None:
        rows, deep = encode(blank())
        own = [rows, *deep]
    layout = _Layout(images, owners, C, rank, bool(mine))
    anchor = torch.zeros(0, device=images.pixel_values.device, requires_grad=torch.is_grad_enabled())
    out = _SharedRows.apply(layout, group, anchor, *own)
    return out[0], list(out[1:])


class _Layout:
    """Where each rank's images' rows sit in the row's ``[R, ...]`` rows."""

    def __init__(self, images: ImageSet, owners: List[int], C: int, rank: int, owns: bool) -> None:
        starts = images.row_offsets.tolist()
        self.R = int(starts[-1])
        self.rank, self.owns = rank, owns
        self.rows: List[List[int]] = [[] for _ in range(C)]  # rank -> the row's rows it encoded, in order
        for i, r in enumerate(owners):
            self.rows[r].extend(range(starts[i], starts[i + 1]))
        self.M = max(len(x) for x in self.rows)  # the padded share

    def of(self, r: int) -> List[int]:
        return self.rows[r]


def _meta(own: Sequence[torch.Tensor], device, group) -> Tuple[List[int], torch.dtype]:
    """The widths of the rows (embedding, then each deepstack level) and their dtype, from the
    ranks that encoded an image (one small all-reduce)."""
    if len(own) > _MAX_LEVELS:
        raise ValueError(f"the vision tower returns {len(own)} row tensors per image; image rows under context "
                         f"parallelism take at most {_MAX_LEVELS}")
    meta = torch.zeros(2 + _MAX_LEVELS, dtype=torch.long, device=device)
    if own:
        meta[0], meta[1] = len(own), _DTYPES.index(own[0].dtype) + 1
        meta[2:2 + len(own)] = torch.tensor([int(x.shape[-1]) for x in own])
    dist.all_reduce(meta, op=dist.ReduceOp.MAX, group=group)
    L = int(meta[0])
    return [int(w) for w in meta[2:2 + L].tolist()], _DTYPES[int(meta[1]) - 1]


class _SharedRows(torch.autograd.Function):
    """``(layout, group, anchor, *own) -> every image's rows`` (one tensor per output level).
    Forward: the owners' rows all-gathered and placed. Backward: the rows' gradients summed over
    the group, each owner's share returned to its own rows (zeros to a blank image's).
    ``anchor``: an empty tensor that requires grad, so that a rank owning nothing takes part in
    the backward's all-reduce too."""

    @staticmethod
    def forward(ctx, layout: _Layout, group, anchor: torch.Tensor, *own: torch.Tensor):
        device = anchor.device
        widths, dtype = _meta(own if layout.owns else [], device, group)
        ctx.layout, ctx.group, ctx.widths, ctx.dtype, ctx.device = layout, group, widths, dtype, device
        ctx.own_like = [(x.shape, x.dtype) for x in own]
        W, M = sum(widths), layout.M
        send = torch.zeros(M, W, dtype=dtype, device=device)
        if layout.owns:
            mine = torch.cat([x.detach().to(dtype) for x in own], -1)
            send[: mine.shape[0]] = mine
        every = [torch.empty_like(send) for _ in layout.rows]
        dist.all_gather(every, send, group=group)
        full = torch.empty(layout.R, W, dtype=dtype, device=device)
        for r, got in enumerate(every):
            rows = layout.of(r)
            if rows:
                full[torch.tensor(rows, device=device)] = got[: len(rows)]
                if r != layout.rank:
                    TRAFFIC.received += len(rows) * W * send.element_size()
        return tuple(x.contiguous() for x in torch.split(full, widths, -1))

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        layout, device = ctx.layout, ctx.device
        parts = [g.to(ctx.dtype) if g is not None else torch.zeros(layout.R, w, dtype=ctx.dtype, device=device)
                 for g, w in zip(grads, ctx.widths)]
        total = torch.cat(parts, -1)
        dist.all_reduce(total, group=ctx.group)  # every rank's passes' share of every image's rows
        TRAFFIC.received += total.numel() * total.element_size()
        if not layout.owns:  # a blank image's rows (or none): zeros through the tower
            return (None, None, None, *[torch.zeros(s, dtype=d, device=device) for s, d in ctx.own_like])
        mine = total[torch.tensor(layout.of(layout.rank), device=device)]
        back = [g.to(d) for g, (_, d) in zip(torch.split(mine, ctx.widths, -1), ctx.own_like)]
        return (None, None, None, *back)
