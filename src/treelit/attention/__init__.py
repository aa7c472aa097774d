"""Tree attention backends (registry kind ``attention``).

Every backend computes the same thing: for a DFS-serialized tree row, each
query attends to exactly its ancestors-or-self (plus visible external keys).
``sdpa_dense`` is the plain reference; faster backends are tested against it
on outputs and all gradients.
"""

from treelit.attention.base import (
    ATTENTION,
    AttentionBackend,
    available_backends,
    get_backend,
    resolve_backend,
)

__all__ = ["ATTENTION", "AttentionBackend", "available_backends", "get_backend", "resolve_backend"]
