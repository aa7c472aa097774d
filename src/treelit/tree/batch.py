"""DFS-serialized trees as flat tensors, with the per-branch loss folded onto tree tokens.

Loss folding. Per-branch training minimises

    L = (1/Z) * sum_b sum_t c_{b,t} * l_t,     c_{b,t} = w_b * m_{b,t} * s_b

where ``l_t = -log p(token t | its ancestors)``, ``w_b`` is the branch weight,
``m_{b,t}`` the branch's loss mask, ``s_b`` a per-branch scale (1, or ``1/n_b``
for seq-mean-token-mean with ``n_b`` the branch's number of targets) and ``Z``
a normaliser that depends only on counts. A token shared by several branches
has the same ``l_t`` in all of them (same ancestors, same position), so the sum
regroups by tree token: ``L = (1/Z) * sum_i W_i * l_i`` with
``W_i = sum_{b containing i} c_{b,i}``. Each tree token's log-prob is computed
once, with its folded weight ``W_i``.

``Z`` must be global over an optimizer step (all micro-batches, all ranks) for
micro-batching and gradient accumulation to leave the result unchanged: sum the
per-batch :meth:`TreeBatch.norm_contribution` before dividing.

============================  =====================================  ===========================
aggregation                   per-token weight ``W_i``               normaliser ``Z``
============================  =====================================  ===========================
``token-mean``                sum_b w_b m_{b,i}                      number of (branch, position) targets
``seq-mean-token-mean``       sum_b w_b m_{b,i} / n_b                number of branches with a target
``seq-mean-token-sum``        sum_b w_b m_{b,i}                      number of branches with a target
``sum``                       sum_b w_b m_{b,i}                      1
============================  =====================================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from treelit.registry import get_registry
from treelit.tree.errors import TreeInputError
from treelit.tree.images import ImageSet
from treelit.utils.dispatch import upload

__all__ = ["TreeBatch", "AGGREGATIONS", "pack_trees", "global_normalizer", "check_aggregation"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum")


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
    return aggregation


@dataclass
class TreeBatch:
    """One packed row of DFS-serialized trees. N tree tokens, S segments, B branches, F flat tokens.

    Token tensors ``[N]``:
        ``input_ids`` (long): token ids in DFS pre-order.
        ``position_ids`` (long): depth of the token = its position in every branch through it.
        ``parent`` (long): index of the parent token, ``-1`` for a root. Token ``i`` is predicted
            from the hidden state of ``parent[i]``.
        ``subtree_end`` (long): exclusive end of the token's subtree; query ``q`` sees key ``kv``
            iff ``kv <= q < subtree_end[kv]``.
        ``target_weight_sum`` (float64): ``sum_b w_b m_{b,i}`` over branches with token ``i`` as target.
        ``target_weight_mean`` (float64): ``sum_b w_b m_{b,i} / n_b`` (seq-mean-token-mean).
        ``target_count`` (float64): number of branches that have token ``i`` as a target.
    Segment tensors ``[S]`` (long): ``seg_start``, ``seg_len``, ``seg_parent`` (-1 for roots).
    ``tree_ptr [T+1]`` (long): token offsets of the T trees packed in this row.
    Branch tensors: ``branch_ptr [B+1]``, ``branch_tokens [F]`` (tree index of every branch token),
        ``branch_mask [F]`` (bool), ``branch_weight [B]`` (float64), ``branch_tree [B]`` (long).
    ``branch_fields``: per-branch Python values carried from the input (e.g. RL fields).
    ``num_targets`` / ``num_sequences``: this row's (branch, position) targets / branches with a target.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    subtree_end: torch.Tensor
    target_weight_sum: torch.Tensor
    target_weight_mean: torch.Tensor
    target_count: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_parent: torch.Tensor
    tree_ptr: torch.Tensor
    branch_ptr: torch.Tensor
    branch_tokens: torch.Tensor
    branch_mask: torch.Tensor
    branch_weight: torch.Tensor
    branch_tree: torch.Tensor
    num_targets: int
    num_sequences: int
    branch_fields: Dict[str, List[Any]] = field(default_factory=dict)
    # tree tokens that log-prob / routing splits added (tokens no longer shared; 0 in a partition)
    shared_tokens_lost: int = 0
    # RL (optional): per-token rollout/reference log-probs (NaN: unknown), folded advantages
    token_old_logp: Optional[torch.Tensor] = None  # [N] float64
    token_ref_logp: Optional[torch.Tensor] = None  # [N] float64
    adv_pos_sum: Optional[torch.Tensor] = None  # [N] sum_b w_b m_{b,i} max(A_b, 0)
    adv_neg_sum: Optional[torch.Tensor] = None  # [N] sum_b w_b m_{b,i} min(A_b, 0)
    adv_pos_mean: Optional[torch.Tensor] = None  # [N] the same with 1/n_b (seq-mean-token-mean)
    adv_neg_mean: Optional[torch.Tensor] = None  # [N]
    branch_adv: Optional[torch.Tensor] = None  # [B] float64
    branch_token_adv: Optional[torch.Tensor] = None  # [F] float64: per-(branch, token) advantages (tree_node)
    branch_old_logp: Optional[torch.Tensor] = None  # [F] float64
    branch_ref_logp: Optional[torch.Tensor] = None  # [F] float64
    # the sampler's (behaviour) log-probs, kept when the proximal ones replace token_old_logp
    # (objective.behavior_correction; see treelit.objectives.behavior)
    token_behav_logp: Optional[torch.Tensor] = None  # [N] float64
    branch_behav_logp: Optional[torch.Tensor] = None  # [F] float64
    # recorded MoE routing (treelit.tree.routing): [N, L, k] expert ids of each token, -1 where none
    # was recorded (model.moe.routing=replay reads it; the live router routes those tokens)
    token_routing: Optional[torch.Tensor] = None
    # the per-branch inputs this row was built from (treelit.loss.branches.Branches), when a
    # tree builder made it from records: the per-branch reference reads these, not the tree
    source_branches: Optional[Any] = None
    # images (optional; see treelit.tree.images): the row's distinct images, each token's row in
    # their concatenated embeddings (-1: text), and the multimodal RoPE positions [3, N] the
    # model's own position function gives each branch (set by the model: treelit.models.hf_vision)
    images: Optional[Any] = None
    image_row: Optional[torch.Tensor] = None
    mrope_position_ids: Optional[torch.Tensor] = None
    # a part of a row (subset) whose M-RoPE positions are its parent's: (parent row, token indices)
    mrope_parent: Optional[Any] = None
    # the row's images already encoded, per tower that encoded them (tower -> treelit.tree.images.
    # EncodedImages; set for one micro-batch by the step's image encoders, treelit.lightning.image_part:
    # the policy's, a separate critic's): each model reads its own tower's rows, not the tower
    image_embeds: Optional[Dict[Any, Any]] = None
    # host (numpy) copies of tensor fields, made where the row was built or before it moved to a
    # device: name -> (the tensor they mirror, its values); see :meth:`host`
    _host_copies: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # construction ----------------------------------------------------------------------
    @classmethod
    def from_tree(cls, tree) -> "TreeBatch":
        N, B = tree.num_tokens, tree.num_branches
        ptr = tree.branch_ptr
        lengths = np.diff(ptr)
        # The first token of each branch is never a target.
        is_first = np.zeros(int(ptr[-1]), dtype=bool)
        is_first[ptr[:-1]] = True
        target = tree.branch_mask & ~is_first
        branch_of = np.repeat(np.arange(B), lengths)
        n_b = np.bincount(branch_of, weights=target, minlength=B)
        w_flat = tree.branch_weight[branch_of] * target
        scale = np.divide(1.0, n_b, out=np.zeros(B), where=n_b > 0)
        idx = tree.branch_tokens
        t = lambda a, dt=torch.long: torch.from_numpy(np.ascontiguousarray(a)).to(dt)  # noqa: E731
        row = cls(
            input_ids=t(tree.input_ids),
            position_ids=t(tree.depth),
            parent=t(tree.parent),
            subtree_end=t(tree.subtree_end),
            target_weight_sum=t(np.bincount(idx, weights=w_flat, minlength=N), torch.float64),
            target_weight_mean=t(np.bincount(idx, weights=w_flat * scale[branch_of], minlength=N), torch.float64),
            target_count=t(np.bincount(idx, weights=target, minlength=N), torch.float64),
            seg_start=t(tree.seg_start),
            seg_len=t(tree.seg_len),
            seg_parent=t(tree.seg_parent),
            tree_ptr=torch.tensor([0, N], dtype=torch.long),
            branch_ptr=t(ptr),
            branch_tokens=t(idx),
            branch_mask=t(tree.branch_mask, torch.bool),
            branch_weight=t(tree.branch_weight, torch.float64),
            branch_tree=torch.zeros(B, dtype=torch.long),
            num_targets=int(n_b.sum()),
            num_sequences=int((n_b > 0).sum()),
            shared_tokens_lost=int(getattr(tree, "shared_tokens_lost", 0)),
            branch_fields={k: list(v) for k, v in tree.branch_fields.items()},
            **_rl_fields(tree, idx, target, w_flat, scale[branch_of], branch_of, N),
            images=getattr(tree, "images", None),
            image_row=None if getattr(tree, "image_row", None) is None or getattr(tree, "images", None) is None
            else t(tree.image_row),
        )
        for f in fields(row):  # host copies (numpy views of the CPU tensors: no copy)
            x = getattr(row, f.name)
            if isinstance(x, torch.Tensor) and not x.requires_grad:
                row._host_copies[f.name] = (x, x.numpy())
        return row

    @classmethod
    def pack(cls, batches: Sequence["TreeBatch"]) -> "TreeBatch":
        """Concatenate several rows into one; indices are shifted, trees stay independent."""
        if len(batches) == 0:
            raise ValueError("cannot pack an empty list of batches")
        if len(batches) == 1:
            return batches[0]
        tok_off = np.cumsum([0] + [b.num_tokens for b in batches])
        seg_off = np.cumsum([0] + [b.num_segments for b in batches])
        flat_off = np.cumsum([0] + [b.flat_tokens for b in batches])
        tree_off = np.cumsum([0] + [b.num_trees for b in batches])

        def shift(x: torch.Tensor, off: int) -> torch.Tensor:
            return torch.where(x >= 0, x + off, x)

        keys = set().union(*(b.branch_fields.keys() for b in batches))
        for k in keys:
            if not all(k in b.branch_fields for b in batches):
                raise ValueError(f"cannot pack batches: branch field {k!r} is missing in some of them")
        images, image_row, mrope = _pack_images(batches)
        return cls(
            images=images, image_row=image_row, mrope_position_ids=mrope,
            input_ids=torch.cat([b.input_ids for b in batches]),
            position_ids=torch.cat([b.position_ids for b in batches]),
            parent=torch.cat([shift(b.parent, int(o)) for b, o in zip(batches, tok_off)]),
            subtree_end=torch.cat([b.subtree_end + int(o) for b, o in zip(batches, tok_off)]),
            target_weight_sum=torch.cat([b.target_weight_sum for b in batches]),
            target_weight_mean=torch.cat([b.target_weight_mean for b in batches]),
            target_count=torch.cat([b.target_count for b in batches]),
            seg_start=torch.cat([b.seg_start + int(o) for b, o in zip(batches, tok_off)]),
            seg_len=torch.cat([b.seg_len for b in batches]),
            seg_parent=torch.cat([shift(b.seg_parent, int(o)) for b, o in zip(batches, seg_off)]),
            tree_ptr=torch.cat([batches[0].tree_ptr[:1]] + [b.tree_ptr[1:] + int(o) for b, o in zip(batches, tok_off)]),
            branch_ptr=torch.cat([batches[0].branch_ptr[:1]] + [b.branch_ptr[1:] + int(o) for b, o in zip(batches, flat_off)]),
            branch_tokens=torch.cat([b.branch_tokens + int(o) for b, o in zip(batches, tok_off)]),
            branch_mask=torch.cat([b.branch_mask for b in batches]),
            branch_weight=torch.cat([b.branch_weight for b in batches]),
            branch_tree=torch.cat([b.branch_tree + int(o) for b, o in zip(batches, tree_off)]),
            num_targets=sum(b.num_targets for b in batches),
            num_sequences=sum(b.num_sequences for b in batches),
            shared_tokens_lost=sum(b.shared_tokens_lost for b in batches),
            branch_fields={k: [v for b in batches for v in b.branch_fields[k]] for k in sorted(keys)},
            **{name: _cat_optional(batches, name) for name in _RL_FIELDS},
            source_branches=(type(batches[0].source_branches).concat([b.source_branches for b in batches])
                             if all(b.source_branches is not None for b in batches) else None),
        )

    def token_slice(self, start: int, end: int) -> "TreeBatch":
        """The tokens ``[start, end)`` as a row of their own (see :meth:`subset`)."""
        if not (0 <= start < end <= self.num_tokens):
            raise ValueError(f"bad token range [{start}, {end}) for a row of {self.num_tokens} tokens")
        return self.subset(torch.arange(start, end, device=self.device))

    def subset(self, tokens: torch.Tensor) -> "TreeBatch":
        """The given tokens (sorted indices) as a row of their own: a partition of the tree.

        The kept set must be closed under removal of whole subtrees: a token whose parent is
        dropped starts a new root of the row, and every kept token's subtree consists of kept
        tokens plus whole dropped subtrees. Positions stay the tokens' depths in the full
        tree; parents outside become ``-1``; segment tables are rebuilt. Branch tables are
        dropped (a partition's loss uses the folded token weights and the full tree's
        normaliser).
        """
        dev = self.device
        tokens = tokens.to(dev)
        n = int(tokens.shape[0])
        if n == 0:
            raise ValueError("a subset needs at least one token")
        kept = torch.zeros(self.num_tokens + 1, dtype=torch.long, device=dev)
        kept[tokens] = 1
        before = torch.cumsum(kept, 0) - kept  # kept tokens before each index
        old_parent = self.parent[tokens]
        parent_kept = (old_parent >= 0) & (kept[old_parent.clamp(min=0)] > 0)
        parent = torch.where(parent_kept, before[old_parent.clamp(min=0)], torch.full_like(old_parent, -1))
        subtree_end = before[self.subtree_end[tokens]]
        seg_start, seg_len, seg_parent = segments_from_parents(parent.cpu().numpy())
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        empty_l = torch.zeros(0, dtype=torch.long, device=dev)
        return TreeBatch(
            input_ids=self.input_ids[tokens],
            position_ids=self.position_ids[tokens],
            parent=parent,
            subtree_end=subtree_end,
            target_weight_sum=self.target_weight_sum[tokens],
            target_weight_mean=self.target_weight_mean[tokens],
            target_count=self.target_count[tokens],
            seg_start=t(seg_start),
            seg_len=t(seg_len),
            seg_parent=t(seg_parent),
            tree_ptr=torch.tensor([0, n], dtype=torch.long, device=dev),
            branch_ptr=torch.zeros(1, dtype=torch.long, device=dev),
            branch_tokens=empty_l,
            branch_mask=torch.zeros(0, dtype=torch.bool, device=dev),
            branch_weight=torch.zeros(0, dtype=torch.float64, device=dev),
            branch_tree=empty_l,
            num_targets=0,
            num_sequences=0,
            **{
                name: (getattr(self, name)[tokens] if getattr(self, name) is not None else None)
                for name in _RL_TOKEN_FIELDS
            },
            **self._image_part(tokens),
        )

    def _image_part(self, tokens: torch.Tensor) -> Dict[str, Any]:
        """A part's images: those its tokens show (encoded once for the row when the row carries
        ``image_embeds``, whose rows it then reads; else each part encodes them itself: the
        tower's gradient is the sum over parts, as over branches), its tokens' rows, and its
        M-RoPE positions (its parent's, sliced; computed on the parent, which has the branches)."""
        if self.images is None:
            if self.image_row is None:  # a row of text
                return {}
            images, rows = None, self.image_row[tokens]  # a part that shows no image: cut again, its positions stay
        else:
            images, rows = self.images.select(self.image_row[tokens])
        out = {"images": images, "image_row": rows}
        if self.image_embeds and images is not None:  # encoded once for the row: its rows
            out["image_embeds"] = {tower: enc.for_set(images) for tower, enc in self.image_embeds.items()}
        if self.mrope_position_ids is not None:
            return {**out, "mrope_position_ids": self.mrope_position_ids[:, tokens]}
        if self.mrope_parent is not None:
            parent, idx = self.mrope_parent
            return {**out, "mrope_parent": (parent, idx[tokens])}
        return {**out, "mrope_parent": (self, tokens)}

    # sizes -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.seg_start.shape[0])

    @property
    def num_branches(self) -> int:
        return int(self.branch_ptr.shape[0] - 1)

    @property
    def num_trees(self) -> int:
        return int(self.tree_ptr.shape[0] - 1)

    @property
    def flat_tokens(self) -> int:
        return int(self.host("branch_ptr")[-1])

    @property
    def max_depth(self) -> int:
        return int(self.host("position_ids").max()) + 1 if self.num_tokens else 0

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def branch_token_ids(self, b: int) -> torch.Tensor:
        return self.input_ids[self.branch_tokens[self.branch_ptr[b] : self.branch_ptr[b + 1]]]

    def stats(self) -> Dict[str, float]:
        flat, N = self.flat_tokens, self.num_tokens
        return {
            "flat_tokens": flat,
            "tree_tokens": N,
            "por": 1.0 - N / flat if flat else 0.0,
            "ideal_speedup": flat / N if N else 0.0,
            "segments": self.num_segments,
            "branches": self.num_branches,
            "trees": self.num_trees,
            "depth": self.max_depth,
        }

    # loss folding ----------------------------------------------------------------------
    def token_weights(self, aggregation: str) -> torch.Tensor:
        """Folded per-token weights ``W [N]`` (float64) for ``aggregation``, before normalisation."""
        return getattr(self, self.weight_field(aggregation))

    @staticmethod
    def weight_field(aggregation: str) -> str:
        """The field holding the folded per-token weights for ``aggregation``."""
        check_aggregation(aggregation)
        return "target_weight_mean" if aggregation == "seq-mean-token-mean" else "target_weight_sum"

    def norm_contribution(self, aggregation: str) -> float:
        """This row's share of the normaliser ``Z``; sum these over an optimizer step."""
        check_aggregation(aggregation)
        if aggregation == "token-mean":
            return float(self.num_targets)
        if aggregation == "sum":
            return 0.0  # Z is the constant 1 (see global_normalizer)
        return float(self.num_sequences)

    # movement --------------------------------------------------------------------------
    def to(self, device: Any) -> "TreeBatch":
        """The row on ``device``; it keeps host copies of its tensors (:meth:`host`), so that
        planning on the device's row never reads the device back."""
        kw, copies = {}, {}
        for f in fields(self):
            x = getattr(self, f.name)
            if isinstance(x, torch.Tensor):
                kw[f.name] = x.to(device)
                known = self._host_copy(f.name)
                if known is None and x.device.type == "cpu":
                    known = x.numpy() if not x.requires_grad else None
                if known is not None:
                    copies[f.name] = (kw[f.name], known)
        if self.images is not None:
            kw["images"] = self.images.to(device)
        return replace(self, _host_copies=copies, **kw)

    def _host_copy(self, name: str) -> Optional[np.ndarray]:
        entry = self._host_copies.get(name)
        return entry[1] if entry is not None and entry[0] is getattr(self, name) else None

    def targets(self, field_name: str = "target_count") -> torch.Tensor:
        """``[M]`` tree tokens that have a parent and a non-zero ``field_name`` (by default: a
        target of some branch), planned on the host and uploaded in one copy."""
        return upload(np.flatnonzero((self.host(field_name) != 0) & (self.host("parent") >= 0)), self.device)

    def host(self, name: str) -> np.ndarray:
        """The values of tensor field ``name`` as a host (numpy) array, read-only by contract.

        A row built on the host (:meth:`from_tree`) or moved from there (:meth:`to`) keeps them,
        so the step's planning (segment tables, selections, layouts) never asks the device: on a
        GPU each such read would be a host sync. A row made on the device copies the field once."""
        known = self._host_copy(name)
        if known is None:
            x = getattr(self, name)
            known = x.detach().cpu().numpy()
            self._host_copies[name] = (x, known)
        return known

    def advantage_weights(self, aggregation: str):
        """Folded ``(sum_b c_b max(A_b,0), sum_b c_b min(A_b,0))`` per token for ``aggregation``."""
        check_aggregation(aggregation)
        if self.adv_pos_sum is None:
            raise ValueError("this batch has no advantages (give advantages, rewards or an advantage estimator)")
        if aggregation == "seq-mean-token-mean":
            return self.adv_pos_mean, self.adv_neg_mean
        return self.adv_pos_sum, self.adv_neg_sum

    def validate_for_model(self, vocab_size: int, max_seq_len: Optional[int]) -> None:
        """Raise a clear error if a token id is outside the vocabulary or a branch is too long."""
        if self.num_tokens == 0:
            raise TreeInputError("empty batch: no tokens")
        ids = self.host("input_ids")
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if len(bad):
            i = int(bad[0])
            b = self._branch_of_token(i)
            raise TreeInputError(
                f"token id {int(ids[i])} at position {int(self.host('position_ids')[i])} of branch {b} "
                f"is outside the model's vocabulary (size {vocab_size})"
            )
        if max_seq_len is not None:
            lengths = np.diff(self.host("branch_ptr"))
            too_long = np.flatnonzero(lengths > max_seq_len)
            if len(too_long):
                b = int(too_long[0])
                raise TreeInputError(
                    f"branch {b} has {int(lengths[b])} tokens, more than the model's max_seq_len "
                    f"{max_seq_len}; raise the model's max_seq_len or truncate the data"
                )

    def _branch_of_token(self, i: int) -> int:
        hits = torch.nonzero(self.branch_tokens == i)
        if not hits.numel():
            return -1
        return int(torch.searchsorted(self.branch_ptr, hits[0], right=True)[0]) - 1


