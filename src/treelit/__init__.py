"""treelit: exact training of language models on prefix trees of token sequences.

Shared prefixes (system prompts, earlier turns, GRPO prompts) are computed once;
the loss and every gradient equal those of training each branch on its own.

``import treelit`` loads nothing else: each name below (and each subpackage,
``treelit.models``) is imported on first use (:mod:`treelit.lazy`, PEP 562), so the
command-line tools and a user's first import do not pay for torch, torchtune,
Lightning or MLflow until they use them.
"""

from typing import TYPE_CHECKING

from treelit.lazy import lazy_exports

if TYPE_CHECKING:
    from treelit.api import global_normalizer, linear_backward, linear_loss, tree_loss
    from treelit.loss.branches import Branches
    from treelit.loss.logprobs import token_logprobs
    from treelit.models.config import DecoderConfig
    from treelit.models.decoder import TreeDecoder, build_decoder
    from treelit.models.hf import load_hf_checkpoint, save_hf_checkpoint
    from treelit.models.hf_adapter import HFTreeModel, load_hf_model
    from treelit.models.registry import build_model
    from treelit.objectives.base import make_objective
    from treelit.partition.backward import tree_backward
    from treelit.tree.batch import AGGREGATIONS, TreeBatch, pack_trees
    from treelit.tree.errors import TreeInputError
    from treelit.tree.token_tree import TokenTree

__version__ = "0.1.0"

_EXPORTS = {
    "global_normalizer": "treelit.api",
    "linear_backward": "treelit.api",
    "linear_loss": "treelit.api",
    "tree_loss": "treelit.api",
    "Branches": "treelit.loss.branches",
    "token_logprobs": "treelit.loss.logprobs",
    "DecoderConfig": "treelit.models.config",
    "TreeDecoder": "treelit.models.decoder",
    "build_decoder": "treelit.models.decoder",
    "load_hf_checkpoint": "treelit.models.hf",
    "save_hf_checkpoint": "treelit.models.hf",
    "HFTreeModel": "treelit.models.hf_adapter",
    "load_hf_model": "treelit.models.hf_adapter",
    "build_model": "treelit.models.registry",
    "make_objective": "treelit.objectives.base",
    "tree_backward": "treelit.partition.backward",
    "AGGREGATIONS": "treelit.tree.batch",
    "TreeBatch": "treelit.tree.batch",
    "pack_trees": "treelit.tree.batch",
    "TreeInputError": "treelit.tree.errors",
    "TokenTree": "treelit.tree.token_tree",
}
_EXPORTS.update({sub: f"treelit.{sub}" for sub in (
    "api", "attention", "builders", "cli", "components", "data", "lightning", "loss", "models", "objectives",
    "partition", "registry", "rl", "ssm", "tree", "utils")})
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

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
