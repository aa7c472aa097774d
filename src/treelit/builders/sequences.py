"""``sequences``: each record's token branches form one tree."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

from treelit.builders.base import TREE_BUILDERS, BuiltTree, TreeBuilder, build_tree_from_branches, fill_advantages
from treelit.data.records import Record


@TREE_BUILDERS.register("sequences")
class SequencesBuilder(TreeBuilder):
    """Args:
        advantage: estimator turning branch ``reward`` s into advantages (``grpo``, ``rloo``,
            ``reinforce_pp``, ``raw``); groups are the branches' ``group`` field, else the record.
        logprob_conflict: ``raise`` or ``split`` when branches disagree on a shared token's
            old/reference log-prob by more than ``logprob_tol``.
    """

    def __init__(self, advantage: Optional[str] = None, logprob_conflict: str = "raise", logprob_tol: float = 1e-4,
                 **advantage_options: Any) -> None:
        self.advantage = advantage
        self.advantage_options = advantage_options
        self.logprob_conflict = logprob_conflict
        self.logprob_tol = logprob_tol

    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        records = list(records)
        items = [(b, b.get("group", r.id)) for r in records for b in r.data["branches"]]
        fill_advantages(items, self.advantage, **self.advantage_options)
        return [
            build_tree_from_branches(r.data["branches"], r.id, r.source, logprob_conflict=self.logprob_conflict,
                                     logprob_tol=self.logprob_tol)
            for r in records
        ]
