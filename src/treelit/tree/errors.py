"""The error of malformed tree input, below every module that raises it.

Kept apart so that :mod:`treelit.tree.batch` (the serialization) and
:mod:`treelit.tree.token_tree` (the trie, which serializes itself with
``TokenTree.to_batch``) both raise it without importing each other both ways.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["TreeInputError"]


class TreeInputError(ValueError):
    """Malformed branches, masks or weights (raised before any compute).

    ``branches`` holds the indices of the branches at fault when the error is about
    specific branches (a builder maps them back to the records they came from)."""

    def __init__(self, message: str, *, branches: Sequence[int] = (), detail: Optional[str] = None) -> None:
        super().__init__(message)
        self.branches = tuple(int(b) for b in branches)
        self.detail = detail or message
