"""Hypothesis strategies for random forests with the nasty cases kept in.

A small alphabet makes shared prefixes (and thus real trees) likely. On top of
random branches, a draw may add: an exact duplicate of a branch, a proper prefix
of a branch, a branch differing only in its last token, a one-token branch.
Masks are drawn per branch, so branches disagree on shared tokens.
"""

from __future__ import annotations

from hypothesis import strategies as st

VOCAB = 5  # token ids 0..4 (the test models have a slightly larger vocabulary)


@st.composite
def forests(draw, max_branches: int = 7, max_len: int = 10, vocab: int = VOCAB):
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
    weights = [draw(st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.5])) for _ in branches]
    return branches, masks, weights
