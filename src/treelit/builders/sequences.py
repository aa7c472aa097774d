"""``sequences``: each record's token branches form one tree."""

from __future__ import annotations

from typing import Any, Dict, List

from treelit.builders.base import TREE_BUILDERS, TokenBuilder
from treelit.data.records import Record


@TREE_BUILDERS.register("sequences")
class SequencesBuilder(TokenBuilder):
    """One tree per record. Advantage groups (with ``advantage``) are the branches' ``group``
    field, else the record (a missing or null ``group`` means the record's own group).
    Options: see :class:`~treelit.builders.base.TokenBuilder`."""

    def advantage_keys(self, record: Record, branches: List[Dict[str, Any]]) -> List[Any]:
        return [b.get("group") for b in branches]
