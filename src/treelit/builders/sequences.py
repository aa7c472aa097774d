"""``sequences``: each record's token branches form one tree."""

from __future__ import annotations

from typing import Iterable, List

from treelit.builders.base import TREE_BUILDERS, BuiltTree, TreeBuilder, build_tree_from_branches
from treelit.data.records import Record


@TREE_BUILDERS.register("sequences")
class SequencesBuilder(TreeBuilder):
    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        return [build_tree_from_branches(r.data["branches"], r.id, r.source) for r in records]
