"""``groups``: records (or branches) sharing a group key are merged into one tree.

A GRPO prompt's samples, or the trials of one agent task, usually arrive as separate
records; merging them lets their common prompt be computed once. The key is read from
the record (``key`` field) or, failing that, from each branch; records without a key
stay trees of their own.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

from treelit.builders.base import TREE_BUILDERS, BuiltTree, TokenBuilder, fill_advantages
from treelit.data.records import Record


@TREE_BUILDERS.register("groups")
class GroupsBuilder(TokenBuilder):
    """Args:
        key: the group field name (default ``group``); other options as for
            :class:`~treelit.builders.base.TokenBuilder` (advantages are computed within groups).
    """

    def __init__(self, key: str = "group", **options: Any) -> None:
        super().__init__(**options)
        self.key = key

    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        records = list(records)
        items = [(b, b.get(self.key, r.data.get(self.key, r.id))) for r in records for b in r.data["branches"]]
        fill_advantages(items, self.advantage, **self.advantage_options)

        groups: Dict[str, List[dict]] = {}
        sources: Dict[str, str] = {}
        out: List[BuiltTree] = []
        for r in records:
            rkey = r.data.get(self.key)
            for br in r.data["branches"]:
                k = br.get(self.key, rkey)
                if k is None:
                    continue
                gid = f"{self.key}={k}"
                groups.setdefault(gid, []).append({**br, self.key: k, "_record": r.id})
                sources.setdefault(gid, r.source)
            if all(br.get(self.key, rkey) is None for br in r.data["branches"]):
                out.append(self.tree(r.data["branches"], r.id, r.source))
        for gid, branches in groups.items():
            out.append(self.tree(branches, gid, sources[gid]))
        return out
