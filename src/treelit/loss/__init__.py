"""Loss primitives: the chunked log-prob head, tree-mode and per-branch passes, the router loss.

The entry points (``treelit.tree_loss``, ``treelit.linear_loss``) live in :mod:`treelit.api`:
objective -> these primitives -> decoder -> attention backend.

The names below are imported on first use (:mod:`treelit.lazy`): the tree builders read
:mod:`treelit.loss.branches` (per-branch inputs) without loading the decoder.
"""

from typing import TYPE_CHECKING

from treelit.lazy import lazy_exports

if TYPE_CHECKING:
    from treelit.loss.branches import Branches, as_branches
    from treelit.loss.linear import linear_branch_logprobs, sft_linear_loss
    from treelit.loss.logprobs import token_logprobs
    from treelit.loss.tree import prepare_batch, sft_tree_loss, tree_hidden, tree_token_logprobs

_EXPORTS = {
    "Branches": "treelit.loss.branches",
    "as_branches": "treelit.loss.branches",
    "linear_branch_logprobs": "treelit.loss.linear",
    "sft_linear_loss": "treelit.loss.linear",
    "token_logprobs": "treelit.loss.logprobs",
    "prepare_batch": "treelit.loss.tree",
    "sft_tree_loss": "treelit.loss.tree",
    "tree_hidden": "treelit.loss.tree",
    "tree_token_logprobs": "treelit.loss.tree",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["Branches", "as_branches", "linear_branch_logprobs", "prepare_batch", "sft_linear_loss", "sft_tree_loss",
           "token_logprobs", "tree_hidden", "tree_token_logprobs"]
