"""``sft``: next-token cross-entropy on the loss-masked targets."""

from __future__ import annotations

from treelit.loss.linear import branches_from_batch, linear_loss
from treelit.loss.tree import tree_loss
from treelit.objectives.base import OBJECTIVES, Objective


@OBJECTIVES.register("sft")
class SFT(Objective):
    name = "sft"

    def data_needs(self):
        return {"advantage": False, "old_logprobs": False, "ref_logprobs": False, "pairs": False}

    def tree_loss(self, model, batch, *, aggregation, normalizer, attention="auto", chunk_rows=None):
        loss = tree_loss(model, batch, aggregation, attention, normalizer=normalizer, chunk_rows=chunk_rows)
        return loss, {}

    def linear_loss(self, model, batch, *, aggregation, normalizer, chunk_rows=None):
        branches, masks, weights = branches_from_batch(batch)
        loss = linear_loss(model, branches, masks, weights, aggregation, normalizer=normalizer, chunk_rows=chunk_rows)
        return loss, {}
