"""Losses: the chunked log-prob head, tree-mode loss and the linearized baseline."""

from treelit.loss.linear import linear_backward, linear_loss
from treelit.loss.logprobs import token_logprobs
from treelit.loss.tree import tree_hidden, tree_loss

__all__ = ["linear_backward", "linear_loss", "token_logprobs", "tree_hidden", "tree_loss"]
