"""Prefix trees and their DFS serialization."""

from treelit.tree.batch import AGGREGATIONS, TreeBatch, global_normalizer, pack_trees
from treelit.tree.token_tree import TokenTree, TreeInputError

__all__ = ["AGGREGATIONS", "TokenTree", "TreeBatch", "TreeInputError", "global_normalizer", "pack_trees"]
