"""Branches as per-branch training sees them: the input of every per-branch reference.

:class:`Branches` holds, per branch, its token ids, its target mask, its weight and its
RL fields (advantage, old and reference log-probs per token, DPO ``pair``/``chosen``),
exactly as given: no tree is built from them. Every objective's per-branch loss
(``Objective.linear_loss``) reads only this, so a bug in a tree builder or in the tree
code cannot hide in the reference it is compared against. The trainer's ``mode=linear``
and ``verify_every`` build it from the records (see :mod:`treelit.lightning.data`);
:func:`as_branches` also reads the branches back out of a ``TreeBatch`` (library
convenience: that copy went through the tree builder).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from treelit.tree.batch import check_aggregation
from treelit.tree.images import ImageSet
from treelit.tree.routing import check_routing_shape, decode_routing
from treelit.tree.token_tree import TreeInputError, _as_mask_array, _as_token_array

__all__ = ["Branches", "as_branches"]


def _per_token(values, lengths: Sequence[int], what: str) -> Optional[List[np.ndarray]]:
    """Per-branch float64 arrays (None entries -> NaN), or None when no branch has any."""
    if values is None or all(v is None for v in values):
        return None
    if len(values) != len(lengths):
        raise TreeInputError(f"got {len(values)} {what} lists for {len(lengths)} branches")
    out = []
    for b, (v, n) in enumerate(zip(values, lengths)):
        if v is None:
            out.append(np.full(n, np.nan))
            continue
        arr = np.array([np.nan if x is None else float(x) for x in v], dtype=np.float64)
        if arr.shape[0] != n:
            raise TreeInputError(f"branch {b}: {len(arr)} {what} for {n} tokens")
        out.append(arr)
    return out


def _routing(values, lengths: Sequence[int]) -> Optional[List[np.ndarray]]:
    """Per-branch ``[L_b, layers, k]`` routing, rows not recorded (None branches, a missing final
    token) filled with -1; None when no branch has any."""
    if values is None or all(v is None for v in values):
        return None
    if len(values) != len(lengths):
        raise TreeInputError(f"got {len(values)} routed_experts for {len(lengths)} branches")
    arrs = [None if v is None else decode_routing(v, f"branch {b}: routed_experts") for b, v in enumerate(values)]
    shape = next(a.shape[1:] for a in arrs if a is not None)
    out = []
    for b, (a, n) in enumerate(zip(arrs, lengths)):
        full = np.full((n, *shape), -1, dtype=np.int64)
        if a is not None:
            check_routing_shape(a, n, f"branch {b}: routed_experts")
            if a.shape[1:] != shape:
                raise TreeInputError(f"branch {b}: routed_experts has {a.shape[1]} MoE layers x {a.shape[2]} experts "
                                     f"per token, another branch {shape[0]} x {shape[1]}")
            full[: a.shape[0]] = a
        out.append(full)
    return out


@dataclass
class Branches:
    """Validated branches. ``masks[b]`` is the target mask (position 0 cleared: nothing predicts
    a branch's first token); ``n[b]`` its number of targets; ``adv [B]`` (NaN: none),
    ``old[b]`` / ``ref[b]`` ``[L_b]`` (NaN: none) or None; ``fields``: other per-branch values
    (``pair``, ``chosen``, ``group``, ...); ``scope [B]``: the tree a branch belongs to (DPO
    pair ids are scoped by it); ``behav[b]`` ``[L_b]``: the sampler's (behaviour) log-probs,
    kept here when the trainer's proximal ones replace ``old`` (off-policy correction)."""

    tokens: List[np.ndarray]
    masks: List[np.ndarray]
    weights: np.ndarray
    n: np.ndarray
    adv: Optional[np.ndarray] = None
    old: Optional[List[np.ndarray]] = None
    ref: Optional[List[np.ndarray]] = None
    fields: Dict[str, List[Any]] = field(default_factory=dict)
    scope: Optional[np.ndarray] = None
    behav: Optional[List[np.ndarray]] = None  # the sampler's log-probs when ``old`` holds the proximal ones
    # recorded MoE routing per branch, [L_b, layers, k] (-1 rows: not recorded, routed live), or None
    routing: Optional[List[np.ndarray]] = None
    # per-token advantages per branch, [L_b] (tree_node credit, or GAE with a critic), or None: ``adv``
    token_adv: Optional[List[np.ndarray]] = None
    # the images each branch shows, in order (treelit.tree.images.ImageSet; None: none), or None: no branch has
    # any. A vision model encodes a branch's images for that branch alone, as per-branch training does
    images: Optional[List[Any]] = None

    @classmethod
    def build(cls, branches, loss_masks=None, weights=None, *, advantages=None, old_logprobs=None,
              ref_logprobs=None, branch_fields=None, scope=None, routed_experts=None, images=None) -> "Branches":
        if len(branches) == 0:
            raise TreeInputError("need at least one branch")
        toks = [_as_token_array(b, i, "") for i, b in enumerate(branches)]
        if loss_masks is None:
            masks = [np.ones(len(t), dtype=bool) for t in toks]
        else:
            if len(loss_masks) != len(toks):
                raise TreeInputError(f"got {len(loss_masks)} loss masks for {len(toks)} branches")
            masks = [
                np.ones(len(t), dtype=bool) if m is None else _as_mask_array(m, len(t), i, "").copy()
                for i, (t, m) in enumerate(zip(toks, loss_masks))
            ]
        for m in masks:
            m[0] = False  # nothing predicts a branch's first token
        w = np.ones(len(toks)) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape[0] != len(toks):
            raise TreeInputError(f"got {w.shape[0]} weights for {len(toks)} branches")
        if not np.all(np.isfinite(w) & (w >= 0)):
            b = int(np.flatnonzero(~(np.isfinite(w) & (w >= 0)))[0])
            raise TreeInputError(f"branch {b}: weight {float(w[b])!r} must be finite and >= 0")
        n = np.array([m.sum() for m in masks], dtype=np.float64)
        adv = None
        if advantages is not None:
            if len(advantages) != len(toks):
                raise TreeInputError(f"got {len(advantages)} advantages for {len(toks)} branches")
            adv = np.array([np.nan if a is None else float(a) for a in advantages], dtype=np.float64)
        lengths = [len(t) for t in toks]
        fields = {k: list(v) for k, v in (branch_fields or {}).items()}
        for k, v in fields.items():
            if len(v) != len(toks):
                raise TreeInputError(f"branch field {k!r} has {len(v)} values for {len(toks)} branches")
        sc = np.zeros(len(toks), dtype=np.int64) if scope is None else np.asarray(scope, dtype=np.int64)
        return cls(toks, masks, w, n, adv, _per_token(old_logprobs, lengths, "old log-probs"),
                   _per_token(ref_logprobs, lengths, "reference log-probs"), fields, sc,
                   routing=_routing(routed_experts, lengths), images=_images(images, len(toks)))

    @classmethod
    def concat(cls, parts: Sequence["Branches"]) -> "Branches":
        """The branches of several groups (e.g. the trees of a micro-batch), scopes kept apart."""
        def cat_opt(name):
            vals = [getattr(p, name) for p in parts]
            if all(v is None for v in vals):
                return None
            return [x for p, v in zip(parts, vals)
                    for x in (v if v is not None else [np.full(len(t), np.nan) for t in p.tokens])]

        adv = None
        if any(p.adv is not None for p in parts):
            adv = np.concatenate([p.adv if p.adv is not None else np.full(len(p.tokens), np.nan) for p in parts])
        keys = set().union(*(p.fields for p in parts))
        fields = {k: [x for p in parts for x in p.fields.get(k, [None] * len(p.tokens))] for k in sorted(keys)}
        scope, offset = [], 0
        for p in parts:
            s = p.scope if p.scope is not None else np.zeros(len(p.tokens), dtype=np.int64)
            scope.append(s + offset)
            offset += int(s.max()) + 1 if len(s) else 0
        routing = None
        shape = next((p.routing[0].shape[1:] for p in parts if p.routing is not None), None)
        if shape is not None:
            routing = [r for p in parts for r in (p.routing if p.routing is not None else
                                                  [np.full((len(t), *shape), -1, dtype=np.int64) for t in p.tokens])]
        token_adv = None
        if any(p.token_adv is not None for p in parts):  # a part without: its branch advantage on every token
            token_adv = [a for p in parts for a in (p.token_adv if p.token_adv is not None else
                         [np.full(len(t), 0.0 if p.adv is None else p.adv[b]) for b, t in enumerate(p.tokens)])]
        images = None
        if any(p.images is not None for p in parts):
            images = [im for p in parts for im in (p.images if p.images is not None else [None] * len(p.tokens))]
        return cls([t for p in parts for t in p.tokens], [m for p in parts for m in p.masks],
                   np.concatenate([p.weights for p in parts]), np.concatenate([p.n for p in parts]), adv,
                   cat_opt("old"), cat_opt("ref"), fields, np.concatenate(scope), cat_opt("behav"), routing,
                   token_adv, images)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_branches(self) -> int:
        return len(self.tokens)

    @property
    def num_targets(self) -> float:
        return float(self.n.sum())

    def coefficients(self, aggregation: str) -> np.ndarray:
        """Per-branch coefficient c_b multiplying each of its token losses (before 1/Z)."""
        check_aggregation(aggregation)
        if aggregation == "seq-mean-token-mean":
            return self.weights * np.divide(1.0, self.n, out=np.zeros_like(self.n), where=self.n > 0)
        return self.weights.copy()

    def normalizer(self, aggregation: str) -> float:
        """Z of these branches alone (``sum``: 1)."""
        check_aggregation(aggregation)
        return 1.0 if aggregation == "sum" else self.norm_contribution(aggregation)

    def norm_contribution(self, aggregation: str) -> float:
        """These branches' share of a step's Z (as :meth:`TreeBatch.norm_contribution`)."""
        check_aggregation(aggregation)
        if aggregation == "token-mean":
            return float(self.n.sum())
        if aggregation == "sum":
            return 0.0
        return float((self.n > 0).sum())

    def pairs(self) -> List[Tuple[int, int]]:
        """DPO ``(chosen, rejected)`` branch indices; pair ids are scoped by the tree."""
        pair, chosen = self.fields.get("pair"), self.fields.get("chosen")
        if pair is None or chosen is None:
            raise ValueError("dpo needs branch fields 'pair' and 'chosen' (one chosen and one rejected branch per pair)")
        by_pair: Dict[Any, List[int]] = {}
        for b, p in enumerate(pair):
            if p is not None:
                by_pair.setdefault((int(self.scope[b]), p), []).append(b)
        out = []
        for key, members in by_pair.items():
            flags = [bool(chosen[b]) for b in members]
            if len(members) != 2 or sorted(flags) != [False, True]:
                raise ValueError(f"dpo pair {key[1]!r} must have exactly one chosen and one rejected branch, "
                                 f"got {len(members)}")
            out.append((members[flags.index(True)], members[flags.index(False)]))
        return out

    def validate_for_model(self, vocab_size: int, max_seq_len: Optional[int]) -> None:
        for b, t in enumerate(self.tokens):
            if t.max() >= vocab_size:
                pos = int(np.argmax(t >= vocab_size))
                raise TreeInputError(
                    f"token id {int(t[pos])} at position {pos} of branch {b} is outside the model's "
                    f"vocabulary (size {vocab_size})"
                )
            if max_seq_len is not None and len(t) > max_seq_len:
                raise TreeInputError(f"branch {b} has {len(t)} tokens, more than the model's max_seq_len {max_seq_len}")


def _images(images, B: int) -> Optional[List[Any]]:
    """Per branch its images (:class:`~treelit.tree.images.ProcessedImage` lists) as an ImageSet each."""
    if images is None or not any(images):
        return None
    if len(images) != B:
        raise TreeInputError(f"got images for {len(images)} branches, there are {B}")
    return [ImageSet.of(list(ims)) if ims else None for ims in images]


def _tree_images(x, span) -> Optional[List[Any]]:
    """Each branch's images read back out of a ``TreeBatch``: the images its tokens show, in order."""
    if getattr(x, "images", None) is None or x.image_row is None:
        return None
    rows = x.image_row.cpu()[x.branch_tokens.cpu()]
    starts = x.images.row_offsets[:-1].cpu()
    out = []
    for s in span:
        r = rows[s]
        first = torch.isin(r, starts) & (r >= 0)  # an image's first embedding row: the image starts
        which = torch.searchsorted(starts, r[first])
        out.append(x.images.take(which) if len(which) else None)
    return out


def as_branches(x) -> Branches:
    """``x`` if it is :class:`Branches`; the branches of a ``TreeBatch`` otherwise (read back out
    of its per-branch arrays: a convenience, not an independent reference)."""
    if isinstance(x, Branches):
        return x
    ptr = x.branch_ptr.cpu().numpy()
    toks = x.input_ids.cpu().numpy()[x.branch_tokens.cpu().numpy()]
    mask = x.branch_mask.cpu().numpy()
    B = len(ptr) - 1
    span = [slice(ptr[b], ptr[b + 1]) for b in range(B)]

    def per_token(flat):
        if flat is None:
            return None
        arr = flat.detach().cpu().double().numpy()
        return [arr[s] for s in span]

    out = Branches.build(
        [toks[s] for s in span], [mask[s] for s in span], x.branch_weight.cpu().numpy(),
        advantages=None if x.branch_adv is None else x.branch_adv.cpu().double().numpy().tolist(),
        branch_fields=x.branch_fields, scope=x.branch_tree.cpu().numpy(),
    )
    out.old, out.ref = per_token(x.branch_old_logp), per_token(x.branch_ref_logp)
    out.behav = per_token(getattr(x, "branch_behav_logp", None))
    out.token_adv = per_token(getattr(x, "branch_token_adv", None))
    routing = getattr(x, "token_routing", None)
    if routing is not None:  # each branch reads its tokens' (merged) routing
        r = routing.cpu().numpy()[x.branch_tokens.cpu().numpy()]
        out.routing = [r[s] for s in span]
    out.images = _tree_images(x, span)
    return out
