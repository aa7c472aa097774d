"""Hypothesis strategies for random forests with the nasty cases kept in.

A small alphabet makes shared prefixes (and thus real trees) likely. On top of
random branches, a draw may add: an exact duplicate of a branch, a proper prefix
of a branch, a branch differing only in its last token, a one-token branch.
Masks are drawn per branch, so branches disagree on shared tokens.

Every forest trains something in every one of its trees: a tree (the branches that
share a first token) whose branches all have weight 0 or no target gets one branch
repaired (a drawn target switched on, a drawn non-zero weight; a tree of one-token
branches gets a drawn second token). Zero weights, empty masks and one-token branches
stay possible for the other branches. An example that trains nothing has loss and
gradients 0 on both sides of a comparison and proves nothing.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from hypothesis import settings
from hypothesis import strategies as st

VOCAB = 5  # token ids 0..4 (the test models have a slightly larger vocabulary)
WEIGHTS = [0.0, 0.5, 1.0, 1.0, 2.5]


def examples(n: int) -> int:
    """``n`` examples under the default (``ci``) profile, scaled with the loaded profile's
    ``max_examples`` (``thorough``: 10n)."""
    return max(1, round(n * settings.default.max_examples / 100))


def trains(branch: Sequence[int], mask: Sequence[bool], weight: float) -> bool:
    """Whether a branch contributes a target: weight > 0 and a mask bit set after position 0
    (a branch's first token has nothing to be predicted from)."""
    return weight > 0 and len(branch) > 1 and any(bool(m) for m in mask[1:])


def trees_of(branches: Sequence[Sequence[int]]) -> Dict[int, List[int]]:
    """Branch indices grouped by tree (branches of one tree share their first token)."""
    groups: Dict[int, List[int]] = {}
    for b, br in enumerate(branches):
        groups.setdefault(int(br[0]), []).append(b)
    return groups


def untrained_trees(branches, masks=None, weights=None) -> List[int]:
    """Root tokens of the trees in which no branch trains a target (empty when every tree trains)."""
    masks = masks if masks is not None else [[True] * len(b) for b in branches]
    weights = weights if weights is not None else [1.0] * len(branches)
    return [root for root, idx in trees_of(branches).items()
            if not any(trains(branches[b], masks[b], weights[b]) for b in idx)]


@st.composite
def forests(draw, max_branches: int = 7, max_len: int = 10, vocab: int = VOCAB, train_every_tree: bool = True):
    """``(branches, masks, weights)``: lists of token lists, 0/1 (bool) masks and branch weights."""
    n = draw(st.integers(1, max_branches))
    tok = st.integers(0, vocab - 1)
    branches = [draw(st.lists(tok, min_size=1, max_size=max_len)) for _ in range(n)]
    extras = draw(st.lists(st.sampled_from(["dup", "prefix", "last", "single"]), max_size=3))
    for kind in extras:
        src = branches[draw(st.integers(0, len(branches) - 1))]
        if kind == "dup":
            branches.append(list(src))
        elif kind == "prefix":
            branches.append(list(src[: draw(st.integers(1, len(src)))]))
        elif kind == "last":
            branches.append(src[:-1] + [(src[-1] + 1) % vocab])
        else:
            branches.append([draw(tok)])
    masks = [draw(st.lists(st.booleans(), min_size=len(b), max_size=len(b))) for b in branches]
    weights = [draw(st.sampled_from(WEIGHTS)) for _ in branches]
    if train_every_tree:
        for root, idx in trees_of(branches).items():
            if any(trains(branches[b], masks[b], weights[b]) for b in idx):
                continue
            longer = [b for b in idx if len(branches[b]) > 1]
            b = longer[0] if longer else idx[0]
            if len(branches[b]) == 1:
                branches[b] = branches[b] + [draw(tok)]
                masks[b] = masks[b] + [draw(st.booleans())]
            masks[b][draw(st.integers(1, len(branches[b]) - 1))] = True
            if weights[b] == 0:
                weights[b] = draw(st.sampled_from([w for w in WEIGHTS if w > 0]))
        assert not untrained_trees(branches, masks, weights)
    return branches, masks, weights
