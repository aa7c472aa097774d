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
from treelit.data.images import ImageLimits, ImageReader, load_image_processor
from treelit.data.records import DataError, Record, validate_token_record
from treelit.loss.branches import Branches
from treelit.registry import get_registry
from treelit.rl.advantages import ADVANTAGES
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
                                        logprob_tol=self.logprob_tol)

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
) -> BuiltTree:
    """One tree from token-level branch dicts (``input_ids``, ``loss_mask``, ``weight``, RL fields).

    ``advantage`` (per branch), ``old_logprobs`` and ``ref_logprobs`` (per token) become the
    tree's RL data when present; see :meth:`TokenTree.from_branches` for ``logprob_conflict``.
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
        )
    except TreeInputError as exc:
        raise DataError(str(exc), branches=exc.branches, detail=exc.detail) from exc
    # the same branches as per-branch training sees them, for the per-branch reference
    # (mode=linear, verify_every): built from the records, not read back from the tree
    tree.source_branches = Branches.build(
        [b["input_ids"] for b in branches], [b.get("loss_mask") for b in branches],
        [1.0 if b.get("weight") is None else b["weight"] for b in branches], advantages=adv,
        old_logprobs=lp["old_logprobs"], ref_logprobs=lp["ref_logprobs"], branch_fields=fields,
        routed_experts=lp["routed_experts"])
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
        processor_path: local directory of a vision checkpoint's image processor: a branch's
            ``images`` (paths relative to the data file, or data: URIs) are read and each of its
            ``image_token_id`` tokens (one per image, in order) becomes the processor's placeholder
            tokens (see :mod:`treelit.data.images`).
        image_token_id: the placeholder token of an image (default: Qwen's ``<|image_pad|>``).
        max_image_bytes, max_image_pixels: bounds on one image (an error names the record).
        advantage_options: extra keyword arguments of the estimator.
    """

    def __init__(self, advantage: Optional[str] = None, logprob_conflict: str = "raise", logprob_tol: float = 1e-4,
                 processor_path: Optional[str] = None, image_token_id: int = 151655,
                 max_image_bytes: int = ImageLimits.max_image_bytes, max_image_pixels: int = ImageLimits.max_image_pixels,
                 **advantage_options: Any) -> None:
        if logprob_conflict not in ("raise", "split"):
            raise ValueError(f"tree_builder.logprob_conflict must be 'raise' or 'split', got {logprob_conflict!r}")
        if advantage is not None:
            ADVANTAGES.get(advantage)  # unknown names list the known ones
        self.advantage = advantage
        self.advantage_options = advantage_options
        self.logprob_conflict = logprob_conflict
        self.logprob_tol = float(logprob_tol)
        self.image_token_id = int(image_token_id)
        self.images: Optional[ImageReader] = None
        if processor_path:
            self.images = ImageReader(load_image_processor(processor_path),
                                      ImageLimits(int(max_image_bytes), int(max_image_pixels)))

    def encode(self, record: Record) -> List[Dict[str, Any]]:
        out = super().encode(record)
        for j, br in enumerate(out):
            refs = br.get("images")
            if refs:
                br.update(self._expand(br, refs, record, f"{record.source}: branches[{j}]"))
            else:
                br.pop("images", None)
        return out

    def _expand(self, br: Dict[str, Any], refs: List[str], record: Record, where: str) -> Dict[str, Any]:
        """One ``image_token_id`` per image in ``input_ids`` becomes the image's placeholder tokens."""
        if self.images is None:
            raise DataError(f"{where}.images: set tree_builder.processor_path to the vision checkpoint's folder to "
                            "read images")
        ids, mask = list(br["input_ids"]), br.get("loss_mask")
        at = [t for t, i in enumerate(ids) if i == self.image_token_id]
        if len(at) != len(refs):
            raise DataError(f"{where}.input_ids: {len(at)} image token(s) {self.image_token_id} for {len(refs)} "
                            "image(s) (one token per image, in order)")
        images = [self.images.read(r, record.path, f"{where}.images[{k}]", self.image_token_id)
                  for k, r in enumerate(refs)]
        out_ids, out_mask, prev = [], [], 0
        mask = [1] * len(ids) if mask is None else [int(m) for m in mask]
        for t, im in zip(at, images):
            out_ids += ids[prev:t] + [self.image_token_id] * im.num_tokens
            out_mask += mask[prev:t] + [0] * im.num_tokens
            prev = t + 1
        return {"input_ids": out_ids + ids[prev:], "loss_mask": out_mask + mask[prev:], "images": images}


def make_tree_builder(name: str, **options: Any) -> TreeBuilder:
    """Instantiate the tree builder registered as ``name`` (the ``tree_builder`` config group)."""
    return TREE_BUILDERS.get(name)(**options)