def segment_levels(seg_parent: np.ndarray) -> List[np.ndarray]:
    """Segment ids grouped by depth (roots first); ``seg_parent`` lists parents before children."""
    depth = np.zeros(len(seg_parent), dtype=np.int64)
    for s in range(len(seg_parent)):  # parents come first
        if seg_parent[s] >= 0:
            depth[s] = depth[seg_parent[s]] + 1
    return [np.flatnonzero(depth == d) for d in range(int(depth.max()) + 1)] if len(depth) else []


def segments_from_parents(parent: np.ndarray, breaks: Optional[np.ndarray] = None):
    """Segment tables ``(seg_start, seg_len, seg_parent)`` of a DFS-ordered row given its
    parent array: a token continues its predecessor's segment iff its parent is the
    predecessor and the predecessor has exactly one child. ``breaks``: tokens after which a
    segment must end anyway."""
    N = len(parent)
    idx = np.arange(N)
    children = np.bincount(parent[parent >= 0], minlength=N)
    cont = np.zeros(N, dtype=bool)
    cont[1:] = (parent[1:] == idx[:-1]) & (children[:-1] == 1)
    if breaks is not None and len(breaks):
        b = np.asarray(breaks, dtype=np.int64)
        cont[b[b + 1 < N] + 1] = False
    seg_start = np.flatnonzero(~cont)
    seg_len = np.diff(np.append(seg_start, N))
    seg_of = np.cumsum(~cont) - 1
    p = parent[seg_start]
    seg_parent = np.where(p >= 0, seg_of[np.maximum(p, 0)], -1)
    return seg_start.astype(np.int64), seg_len.astype(np.int64), seg_parent.astype(np.int64)


