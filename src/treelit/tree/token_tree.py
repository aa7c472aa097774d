"""Prefix trees of token sequences.

A :class:`TokenTree` is a compressed trie (radix tree) over a set of *branches*
(token sequences). Equal tokens after equal prefixes are merged; everything else
stays apart, so distinct first tokens give a forest. A *segment* is a maximal
chain of tokens without branching; children hang off a segment's last token.

The tree is stored in DFS pre-order, which is the layout every other part of
treelit consumes. Roots keep their first-insertion order; children are visited
heaviest subtree first (ties in insertion order), so the longest paths are
contiguous runs of the row. The layout guarantees:

* token ``kv`` is an ancestor-or-self of token ``q`` iff
  ``kv <= q < subtree_end[kv]``;
* the position (RoPE index) of a token is its depth, i.e. its index inside every
  branch that contains it;
* the log-probability of token ``i`` is read from the hidden state of
  ``parent[i]``.

Each branch remembers the tree index of each of its tokens (``branch_tokens``),
its per-token loss mask and its weight, so the per-branch loss can be folded
onto tree tokens exactly (see :mod:`treelit.tree.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from treelit.tree.batch import TreeBatch
from treelit.tree.errors import TreeInputError
from treelit.tree.routing import check_routing_shape, decode_routing, split_keys
from treelit.tree.images import ImageSet, merge_keys

__all__ = ["TokenTree", "TreeInputError"]


class _Seg:
    """A segment while the trie is being built. ``aux`` (optional, ``[len, K]`` float) holds
    per-token values that must agree for tokens to merge (e.g. rollout log-probs)."""

    __slots__ = ("tokens", "aux", "parent", "children", "ends")

    def __init__(self, tokens: np.ndarray, parent: Optional["_Seg"], aux: Optional[np.ndarray] = None) -> None:
        self.tokens = tokens
        self.aux = aux
        self.parent = parent
        self.children: Dict[int, List[_Seg]] = {}  # first token -> segments (several only with aux)
        self.ends: List[tuple] = []  # (branch index, number of this segment's tokens on it)

    def child_list(self) -> List["_Seg"]:
        return [c for cs in self.children.values() for c in cs]

    def split(self, at: int) -> None:
        """Keep ``tokens[:at]`` here and move the rest (with the children) to a new child."""
        tail = _Seg(self.tokens[at:], self, None if self.aux is None else self.aux[at:])
        tail.children = self.children
        for ch in tail.child_list():
            ch.parent = tail
        keep = []
        for b, n in self.ends:
            (tail.ends.append((b, n - at)) if n > at else keep.append((b, n)))
        self.ends = keep
        self.tokens = self.tokens[:at]
        if self.aux is not None:
            self.aux = self.aux[:at]
        self.children = {int(tail.tokens[0]): [tail]}


def _as_token_array(branch: Any, b: int, source: str) -> np.ndarray:
    try:
        arr = np.asarray(branch)
    except MemoryError:
        raise  # out of memory says nothing about the data (the reader names the record)
    except Exception as exc:  # ragged or non-numeric
        raise TreeInputError(f"{source}branch {b}: token ids must be a flat list of integers ({exc})") from exc
    if arr.ndim != 1:
        raise TreeInputError(f"{source}branch {b}: token ids must be a flat list, got shape {arr.shape}")
    if arr.size == 0:
        raise TreeInputError(f"{source}branch {b} is empty; every branch needs at least one token")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise TreeInputError(f"{source}branch {b}: token ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        pos = int(np.argmin(arr))
        raise TreeInputError(f"{source}branch {b}: negative token id {int(arr[pos])} at position {pos}")
    return arr


def _logprob_column(lp, arrays, name: str, source: str) -> List[np.ndarray]:
    if len(lp) != len(arrays):
        raise TreeInputError(f"{source}got {len(lp)} {name} for {len(arrays)} branches")
    out = []
    for b, (vals, arr) in enumerate(zip(lp, arrays)):
        if vals is None:
            out.append(np.full(len(arr), np.nan))
            continue
        col = np.array([np.nan if v is None else v for v in vals], dtype=np.float64)
        if col.shape != (len(arr),):
            raise TreeInputError(f"{source}branch {b}: {name} has {col.shape[0]} values for {len(arr)} tokens")
        if np.any(col[~np.isnan(col)] > 0) or np.any(np.isinf(col)):
            raise TreeInputError(f"{source}branch {b}: {name} must be finite log-probs (<= 0)")
        out.append(col)
    return out


def _routing_arrays(values, arrays, source: str) -> List[Optional[np.ndarray]]:
    if len(values) != len(arrays):
        raise TreeInputError(f"{source}got {len(values)} routed_experts for {len(arrays)} branches")
    out: List[Optional[np.ndarray]] = []
    for b, (v, arr) in enumerate(zip(values, arrays)):
        if v is None:
            out.append(None)
            continue
        try:
            a = decode_routing(v, "routed_experts")
            check_routing_shape(a, len(arr), "routed_experts")
        except TreeInputError as exc:  # addressed to the branch (a record reader names its file, line, field)
            raise TreeInputError(f"{source}branch {b}: {exc}", branches=(b,), detail=str(exc)) from None
        out.append(a)
    return out


def _as_mask_array(mask: Any, length: int, b: int, source: str) -> np.ndarray:
    arr = np.asarray(mask)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise TreeInputError(
            f"{source}branch {b}: loss_mask has length {arr.shape[0] if arr.ndim == 1 else arr.shape}, "
            f"but the branch has {length} tokens"
        )
    if arr.dtype == bool:
        return arr
    if not np.all((arr == 0) | (arr == 1)):
        raise TreeInputError(f"{source}branch {b}: loss_mask values must be 0/1 or booleans")
    return arr.astype(bool)


@dataclass
class TokenTree:
    """A prefix tree (forest) over branches, in DFS pre-order. All arrays are numpy.

    Token arrays, shape ``[N]`` (N = tree tokens):
        ``input_ids``: token id of each tree token.
        ``parent``: index of the parent token, ``-1`` for roots.
        ``depth``: 0 for roots; the token's position inside every branch through it.
        ``subtree_end``: exclusive end of the token's subtree in DFS order.
    Segment arrays, shape ``[S]``:
        ``seg_start``, ``seg_len``: token range of each segment (DFS order).
        ``seg_parent``: index of the parent segment, ``-1`` for root segments.
    Branch arrays (B branches, F = flat tokens = sum of branch lengths):
        ``branch_ptr [B+1]``: CSR offsets into the flat arrays.
        ``branch_tokens [F]``: tree index of every token of every branch.
        ``branch_mask [F]``: the branch's loss mask (``True`` = token is a target).
        ``branch_weight [B]``: per-branch loss weight (float64, finite, >= 0).
        ``branch_fields``: optional per-branch extras (e.g. RL fields), each a list of length B.
    """

    input_ids: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    subtree_end: np.ndarray
    seg_start: np.ndarray
    seg_len: np.ndarray
    seg_parent: np.ndarray
    branch_ptr: np.ndarray
    branch_tokens: np.ndarray
    branch_mask: np.ndarray
    branch_weight: np.ndarray
    branch_fields: Dict[str, List[Any]] = field(default_factory=dict)
    branch_adv: Optional[np.ndarray] = None  # [B] advantages (RL)
    branch_token_adv: Optional[np.ndarray] = None  # [F] per (branch, token) advantages (tree_node), else None
    branch_old: Optional[np.ndarray] = None  # [F] rollout log-probs per branch token (NaN: unknown)
    branch_ref: Optional[np.ndarray] = None  # [F] reference log-probs per branch token
    token_old: Optional[np.ndarray] = None  # [N] the (agreed) rollout log-prob of each tree token
    token_ref: Optional[np.ndarray] = None  # [N]
    token_routing: Optional[np.ndarray] = None  # [N, L, k] recorded experts of each tree token (-1: none)
    shared_tokens_lost: int = 0  # tree tokens added by log-prob / routing splits (0 without splits)
    images: Optional[Any] = None  # treelit.tree.images.ImageSet: the tree's distinct images
    image_row: Optional[np.ndarray] = None  # [N] embedding row of each image token (-1: text)

    # construction ----------------------------------------------------------------------
    @classmethod
    def from_branches(
        cls,
        branches: Sequence[Sequence[int]],
        loss_masks: Optional[Sequence[Sequence[int]]] = None,
        weights: Optional[Sequence[float]] = None,
        *,
        branch_fields: Optional[Mapping[str, Sequence[Any]]] = None,
        source: str = "",
        advantages: Optional[Sequence[float]] = None,
        old_logprobs: Optional[Sequence[Optional[Sequence[Optional[float]]]]] = None,
        ref_logprobs: Optional[Sequence[Optional[Sequence[Optional[float]]]]] = None,
        logprob_conflict: str = "raise",
        logprob_tol: float = 1e-4,
        routed_experts: Optional[Sequence[Any]] = None,
        images: Optional[Sequence[Sequence[Any]]] = None,
        routing_conflict: str = "error",
    ) -> "TokenTree":
        """Build the prefix tree of ``branches``.

        Args:
            branches: B token sequences (non-empty, non-negative integer ids).
            loss_masks: optional B masks, one 0/1 value per token; ``loss_mask[i]`` says whether
                token ``i`` is a prediction target. The first token of a branch has nothing to be
                predicted from and is never a target. Default: every token is a target.
            weights: optional B non-negative finite branch weights (default 1).
            branch_fields: optional extra per-branch values carried along (length B each).
            source: prefix for error messages (e.g. ``"data.jsonl:12: "``).
            advantages: optional B per-branch advantages (RL objectives).
            old_logprobs, ref_logprobs: optional per-branch, per-token log-probs of each token
                under the rollout (old) and the reference policy (``None`` entries: unknown).
            logprob_conflict: what to do when branches sharing a token disagree on its old or
                reference log-prob by more than ``logprob_tol``: ``raise`` (an error naming the
                branches and the position) or ``split`` (the branches stop sharing the tree at
                that token, so each keeps its own value). Values are never averaged.
            routed_experts: optional per-branch recorded MoE routing, ``[T, L, k]`` expert ids
                (T = the branch's length or one less; None: not recorded; see
                :mod:`treelit.tree.routing`). A shared token has one routing: branches through it
                that disagree on it are an error naming the pair, the position and the layer
                (``routing_conflict="error"``), or stop sharing the tree at that token
                (``routing_conflict="split"``, as ``logprob_conflict="split"``; a token a branch did not
                record agrees with any routing). ``shared_tokens_lost`` counts the tree tokens the
                splits of both kinds added (the tokens no longer shared).
            images: optional B lists of :class:`~treelit.tree.images.ProcessedImage`, the images
                of each branch in order of appearance; their placeholder tokens are keyed by the
                image's content (see :mod:`treelit.tree.images`), so branches share an image span
                only when they show the same image.
        """
        if isinstance(branches, (str, bytes)) or not hasattr(branches, "__len__"):
            raise TreeInputError(f"{source}branches must be a list of token lists")
        B = len(branches)
        if B == 0:
            raise TreeInputError(f"{source}a tree needs at least one branch")
        arrays = [_as_token_array(br, b, source) for b, br in enumerate(branches)]
        if loss_masks is None:
            masks = [np.ones(len(a), dtype=bool) for a in arrays]
        else:
            if len(loss_masks) != B:
                raise TreeInputError(f"{source}got {len(loss_masks)} loss masks for {B} branches")
            masks = [
                np.ones(len(a), dtype=bool) if m is None else _as_mask_array(m, len(a), b, source)
                for b, (a, m) in enumerate(zip(arrays, loss_masks))
            ]
        if weights is None:
            w = np.ones(B, dtype=np.float64)
        else:
            try:
                w = np.asarray(weights, dtype=np.float64).reshape(-1)
            except (TypeError, ValueError) as exc:
                raise TreeInputError(f"{source}branch weights must be numbers ({exc})") from exc
            if w.shape[0] != B:
                raise TreeInputError(f"{source}got {w.shape[0]} weights for {B} branches")
            bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
            if bad.size:
                b = int(bad[0])
                raise TreeInputError(f"{source}branch {b}: weight {float(w[b])!r} must be finite and >= 0")
        fields: Dict[str, List[Any]] = {}
        for key, vals in (branch_fields or {}).items():
            vals = list(vals)
            if len(vals) != B:
                raise TreeInputError(f"{source}field {key!r} has {len(vals)} values for {B} branches")
            fields[key] = vals

        if logprob_conflict not in ("raise", "split"):
            raise ValueError(f"logprob_conflict must be 'raise' or 'split', got {logprob_conflict!r}")
        if routing_conflict not in ("error", "split"):
            raise ValueError(f"routing_conflict must be 'error' or 'split', got {routing_conflict!r}")
        adv = None
        if advantages is not None:
            adv = np.asarray(advantages, dtype=np.float64).reshape(-1)
            if adv.shape[0] != B or not np.all(np.isfinite(adv)):
                raise TreeInputError(f"{source}need {B} finite advantages, got {advantages!r}")
        aux_cols = [
            _logprob_column(lp, arrays, name, source)
            for name, lp in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs))
            if lp is not None
        ]
        aux = [np.stack(cols, axis=1) for cols in zip(*aux_cols)] if aux_cols else None
        real = arrays
        if images is not None:
            if len(images) != B:
                raise TreeInputError(f"{source}got {len(images)} image lists for {B} branches")
            table: Dict[Any, int] = {}
            keyed = [merge_keys(a, list(im or ()), table, source, b) for b, (a, im) in enumerate(zip(arrays, images))]
            arrays = [k for k, _, _ in keyed]
        routing = None if routed_experts is None else _routing_arrays(routed_experts, arrays, source)
        keys, tol = split_keys(aux if logprob_conflict == "split" else None, logprob_tol,
                               routing if routing_conflict == "split" else None, [len(a) for a in arrays])
        roots: Dict[int, List[_Seg]] = {}
        for b, arr in enumerate(arrays):
            if keys is not None:
                _insert(roots, arr, b, keys[b], tol)
            else:
                _insert(roots, arr, b)
        tree = cls._flatten(roots, arrays, masks, w, fields)
        if keys is not None:  # the tokens the splits added: against the tree of the tokens alone
            plain: Dict[int, List[_Seg]] = {}
            for b, arr in enumerate(arrays):
                _insert(plain, arr, b)
            tree.shared_tokens_lost = tree.num_tokens - _count_tokens(plain)
        if images is not None:
            tree._attach_images(real, keyed, images, table)
        tree.branch_adv = adv
        if aux is not None:
            names = [n for n, lp in (("old", old_logprobs), ("ref", ref_logprobs)) if lp is not None]
            flat = np.concatenate(aux)
            for j, name in enumerate(names):
                setattr(tree, f"branch_{name}", flat[:, j].copy())
            tree._check_logprobs(names, logprob_tol, source)
        if routing is not None:
            tree._merge_routing(routing, source)
        return tree

    def _merge_routing(self, arrs: List[Optional[np.ndarray]], source: str) -> None:
        """``token_routing [N, L, k]`` from the branches' records; every branch that recorded a
        shared token must agree with the first that did, on every MoE layer."""
        known = [(b, a) for b, a in enumerate(arrs) if a is not None]
        if not known:
            return
        L, k = known[0][1].shape[1:]
        tok = np.full((self.num_tokens, L, k), -1, dtype=np.int64)
        owner = np.full(self.num_tokens, -1, dtype=np.int64)  # the first branch that recorded each token
        for b, a in known:
            if a.shape[1:] != (L, k):
                raise TreeInputError(
                    f"{source}branch {b}: routed_experts has {a.shape[1]} MoE layers x {a.shape[2]} experts per token, "
                    f"branch {known[0][0]} has {L} x {k}", branches=(known[0][0], b),
                    detail=f"routed_experts: {a.shape[1]} MoE layers x {a.shape[2]} experts per token, {{other}} "
                    f"has {L} x {k}")
            idx = self.branch_tokens[self.branch_ptr[b] : self.branch_ptr[b] + a.shape[0]]
            new = owner[idx] < 0
            tok[idx[new]] = a[new]
            owner[idx[new]] = b
            diff = np.flatnonzero(~new & np.any(tok[idx] != a, axis=(1, 2)))
            if diff.size:
                pos = int(diff[0])
                t = int(idx[pos])
                layer = int(np.flatnonzero(np.any(tok[t] != a[pos], axis=1))[0])
                b0 = int(owner[t])
                mine, theirs = a[pos, layer].tolist(), tok[t, layer].tolist()
                raise TreeInputError(
                    f"{source}branches {b0} and {b} share the token at position {pos} but disagree on its routed "
                    f"experts at MoE layer {layer} ({theirs} vs {mine}); a shared token has one routing "
                    "(routing_conflict='split' gives them separate copies)",
                    branches=(b0, b),
                    detail=f"routed_experts[{pos}][{layer}] = {mine} disagrees with {{other}} ({theirs}) on the token "
                    f"they share at position {pos}, MoE layer {layer}; a shared token has one routing (use "
                    "tree_builder.routing_conflict=split to give them separate copies)",
                )
        self.token_routing = tok
    def _attach_images(self, real, keyed, images, table) -> None:
        """Put the real token ids back and give every token its image embedding row."""
        self.input_ids[self.branch_tokens] = np.concatenate(real)
        self.image_row = np.full(self.num_tokens, -1, dtype=np.int64)
        self.images = None
        if not table:
            return
        by_key = {}
        for ims in images:
            for im in ims or ():
                by_key.setdefault((im.token_id, im.digest), im)
        distinct = [by_key[k] for k in sorted(table, key=table.get)]
        self.images = ImageSet.of(distinct)
        start = self.images.row_offsets.numpy()
        img = np.concatenate([i for _, i, _ in keyed])
        off = np.concatenate([o for _, _, o in keyed])
        flat_row = np.where(img >= 0, start[np.maximum(img, 0)] + off, -1)
        self.image_row[self.branch_tokens] = flat_row
        if np.any(self.image_row[self.branch_tokens] != flat_row):  # pragma: no cover - internal invariant
            raise AssertionError("branches sharing a token disagree on its image row")

    def _check_logprobs(self, names, tol: float, source: str) -> None:
        """Every tree token gets one old/ref value; branches sharing it must agree within tol."""
        N = self.num_tokens
        for name in names:
            flat = getattr(self, f"branch_{name}")
            tok = np.full(N, np.nan)
            known = ~np.isnan(flat)
            # first known value per token (branches in order)
            idx = self.branch_tokens[known][::-1]
            tok[idx] = flat[known][::-1]
            bad = known & (np.abs(flat - tok[self.branch_tokens]) > tol)
            if bad.any():
                f = int(np.flatnonzero(bad)[0])
                b = int(np.searchsorted(self.branch_ptr, f, side="right") - 1)
                t = int(self.branch_tokens[f])
                first = int(np.flatnonzero(known & (self.branch_tokens == t))[0])
                b0 = int(np.searchsorted(self.branch_ptr, first, side="right") - 1)
                pos = int(f - self.branch_ptr[b])
                raise TreeInputError(
                    f"{source}branches {b0} and {b} share the token at position {pos} but disagree "
                    f"on its {name} log-prob ({flat[first]:.6g} vs {flat[f]:.6g}, tolerance {tol:g}); "
                    "use logprob_conflict='split' to give them separate copies",
                    branches=(b0, b),
                    detail=f"{name}_logprobs[{pos}] = {flat[f]:.6g} disagrees with {{other}} ({flat[first]:.6g}) on the "
                    f"token they share at position {pos} (tolerance {tol:g}); use tree_builder.logprob_conflict=split "
                    "to give them separate copies",
                )
            setattr(self, f"token_{name}", tok)

    @classmethod
    def _flatten(cls, roots, arrays, masks, weights, fields) -> "TokenTree":
        # DFS pre-order over segments, heaviest child first (ties: insertion order), so that
        # every heavy path is one contiguous run of the row (see treelit.attention.segment).
        weight: Dict[int, int] = {}
        post: List[_Seg] = []
        root_list = [r for rs in roots.values() for r in rs]
        stack = [(s, False) for s in reversed(root_list)]
        while stack:
            s, done = stack.pop()
            if done:
                weight[id(s)] = len(s.tokens) + sum(weight[id(c)] for c in s.child_list())
                post.append(s)
                continue
            stack.append((s, True))
            stack.extend((c, False) for c in s.child_list())
        order: List[_Seg] = []
        stack = list(reversed(root_list))
        while stack:
            s = stack.pop()
            order.append(s)
            kids = sorted(s.child_list(), key=lambda c: -weight[id(c)])  # stable sort
            stack.extend(reversed(kids))
        S = len(order)
        index = {id(s): i for i, s in enumerate(order)}
        seg_len = np.fromiter((len(s.tokens) for s in order), dtype=np.int64, count=S)
        seg_start = np.zeros(S, dtype=np.int64)
        np.cumsum(seg_len[:-1], out=seg_start[1:])
        seg_parent = np.fromiter(
            (-1 if s.parent is None else index[id(s.parent)] for s in order), dtype=np.int64, count=S
        )
        N = int(seg_len.sum())
        input_ids = np.concatenate([s.tokens for s in order]).astype(np.int64)
        # Per segment: depth of its first token and end of its subtree (reverse pre-order).
        seg_depth = np.zeros(S, dtype=np.int64)
        for i in range(S):  # parents come before children in pre-order
            p = seg_parent[i]
            if p >= 0:
                seg_depth[i] = seg_depth[p] + seg_len[p]
        seg_end = seg_start + seg_len
        for i in range(S - 1, -1, -1):
            p = seg_parent[i]
            if p >= 0 and seg_end[i] > seg_end[p]:
                seg_end[p] = seg_end[i]
        seg_of = np.repeat(np.arange(S), seg_len)
        offset = np.arange(N, dtype=np.int64) - seg_start[seg_of]
        depth = seg_depth[seg_of] + offset
        subtree_end = seg_end[seg_of]
        parent = np.arange(N, dtype=np.int64) - 1
        first = seg_start
        parent[first] = np.where(seg_parent >= 0, seg_start[seg_parent] + seg_len[seg_parent] - 1, -1)

        # Branch paths: tree index of each branch token.
        B = len(arrays)
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=B)
        branch_ptr = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(lengths, out=branch_ptr[1:])
        branch_tokens = np.empty(int(branch_ptr[-1]), dtype=np.int64)
        for s in order:
            for b, n in s.ends:
                end_tok = seg_start[index[id(s)]] + n - 1  # last token of the branch
                # Walk up: the path is the ancestor chain of the end token; depth = position.
                L = lengths[b]
                out = branch_tokens[branch_ptr[b] : branch_ptr[b + 1]]
                si, last = index[id(s)], end_tok
                pos = L
                while si >= 0:
                    take = last - seg_start[si] + 1
                    out[pos - take : pos] = np.arange(seg_start[si], last + 1)
                    pos -= take
                    p = seg_parent[si]
                    if p >= 0:
                        last = seg_start[p] + seg_len[p] - 1
                    si = p
                if pos != 0:  # pragma: no cover - internal invariant
                    raise AssertionError("branch path does not reach a root")
        branch_mask = np.concatenate(masks) if B else np.zeros(0, dtype=bool)
        return cls(
            input_ids=input_ids,
            parent=parent,
            depth=depth,
            subtree_end=subtree_end,
            seg_start=seg_start,
            seg_len=seg_len,
            seg_parent=seg_parent,
            branch_ptr=branch_ptr,
            branch_tokens=branch_tokens,
            branch_mask=branch_mask,
            branch_weight=weights,
            branch_fields=fields,
        )

    # views ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_branches(self) -> int:
        return int(self.branch_ptr.shape[0] - 1)

    @property
    def branch_lengths(self) -> np.ndarray:
        return np.diff(self.branch_ptr)

    def branch(self, b: int) -> np.ndarray:
        """Token ids of branch ``b`` (reconstructed from the tree)."""
        return self.input_ids[self.branch_tokens[self.branch_ptr[b] : self.branch_ptr[b + 1]]]

    def branches(self) -> List[List[int]]:
        return [self.branch(b).tolist() for b in range(self.num_branches)]

    def loss_mask(self, b: int) -> np.ndarray:
        return self.branch_mask[self.branch_ptr[b] : self.branch_ptr[b + 1]]

    def stats(self) -> Dict[str, Any]:
        """Tree statistics.

        ``flat_tokens`` (sum of branch lengths), ``tree_tokens``, ``por`` (prefix overlap
        ratio, 1 - tree/flat), ``ideal_speedup`` (flat/tree), ``depth`` (longest branch),
        ``segments``, ``leaves`` (segments without children), ``branches``, ``roots``.
        """
        flat = int(self.branch_ptr[-1])
        N = self.num_tokens
        S = int(self.seg_start.shape[0])
        has_child = np.zeros(S, dtype=bool)
        has_child[self.seg_parent[self.seg_parent >= 0]] = True
        return {
            "flat_tokens": flat,
            "tree_tokens": N,
            "por": 1.0 - N / flat,
            "ideal_speedup": flat / N,
            "depth": int(self.branch_lengths.max()),
            "segments": S,
            "leaves": int((~has_child).sum()),
            "branches": self.num_branches,
            "roots": int((self.seg_parent < 0).sum()),
        }

    def to_batch(self):
        """Serialize into a :class:`~treelit.tree.batch.TreeBatch` (one packed row)."""
        batch = TreeBatch.from_tree(self)
        batch.source_branches = getattr(self, "source_branches", None)  # set by the tree builders
        return batch

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"TokenTree(branches={s['branches']}, flat_tokens={s['flat_tokens']}, "
            f"tree_tokens={s['tree_tokens']}, segments={s['segments']}, por={s['por']:.3f})"
        )


def _compatible(a: Optional[np.ndarray], b: Optional[np.ndarray], tol: float) -> np.ndarray:
    """Per row: do the aux values agree (within ``tol``; NaN agrees with anything)?"""
    if a is None or b is None:
        n = len(a) if a is not None else (len(b) if b is not None else 0)
        return np.ones(n, dtype=bool)
    ok = np.isnan(a) | np.isnan(b) | (np.abs(a - b) <= tol)
    return ok.all(axis=1)


def _count_tokens(roots: Dict[int, List[_Seg]]) -> int:
    stack = [s for ss in roots.values() for s in ss]
    n = 0
    while stack:
        s = stack.pop()
        n += len(s.tokens)
        stack.extend(s.child_list())
    return n


def _insert(roots: Dict[int, List[_Seg]], arr: np.ndarray, b: int, aux: Optional[np.ndarray] = None, tol: float = 0.0) -> None:
    container, parent, pos, L = roots, None, 0, int(arr.shape[0])
    while True:
        t = int(arr[pos])
        seg = None
        for cand in container.get(t, ()):
            if aux is None or _compatible(cand.aux[:1], aux[pos : pos + 1], tol)[0]:
                seg = cand
                break
        if seg is None:
            seg = _Seg(arr[pos:], parent, None if aux is None else aux[pos:].copy())
            container.setdefault(t, []).append(seg)
            seg.ends.append((b, L - pos))
            return
        n = int(seg.tokens.shape[0])
        m = min(n, L - pos)
        same = seg.tokens[:m] == arr[pos : pos + m]
        if aux is not None:
            same &= _compatible(seg.aux[:m], aux[pos : pos + m], tol)
        neq = np.flatnonzero(~same)
        c = int(neq[0]) if neq.size else m
        if aux is not None and c > 0:  # fill values the tree did not know yet (first value wins)
            known = seg.aux[:c]
            np.copyto(known, aux[pos : pos + c], where=np.isnan(known))
        if c == L - pos:  # the branch ends inside (or at the end of) this segment
            seg.ends.append((b, c))
            return
        if c < n:  # diverges inside the segment: split it, then continue below the split
            seg.split(c)
        elif not seg.children:  # runs past a leaf segment: extend it (segments stay maximal)
            seg.tokens = np.concatenate([seg.tokens, arr[pos + n :]])
            if aux is not None:
                seg.aux = np.concatenate([seg.aux, aux[pos + n :]])
            seg.ends.append((b, L - pos))
            return
        pos += c
        container, parent = seg.children, seg
