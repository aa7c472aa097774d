"""Loss primitives: the chunked log-prob head, tree-mode and per-branch passes, the router loss.

The entry points (``treelit.tree_loss``, ``treelit.linear_loss``) live in :mod:`treelit.api`:
objective -> these primitives -> decoder -> attention backend.
"""

from treelit.loss.branches import Branches, as_branches
from treelit.loss.linear import linear_branch_logprobs, sft_linear_loss
from treelit.loss.logprobs import token_logprobs
from treelit.loss.tree import sft_tree_loss, tree_hidden, tree_token_logprobs

__all__ = ["Branches", "as_branches", "linear_branch_logprobs", "sft_linear_loss", "sft_tree_loss", "token_logprobs",
           "tree_hidden", "tree_token_logprobs"]