# optional per-token fields: a partition takes its tokens' rows, packing concatenates them
_RL_TOKEN_FIELDS = ("token_old_logp", "token_ref_logp", "adv_pos_sum", "adv_neg_sum", "adv_pos_mean", "adv_neg_mean",
                    "token_behav_logp", "token_routing")
_RL_FIELDS = _RL_TOKEN_FIELDS + ("branch_adv", "branch_old_logp", "branch_ref_logp", "branch_behav_logp",
                                 "branch_token_adv")


def _rl_fields(tree, idx, target, w_flat, inv_n, branch_of, N) -> Dict[str, Optional[torch.Tensor]]:
    out: Dict[str, Optional[torch.Tensor]] = {name: None for name in _RL_FIELDS}
    f64 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))  # noqa: E731
    if tree.branch_adv is not None:
        # per (branch, token) pair: the branch's advantage, or each token's own (tree_node credit)
        pair = getattr(tree, "branch_token_adv", None)
        a = tree.branch_adv[branch_of] if pair is None else pair
        pos, neg = w_flat * np.maximum(a, 0.0), w_flat * np.minimum(a, 0.0)
        out.update(
            adv_pos_sum=f64(np.bincount(idx, weights=pos, minlength=N)),
            adv_neg_sum=f64(np.bincount(idx, weights=neg, minlength=N)),
            adv_pos_mean=f64(np.bincount(idx, weights=pos * inv_n, minlength=N)),
            adv_neg_mean=f64(np.bincount(idx, weights=neg * inv_n, minlength=N)),
            branch_adv=f64(tree.branch_adv),
            branch_token_adv=None if pair is None else f64(pair),
        )
    for name, short in (("old", "old"), ("ref", "ref")):
        if getattr(tree, f"branch_{short}") is not None:
            out[f"token_{name}_logp"] = f64(getattr(tree, f"token_{short}"))
            out[f"branch_{name}_logp"] = f64(getattr(tree, f"branch_{short}"))
    if getattr(tree, "token_routing", None) is not None:
        out["token_routing"] = torch.from_numpy(np.ascontiguousarray(tree.token_routing, dtype=np.int64))
    return out


