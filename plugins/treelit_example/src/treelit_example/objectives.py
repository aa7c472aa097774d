"""An objective built on treelit's SFT objective: the same loss, scaled."""

from __future__ import annotations

from treelit.objectives.sft import SFT


class ScaledSFT(SFT):
    name = "scaled_sft"

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def tree_loss(self, model, batch, **kw):
        loss, metrics = super().tree_loss(model, batch, **kw)
        return loss * self.scale, {**metrics, "scale": self.scale}

    def linear_loss(self, model, batch, **kw):
        loss, metrics = super().linear_loss(model, batch, **kw)
        return loss * self.scale, {**metrics, "scale": self.scale}
