"""treelit: exact training of language models on prefix trees of token sequences.

Shared prefixes (system prompts, earlier turns, GRPO prompts) are computed once;
the loss and every gradient equal those of training each branch on its own.
"""

from treelit.api import linear_backward, linear_loss, tree_loss
from treelit.loss import Branches, token_logprobs
from treelit.models import DecoderConfig, TreeDecoder, build_decoder, build_model, load_hf_checkpoint, save_hf_checkpoint
from treelit.models.hf_adapter import HFTreeModel, load_hf_model
from treelit.objectives import make_objective
from treelit.partition import tree_backward
from treelit.tree import AGGREGATIONS, TokenTree, TreeBatch, TreeInputError, global_normalizer, pack_trees

__version__ = "0.1.0"

__all__ = [
    "AGGREGATIONS",
    "Branches",
    "DecoderConfig",
    "TokenTree",
    "TreeBatch",
    "TreeDecoder",
    "TreeInputError",
    "build_decoder",
    "build_model",
    "global_normalizer",
    "linear_backward",
    "linear_loss",
    "make_objective",
    "load_hf_checkpoint",
    "load_hf_model",
    "HFTreeModel",
    "pack_trees",
    "save_hf_checkpoint",
    "token_logprobs",
    "tree_backward",
    "tree_loss",
]
