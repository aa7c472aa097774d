"""Start-up console lines that say which features a run has on.

A run with MoE routing replay, context parallelism or images once printed nothing that said so:
the user learned whether the sampler's experts were replayed, how the rows were split over the
ranks, or whether the images were read at all only from the metrics later, if ever. Each feature
that is on gets one line here, printed once before training (rank 0: the console shows rank 0's
information lines); a feature that is off prints nothing.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["cp_line", "images_line", "routing_line"]


def routing_line(shape: Optional[tuple]) -> str:
    """``model.moe.routing=replay`` in one line ("" when the model routes live); ``shape``:
    :func:`~treelit.models.factory.replay_shape`'s ``(MoE layers, experts, top_k)``."""
    if shape is None:
        return ""
    layers, experts, top_k = shape
    return (f"moe: routing replay (model.moe.routing=replay): each of the {layers} MoE layers routes every token "
            f"to the top-{top_k} of its {experts} experts the records' routed_experts name; the combine weights "
            "are the current router's")


def cp_line(degree: int, world: Optional[int]) -> str:
    """Context parallelism in one line ("" when off): the degree and which ranks share a row.
    ``world``: the run's processes (None: counted at launch)."""
    if degree <= 1:
        return ""
    head = f"context parallelism: degree {degree}, each tree row split over {degree} ranks"
    if world is None or world % degree:
        return f"{head} (groups of {degree} consecutive ranks)"
    groups = [list(range(g * degree, (g + 1) * degree)) for g in range(world // degree)]
    shown = ", ".join(str(g) for g in groups[:4]) + (f", ... ({len(groups)} groups)" if len(groups) > 4 else "")
    return f"{head}; {world} processes, {len(groups)} group{'s' if len(groups) != 1 else ''} of ranks: {shown}"


def images_line(stats: Dict[str, Any]) -> str:
    """The data's images in one line ("" without images): how many a branch shows in all, how
    many distinct ones the trees hold (each encoded once per tree) and how many of those several
    branches share."""
    shown = stats.get("images") or 0
    if not shown:
        return ""
    distinct, shared = stats.get("distinct_images", 0), stats.get("shared_images", 0)
    so_far = "the first trees read: " if stats.get("streamed") else ""
    return (f"images: {so_far}{distinct:,} distinct in the trees (each encoded once), {shared:,} of them shared by "
            f"several branches; {shown:,} shown over the branches")
