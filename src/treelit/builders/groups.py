"""``groups``: records (or branches) sharing a group key are merged into one tree.

A GRPO prompt's samples, or the trials of one agent task, usually arrive as separate
records; merging them lets their common prompt be computed once. The key is read from
the record (``key`` field) or, failing that, from each branch; records without a key
stay trees of their own.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from treelit.builders.base import TREE_BUILDERS, BuiltTree, TreeBuilder, build_tree_from_branches, fill_advantages
from treelit.data.records import Record


@TREE_BUILDERS.register("groups")
class GroupsBuilder(TreeBuilder):
    """Args:
        key: the group field name (default ``group``).
        advantage, logprob_conflict, logprob_tol: as for ``sequences`` (advantages are
            computed within each group).
    """

    def __init__(self, key: str = "group", advantage: Optional[str] = None, logprob_conflict: str = "raise",
                 logprob_tol: float = 1e-4, **advantage_options: Any) -> None:
        self.key = key
        self.advantage = advantage
        self.advantage_options = advantage_options
        self.logprob_conflict = logprob_conflict
        self.logprob_tol = logprob_tol

    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        records = list(records)
        items = [(b, b.get(self.key, r.data.get(self.key, r.id))) for r in records for b in r.data["branches"]]
        fill_advantages(items, self.advantage, **self.advantage_options)
        kw = dict(logprob_conflict=self.logprob_conflict, logprob_tol=self.logprob_tol)
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
                out.append(build_tree_from_branches(r.data["branches"], r.id, r.source, **kw))
        for gid, branches in groups.items():
            out.append(build_tree_from_branches(branches, gid, sources[gid], **kw))
        return out
