"""Tree builders (registry kind ``tree_builder``): records in, :class:`TokenTree` s out."""

from treelit.builders.base import TREE_BUILDERS, BuiltTree, TreeBuilder, build_tree_from_branches

__all__ = ["TREE_BUILDERS", "BuiltTree", "TreeBuilder", "build_tree_from_branches"]
