"""The tree-builder interface.

A builder turns the records of a data source into trees. Built-ins: ``sequences``
(each record's token branches form one tree), ``groups`` (records sharing a group
key form one tree, e.g. the samples of one GRPO prompt) and ``chat`` (conversations
rendered with a tokenizer's chat template). Third-party builders register through
the entry-point group ``treelit.tree_builder``.

A builder describes one record at a time (:meth:`TreeBuilder.encode`: the record's
token branches; :meth:`TreeBuilder.tree_keys` / :meth:`TreeBuilder.advantage_keys`:
which tree and which advantage group each branch joins). The
:class:`~treelit.builders.assemble.Assembler` does the rest the same way for every
builder, in memory or streaming: per-record checks (structure, the model's vocabulary
and context, what the objective needs), groups, advantages, trees, and errors that
name the record's file, line and field (``on_error=skip`` skips and counts instead).
A builder that overrides ``__call__`` instead (records in, trees out) still works in
memory, without per-record skipping or streaming.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

from treelit.builders.assemble import Assembler, BuiltTree
from treelit.builders.vision import NO_VISION, expand_raw_images, image_token_without_image, raw_image_token
from treelit.data.images import ImageLimits, ImageReader, load_image_processor, tokens_per_image
from treelit.data.records import DataError, Record, validate_token_record
from treelit.loss.branches import Branches
from treelit.registry import get_registry
from treelit.rl.advantages import ADVANTAGES
from treelit.rl.tree_node import TREE_NODE, check_node_options
from treelit.tree.token_tree import TokenTree, TreeInputError

__all__ = ["TREE_BUILDERS", "BuiltTree", "TreeBuilder", "TokenBuilder", "build_tree_from_branches",
           "make_tree_builder", "BRANCH_FIELDS"]

TREE_BUILDERS = get_registry(
    "tree_builder", ["treelit.builders.sequences", "treelit.builders.groups", "treelit.builders.chat"]
)

BRANCH_FIELDS = ("group", "reward", "advantage", "old_logprobs", "ref_logprobs", "chosen", "pair", "token_rewards")


class TreeBuilder:
    """Interface. Override :meth:`encode` (and the key methods to merge records); the
    class attributes say how advantages are formed.

    Attributes:
        validate: structural check of one raw record ``validate(data, source)``.
        advantage: estimator name (``grpo``, ``rloo``, ``reinforce_pp``, ...) or None.
        group_field: the data field group keys come from (named in messages).
        reward_per_record: True when a record (not each branch) carries one reward.
        ids_are_keys: True when records without a group key would otherwise be told apart
            by their ``id`` (duplicate ids are then refused).
    """

    validate = staticmethod(validate_token_record)
    advantage: Optional[str] = None
    advantage_options: Dict[str, Any] = {}
    group_field: str = "group"
    reward_per_record: bool = False
    logprob_conflict: str = "raise"
    logprob_tol: float = 1e-4
    routing_conflict: str = "error"

    def encode(self, record: Record) -> List[Dict[str, Any]]:
        """Token-level branch dicts of one validated record (``input_ids``, optional ``loss_mask``,
        ``weight`` and RL fields), each with ``_where``: the record field it came from."""
        return [dict(br, _where=f"branches[{j}]") for j, br in enumerate(record.data["branches"])]

    def tree_keys(self, record: Record, branches: List[Dict[str, Any]]) -> List[Any]:
        """Per branch: the key of the tree it joins (None: the record's own tree)."""
        return [None] * len(branches)

    def advantage_keys(self, record: Record, branches: List[Dict[str, Any]]) -> List[Any]:
        """Per branch: the key of its advantage group (None: the record's own group)."""
        return self.tree_keys(record, branches)

    def reward_of(self, record: Record) -> Any:
        """The record's reward (builders with ``reward_per_record``)."""
        return record.data.get("reward")

    def uses_ids(self, record: Record, tree_keys: List[Any], adv_keys: List[Any]) -> bool:
        """Whether the record's ``id`` would have told it apart from others (see ``ids_are_keys``)."""
        return self.advantage is not None and any(k is None for k in adv_keys)

    def tree(self, branches: Sequence[Dict[str, Any]], tree_id: str, source: str) -> BuiltTree:
        return build_tree_from_branches(branches, tree_id, source, logprob_conflict=self.logprob_conflict,
                                        logprob_tol=self.logprob_tol, routing_conflict=self.routing_conflict)

    def __call__(self, records: Iterable[Record]) -> List[BuiltTree]:
        """All trees of ``records`` (in memory, ``on_error=raise``, no model checks)."""
        asm = Assembler(self)
        out: List[BuiltTree] = []
        for r in records:
            out += asm.add(r)
        out += asm.flush()
        asm.report()
        return out


def build_tree_from_branches(
    branches: Sequence[Dict[str, Any]],
    tree_id: str,
    source: str,
    *,
    logprob_conflict: str = "raise",
    logprob_tol: float = 1e-4,
    routing_conflict: str = "error",
) -> BuiltTree:
    """One tree from token-level branch dicts (``input_ids``, ``loss_mask``, ``weight``, RL fields).

    ``advantage`` (per branch), ``old_logprobs`` and ``ref_logprobs`` (per token) become the
    tree's RL data when present; see :meth:`TokenTree.from_branches` for ``logprob_conflict`` and
    ``routing_conflict``.
    Errors are :class:`DataError` s; their ``branches`` attribute holds the branches at fault.
    """
    fields: Dict[str, List[Any]] = {k: [b.get(k) for b in branches] for k in BRANCH_FIELDS if any(k in b for b in branches)}
    fields["record"] = [b.get("_record", tree_id) for b in branches]
    adv = None
    if any(b.get("advantage") is not None for b in branches):
        missing = [i for i, b in enumerate(branches) if b.get("advantage") is None]
        if missing:
            has = next(i for i, b in enumerate(branches) if b.get("advantage") is not None)
            err = DataError(f"{source}: branches[{missing[0]}] has no advantage while branches[{has}] of its tree has one",
                            branches=(missing[0],),
                            detail="advantage: missing while {other} of its tree has one")
            err.others = (has,)  # named in the message, not at fault
            raise err
        adv = [b["advantage"] for b in branches]
    lp = {k: ([b.get(k) for b in branches] if any(b.get(k) is not None for b in branches) else None)
          for k in ("old_logprobs", "ref_logprobs", "routed_experts")}
    images = [b.get("images") or [] for b in branches] if any(b.get("images") for b in branches) else None
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
            routed_experts=lp["routed_experts"],
            images=images,
            routing_conflict=routing_conflict,
        )
    except TreeInputError as exc:
        raise DataError(str(exc), branches=exc.branches, detail=exc.detail) from exc
    # the same branches as per-branch training sees them, for the per-branch reference
    # (mode=linear, verify_every): built from the records, not read back from the tree
    tree.source_branches = Branches.build(
        [b["input_ids"] for b in branches], [b.get("loss_mask") for b in branches],
        [1.0 if b.get("weight") is None else b["weight"] for b in branches], advantages=adv,
        old_logprobs=lp["old_logprobs"], ref_logprobs=lp["ref_logprobs"], branch_fields=fields,
        routed_experts=lp["routed_experts"], images=images)
    if tree.token_routing is not None:
        # a token one branch left unrecorded (its final one) takes the routing another branch
        # through it recorded, as in the tree: each branch reads its tokens' merged routing
        ptr = tree.branch_ptr
        tree.source_branches.routing = [tree.token_routing[tree.branch_tokens[ptr[b]:ptr[b + 1]]]
                                        for b in range(len(branches))]
    return BuiltTree(tree_id, tree, source)


