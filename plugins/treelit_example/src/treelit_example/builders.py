"""A tree builder for prompt/completions records (one tree per prompt)."""

from __future__ import annotations

from typing import Iterable, List

from treelit.builders.base import BuiltTree, TreeBuilder, build_tree_from_branches
from treelit.data.records import DataError, Record


def validate(rec, source):
    if not isinstance(rec.get("prompt"), list) or not rec["prompt"]:
        raise DataError(f"{source}: field 'prompt' must be a non-empty list of token ids")
    comps = rec.get("completions")
    if not isinstance(comps, list) or not comps or not all(isinstance(c, list) and c for c in comps):
        raise DataError(f"{source}: field 'completions' must be a non-empty list of non-empty token lists")


class PromptCompletionsBuilder(TreeBuilder):
    validate = staticmethod(validate)

    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        out = []
        for r in records:
            p = r.data["prompt"]
            branches = [{"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c)} for c in r.data["completions"]]
            out.append(build_tree_from_branches(branches, r.id, r.source))
        return out
