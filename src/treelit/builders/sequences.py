"""``sequences``: each record's token branches form one tree."""

from __future__ import annotations

from typing import Iterable, List

from treelit.builders.base import TREE_BUILDERS, BuiltTree, TokenBuilder, fill_advantages
from treelit.data.records import Record


@TREE_BUILDERS.register("sequences")
class SequencesBuilder(TokenBuilder):
    """One tree per record; advantage groups are the branches' ``group`` field, else the record.
    Options: see :class:`~treelit.builders.base.TokenBuilder`."""

    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        records = list(records)
        items = [(b, b.get("group", r.id)) for r in records for b in r.data["branches"]]
        fill_advantages(items, self.advantage, **self.advantage_options)
        return [self.tree(r.data["branches"], r.id, r.source) for r in records]
