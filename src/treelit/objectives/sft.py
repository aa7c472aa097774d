"""``sft``: next-token cross-entropy on the loss-masked targets."""

from __future__ import annotations

from treelit import loss as primitives  # the loss face: the decoder (torchtune) is imported on the first loss
from treelit.loss.branches import as_branches
from treelit.objectives.base import OBJECTIVES, Objective


@OBJECTIVES.register("sft")
class SFT(Objective):
    name = "sft"

    def data_needs(self):
        return {"advantage": False, "old_logprobs": False, "ref_logprobs": False, "pairs": False}

    def tree_loss(self, model, batch, *, aggregation, normalizer, attention="auto", chunk_rows=None):
        loss = primitives.sft_tree_loss(model, batch, aggregation, attention, normalizer=normalizer, chunk_rows=chunk_rows)
        return loss, {}

    def linear_loss(self, model, branches, *, aggregation, normalizer, chunk_rows=None, max_tokens=8192):
        return primitives.sft_linear_loss(model, as_branches(branches), aggregation, normalizer=normalizer,
                                          chunk_rows=chunk_rows, max_tokens=max_tokens), {}