class TokenBuilder(TreeBuilder):
    """Shared options of the token-level builders (``sequences``, ``groups``).

    Args:
        advantage: estimator turning branch ``reward`` s into advantages (``grpo``, ``rloo``,
            ``reinforce_pp``, ``reinforce_pp_baseline``, ``raw``; groups as the builder defines them).
        logprob_conflict: ``raise`` or ``split`` when branches disagree on a shared token's
            old/reference log-prob by more than ``logprob_tol``.
        routing_conflict: ``error`` or ``split`` when branches disagree on a shared token's recorded
            MoE experts (``routed_experts``).
        processor_path: local directory of a vision checkpoint's image processor: a branch's
            ``images`` (paths relative to the data file, or data: URIs) are read and each of its
            ``image_token_id`` tokens (one per image, in order) becomes the processor's placeholder
            tokens (see :mod:`treelit.data.images`).
        image_token_id: the placeholder token of an image; None (default): the checkpoint's
            (:func:`~treelit.builders.vision.raw_image_token`); one that differs is refused.
        image_root: a folder images may also be read from (paths relative to it, or leading into
            it), under the same rules as the data file's folder.
        max_image_bytes, max_image_pixels: bounds on one image (an error names the record).
        node_local, node_global, node_sqrt_leaves: the weights of ``advantage=tree_node`` (credit per
            node of the merged tree; see :mod:`treelit.rl.tree_node`).
        advantage_options: extra keyword arguments of the estimator.
    """

    def __init__(self, advantage: Optional[str] = None, logprob_conflict: str = "raise", logprob_tol: float = 1e-4,
                 processor_path: Optional[str] = None, image_token_id: Optional[int] = None,
                 image_root: Optional[str] = None,
                 max_image_bytes: int = ImageLimits.max_image_bytes, max_image_pixels: int = ImageLimits.max_image_pixels,
                 node_local: float = 1.0, node_global: float = 0.0, node_sqrt_leaves: bool = False,
                 routing_conflict: str = "error", **advantage_options: Any) -> None:
        if logprob_conflict not in ("raise", "split"):
            raise ValueError(f"tree_builder.logprob_conflict must be 'raise' or 'split', got {logprob_conflict!r}")
        if routing_conflict not in ("error", "split"):
            raise ValueError(f"tree_builder.routing_conflict must be 'error' or 'split', got {routing_conflict!r}")
        self.routing_conflict = routing_conflict
        self.node_credit = check_node_options(node_local, node_global, node_sqrt_leaves)
        if advantage == TREE_NODE:
            if advantage_options:
                raise ValueError(f"tree_builder.{sorted(advantage_options)[0]}: advantage=tree_node takes no estimator "
                                 "options (its weights are tree_builder.node_local, node_global, node_sqrt_leaves)")
        elif advantage is not None:
            ADVANTAGES.get(advantage)  # unknown names list the known ones
        self.advantage = advantage
        self.advantage_options = advantage_options
        self.logprob_conflict = logprob_conflict
        self.logprob_tol = float(logprob_tol)
        self.images: Optional[ImageReader] = None
        if processor_path:
            self.images = ImageReader(load_image_processor(processor_path),
                                      ImageLimits(int(max_image_bytes), int(max_image_pixels)), image_root=image_root,
                                      tokens_per_image=tokens_per_image(processor_path))
        self.image_token_id = raw_image_token(processor_path, image_token_id)

    def encode(self, record: Record) -> List[Dict[str, Any]]:
        out = super().encode(record)
        for j, br in enumerate(out):
            refs = br.get("images")
            where = f"{record.source}: branches[{j}]"
            if not refs:
                br.pop("images", None)
                image_token_without_image(br["input_ids"], self.image_token_id, where)
            elif getattr(self, "model_vision", None) is False:
                raise DataError(f"{where}.images: {NO_VISION}")
            elif self.images is None:
                raise DataError(f"{where}.images: set tree_builder.processor_path to the vision checkpoint's folder "
                                "to read images")
            else:
                br.update(expand_raw_images(self.images, self.image_token_id, br, refs, record, where))
        return out


def make_tree_builder(name: str, **options: Any) -> TreeBuilder:
    """Instantiate the tree builder registered as ``name`` (the ``tree_builder`` config group)."""
    return TREE_BUILDERS.get(name)(**options)