def _pack_images(batches: Sequence[TreeBatch]):
    """The packed row's distinct images (each once), image rows and M-RoPE positions."""
    if all(b.images is None for b in batches):
        return None, None, None
    with_images = [b for b in batches if b.images is not None]
    images, maps = ImageSet.merge([b.images for b in with_images])
    new_of = {id(b): m.to(b.device) for b, m in zip(with_images, maps)}
    rows = []
    for b in batches:
        if b.images is None:
            rows.append(torch.full_like(b.input_ids, -1))
        else:
            r = b.image_row
            rows.append(torch.where(r >= 0, new_of[id(b)][r.clamp(min=0)], r))
    mrope = None
    if all(b.mrope_position_ids is not None for b in batches):
        mrope = torch.cat([b.mrope_position_ids for b in batches], dim=1)
    return images, torch.cat(rows), mrope


def _cat_optional(batches: Sequence["TreeBatch"], name: str) -> Optional[torch.Tensor]:
    vals = [getattr(b, name) for b in batches]
    if all(v is None for v in vals):
        return None
    if any(v is None for v in vals):
        raise ValueError(f"cannot pack batches: {name} is present in some of them only")
    return torch.cat(vals)


def pack_trees(items: Iterable[Any], max_tokens: int) -> List[TreeBatch]:
    """Greedily pack trees (``TokenTree`` or ``TreeBatch``) in order into rows of at most
    ``max_tokens`` tree tokens. A tree larger than ``max_tokens`` gets a row of its own
    (partitioning is what bounds memory for such trees)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    rows: List[TreeBatch] = []
    cur: List[TreeBatch] = []
    size = 0
    for item in items:
        b = item if isinstance(item, TreeBatch) else item.to_batch()
        if cur and size + b.num_tokens > max_tokens:
            rows.append(TreeBatch.pack(cur))
            cur, size = [], 0
        cur.append(b)
        size += b.num_tokens
    if cur:
        rows.append(TreeBatch.pack(cur))
    return rows


def global_normalizer(batches: Iterable[TreeBatch], aggregation: str, objective: Any = None) -> float:
    """The normaliser ``Z`` of one optimizer step made of ``batches`` (micro-batches).

    Pass every micro-batch's loss this ``Z`` (``normalizer=Z``) and the summed gradients
    equal those of the whole step as one batch. ``objective`` (an objective instance, as
    :func:`treelit.make_objective` returns, or its registered name) decides what is
    counted: by default (and for ``sft``, ``ppo``, ``grpo``, ``gspo``) (branch, position)
    targets or branches as the table above says; ``dpo`` counts preference pairs. Use the
    objective you train with: a DPO step normalised by targets is scaled wrongly.
    """
    check_aggregation(aggregation)
    if aggregation == "sum":
        return 1.0
    if objective is None:
        return float(sum(b.norm_contribution(aggregation) for b in batches))
    if isinstance(objective, str):  # the registry of the objectives layer above (treelit.global_normalizer loads it)
        objective = get_registry("objective").get(objective)()
    if not hasattr(objective, "norm_contribution"):
        raise TypeError(f"objective must be an objective name or instance, got {type(objective).__name__}")
    return float(sum(objective.norm_contribution(b, aggregation) for b in batches))
