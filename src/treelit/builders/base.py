"""The tree-builder interface.

A builder turns the records of a data file into trees. Built-ins: ``sequences``
(each record's token branches form one tree), ``groups`` (records sharing a group
key form one tree, e.g. the samples of one GRPO prompt) and ``chat`` (conversations
rendered with a tokenizer's chat template). Third-party builders register through
the entry-point group ``treelit.tree_builder``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

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


def build_tree_from_branches(
    branches: Sequence[Dict[str, Any]],
    tree_id: str,
    source: str,
    *,
    logprob_conflict: str = "raise",
    logprob_tol: float = 1e-4,
) -> BuiltTree:
    """One tree from token-level branch dicts (``input_ids``, ``loss_mask``, ``weight``, RL fields).

    ``advantage`` (per branch), ``old_logprobs`` and ``ref_logprobs`` (per token) become the
    tree's RL data when present; see :meth:`TokenTree.from_branches` for ``logprob_conflict``.
    """
    fields: Dict[str, List[Any]] = {k: [b.get(k) for b in branches] for k in BRANCH_FIELDS if any(k in b for b in branches)}
    fields["record"] = [b.get("_record", tree_id) for b in branches]
    adv = None
    if any(b.get("advantage") is not None for b in branches):
        missing = [i for i, b in enumerate(branches) if b.get("advantage") is None]
        if missing:
            raise DataError(f"{source}: branches[{missing[0]}] has no advantage while others of its tree do")
        adv = [b["advantage"] for b in branches]
    lp = {k: ([b.get(k) for b in branches] if any(b.get(k) is not None for b in branches) else None)
          for k in ("old_logprobs", "ref_logprobs")}
    try:
        tree = TokenTree.from_branches(
            [b["input_ids"] for b in branches],
            [b.get("loss_mask") for b in branches],
            [1.0 if b.get("weight") is None else b["weight"] for b in branches],
            branch_fields=fields,
            source=f"{source}: ",
            advantages=adv,
            old_logprobs=lp["old_logprobs"],
            ref_logprobs=lp["ref_logprobs"],
            logprob_conflict=logprob_conflict,
            logprob_tol=logprob_tol,
        )
    except TreeInputError as exc:
        raise DataError(str(exc)) from exc
    return BuiltTree(tree_id, tree, source)


class TokenBuilder(TreeBuilder):
    """Shared options of the token-level builders (``sequences``, ``groups``).

    Args:
        advantage: estimator turning branch ``reward`` s into advantages (``grpo``, ``rloo``,
            ``reinforce_pp``, ``raw``; groups as the builder defines them).
        logprob_conflict: ``raise`` or ``split`` when branches disagree on a shared token's
            old/reference log-prob by more than ``logprob_tol``.
        advantage_options: extra keyword arguments of the estimator.
    """

    def __init__(self, advantage: Optional[str] = None, logprob_conflict: str = "raise", logprob_tol: float = 1e-4,
                 **advantage_options: Any) -> None:
        self.advantage = advantage
        self.advantage_options = advantage_options
        self.logprob_conflict = logprob_conflict
        self.logprob_tol = logprob_tol

    def tree(self, branches, tree_id: str, source: str) -> BuiltTree:
        return build_tree_from_branches(branches, tree_id, source, logprob_conflict=self.logprob_conflict,
                                        logprob_tol=self.logprob_tol)


def fill_advantages(items: List[tuple], estimator: Optional[str], key_name: str = "group", **options: Any) -> None:
    """Set ``advantage`` on branch dicts that have a ``reward`` but no advantage.

    ``items``: ``(branch dict, group key)`` over the whole dataset; ``estimator`` is a name
    in the ``advantage`` registry (``grpo``, ``rloo``, ``reinforce_pp``, ``raw``);
    ``key_name`` is the field the group keys come from (named in warnings and errors).
    """
    if estimator is None:
        return
    todo = [(b, g) for b, g in items if b.get("advantage") is None]
    if not todo:
        return
    if any(b.get("reward") is None for b, _ in todo):
        raise DataError(f"advantage estimator {estimator!r} needs a 'reward' on every branch without an 'advantage'")
    from treelit.rl.advantages import AdvantageError, compute_advantages

    try:
        adv = compute_advantages(estimator, [b["reward"] for b, _ in todo], [g for _, g in todo], key_name=key_name,
                                 **options)
    except AdvantageError as exc:
        raise DataError(str(exc)) from exc
    for (b, _), a in zip(todo, adv):
        b["advantage"] = float(a)


def make_tree_builder(name: str, **options: Any) -> TreeBuilder:
    """Instantiate the tree builder registered as ``name`` (the ``tree_builder`` config group)."""
    return TREE_BUILDERS.get(name)(**options)
