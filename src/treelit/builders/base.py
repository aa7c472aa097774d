"""The tree-builder interface.

A builder turns the records of a data file into trees. Built-ins: ``sequences``
(each record's token branches form one tree), ``groups`` (records sharing a group
key form one tree, e.g. the samples of one GRPO prompt) and ``chat`` (conversations
rendered with a tokenizer's chat template). Third-party builders register through
the entry-point group ``treelit.tree_builder``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Sequence

from treelit.data.records import DataError, Record, validate_token_record
from treelit.registry import get_registry
from treelit.tree.token_tree import TokenTree, TreeInputError

__all__ = ["TREE_BUILDERS", "BuiltTree", "TreeBuilder", "build_tree_from_branches", "make_tree_builder", "BRANCH_FIELDS"]

TREE_BUILDERS = get_registry(
    "tree_builder", ["treelit.builders.sequences", "treelit.builders.groups", "treelit.builders.chat"]
)

BRANCH_FIELDS = ("group", "reward", "advantage", "old_logprobs", "ref_logprobs", "chosen", "pair")


@dataclass
class BuiltTree:
    id: str
    tree: TokenTree
    source: str


class TreeBuilder:
    """Interface: ``builder(records) -> list[BuiltTree]``. Records are validated by
    ``validate`` while reading (see :func:`treelit.data.records.read_records`)."""

    validate = staticmethod(validate_token_record)

    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        raise NotImplementedError


def build_tree_from_branches(branches: Sequence[Dict[str, Any]], tree_id: str, source: str) -> BuiltTree:
    """One tree from token-level branch dicts (``input_ids``, ``loss_mask``, ``weight``, RL fields)."""
    fields: Dict[str, List[Any]] = {k: [b.get(k) for b in branches] for k in BRANCH_FIELDS if any(k in b for b in branches)}
    fields["record"] = [b.get("_record", tree_id) for b in branches]
    try:
        tree = TokenTree.from_branches(
            [b["input_ids"] for b in branches],
            [b.get("loss_mask") for b in branches],
            [1.0 if b.get("weight") is None else b["weight"] for b in branches],
            branch_fields=fields,
            source=f"{source}: ",
        )
    except TreeInputError as exc:
        raise DataError(str(exc)) from exc
    return BuiltTree(tree_id, tree, source)


def make_tree_builder(name: str, **options: Any) -> TreeBuilder:
    """Instantiate the tree builder registered as ``name`` (the ``tree_builder`` config group)."""
    return TREE_BUILDERS.get(name)(**options)
