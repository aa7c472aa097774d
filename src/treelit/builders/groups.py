"""``groups``: records (or branches) sharing a group key are merged into one tree.

A GRPO prompt's samples, or the trials of one agent task, usually arrive as separate
records; merging them lets their common prompt be computed once. A branch's key is its
own ``key`` field, else its record's; branches without a key (missing or null) form the
tree of their record. Keys are strings or integers and keep their type (``7`` and
``"7"`` are different groups). Advantages are computed within groups.
"""

from __future__ import annotations

from typing import Any, Dict, List

from treelit.builders.base import TREE_BUILDERS, TokenBuilder
from treelit.data.records import Record, check_key, validate_token_record


@TREE_BUILDERS.register("groups")
class GroupsBuilder(TokenBuilder):
    """Args:
        key: the group field name (default ``group``); other options as for
            :class:`~treelit.builders.base.TokenBuilder` (advantages are computed within groups).
    """

    def __init__(self, key: str = "group", **options: Any) -> None:
        super().__init__(**options)
        if not isinstance(key, str) or not key:
            raise ValueError(f"tree_builder.key must be a field name, got {key!r}")
        self.key = key
        self.group_field = key

    def validate(self, rec: Any, source: str) -> None:  # noqa: D102 - also checks the key fields
        validate_token_record(rec, source)
        check_key(rec.get(self.key), f"{source}: {self.key}")
        for j, br in enumerate(rec["branches"]):
            check_key(br.get(self.key), f"{source}: branches[{j}].{self.key}")

    def tree_keys(self, record: Record, branches: List[Dict[str, Any]]) -> List[Any]:
        rkey = record.data.get(self.key)
        return [b.get(self.key) if b.get(self.key) is not None else rkey for b in branches]

    def encode(self, record: Record) -> List[Dict[str, Any]]:
        out = super().encode(record)
        if self.key == "group":  # a record-level key is every branch's group
            for b, k in zip(out, self.tree_keys(record, out)):
                b["group"] = k
        return out
