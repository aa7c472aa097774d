"""Credit per node of the merged tree (``tree_builder.advantage=tree_node``).

A tree-search rollout continues several samples from each intermediate state, so the
branches of one tree share prefixes that say something about the states they reach. Each
branch (a *leaf*) carries one ``reward``; the advantages are computed on the merged tree
(:class:`~treelit.tree.token_tree.TokenTree`), on the host, when the tree is built.

Definitions (``L(t)``: the branches whose path contains tree token ``t``):

* **Node.** A maximal run of consecutive tokens of one segment of the merged tree through
  which the same branches pass. Segments already end where the tree branches (a branching
  token is the last token of its node); a branch that ends inside a segment (a branch that
  is a prefix of another) ends a node there too. Every token of a node has the same
  ``L``. Duplicate branches share every node.
* **Value.** ``V(n) = mean of the rewards of L(n)``: the mean reward of the leaves below.
* **Parent node.** The node holding the parent token of the node's first token; a node
  starting a root of the tree has the tree's *root* as parent, with value ``V(root)`` = the
  mean reward of all the tree's branches (the tree is the group).
* **Advantage** of every token of node ``n``, on every branch through it::

      A(n) = (local x (V(n) - V(parent(n))) + global x (V(n) - V(root))) / s(n)

  ``local`` (``tree_builder.node_local``, default 1) weighs the step's own gain,
  ``global`` (``tree_builder.node_global``, default 0) the gain over the whole group (for a
  leaf node this is GRPO's centred reward ``r - mean``); ``s(n) = sqrt(|L(n)|)`` with
  ``tree_builder.node_sqrt_leaves=true``, else 1. TreeRL's published setting is
  ``node_local=1 node_global=1 node_sqrt_leaves=true``.

Branches split apart by ``logprob_conflict=split`` (or ``routing_conflict=split``) do not
share the tokens where they disagree, so they do not share those nodes either: the nodes
are the merged tree's.

The per-(branch, token) advantages are folded into the tree's per-token advantage sums the
same way as GAE's (:func:`treelit.tree.batch._rl_fields`), and each branch's own copy goes to
the per-branch reference (``Branches.token_adv``), so the tree loss equals per-branch training
with these advantages exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["TREE_NODE", "NodeCredit", "check_node_options", "node_table", "tree_node_advantages"]

TREE_NODE = "tree_node"


@dataclass(frozen=True)
class NodeCredit:
    local: float = 1.0
    global_: float = 0.0
    sqrt_leaves: bool = False


def check_node_options(local: Any = 1.0, global_: Any = 0.0, sqrt_leaves: Any = False) -> NodeCredit:
    """The ``tree_builder.node_*`` options, checked (one-line errors naming the option)."""
    out = []
    for name, v in (("node_local", local), ("node_global", global_)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"tree_builder.{name} must be a finite number, got {v!r}")
        out.append(float(v))
    if not isinstance(sqrt_leaves, bool):
        raise ValueError(f"tree_builder.node_sqrt_leaves must be true or false, got {sqrt_leaves!r}")
    if out[0] == 0.0 and out[1] == 0.0:
        raise ValueError("tree_builder.node_local and tree_builder.node_global are both 0: every tree_node "
                         "advantage would be 0 (set at least one)")
    return NodeCredit(out[0], out[1], sqrt_leaves)


def node_table(tree):
    """``(node_of [N], first [M], leaves [M])``: each tree token's node, each node's first token and
    its number of branches (see the module docstring)."""
    N = tree.num_tokens
    idx = tree.branch_tokens
    count = np.bincount(idx, minlength=N)
    start = np.zeros(N, dtype=bool)
    start[tree.seg_start] = True
    inner = ~start
    inner[0] = False
    t = np.flatnonzero(inner)
    start[t[count[t] != count[t - 1]]] = True  # a branch ended at t - 1 (inside the segment)
    node_of = np.cumsum(start) - 1
    first = np.flatnonzero(start)
    return node_of, first, count[first]


def tree_node_advantages(tree, rewards: Sequence[float], credit: NodeCredit) -> np.ndarray:
    """``[F]`` float64: the advantage of every (branch, token) pair of ``tree`` (``branch_tokens``
    order), from the branches' ``rewards`` [B], computed once per node."""
    r = np.asarray(rewards, dtype=np.float64)
    B = tree.num_branches
    idx = tree.branch_tokens
    branch_of = np.repeat(np.arange(B), np.diff(tree.branch_ptr))
    node_of, first, leaves = node_table(tree)
    # each node's value from its first token's pairs: the sum of its leaves' rewards / their number
    head = np.zeros(tree.num_tokens, dtype=bool)
    head[first] = True
    at = head[idx]
    value = np.bincount(node_of[idx[at]], weights=r[branch_of[at]], minlength=len(first)) / leaves
    root = float(r.mean())
    p = tree.parent[first]
    v_parent = np.where(p >= 0, value[node_of[np.maximum(p, 0)]], root)
    adv = credit.local * (value - v_parent) + credit.global_ * (value - root)
    if credit.sqrt_leaves:
        adv = adv / np.sqrt(leaves)
    return adv[node_of[idx]]


def apply_node_credit(tree, rewards: Sequence[float], credit: NodeCredit) -> None:
    """Give ``tree`` (and its per-branch reference, ``tree.source_branches``) the ``tree_node``
    advantages: ``branch_token_adv [F]`` and, for statistics and the checks that every branch has
    an advantage, ``branch_adv [B]`` = the mean over each branch's targets (0 without targets)."""
    pair = tree_node_advantages(tree, rewards, credit)
    ptr = tree.branch_ptr
    B = tree.num_branches
    branch_of = np.repeat(np.arange(B), np.diff(ptr))
    target = tree.branch_mask.copy()
    target[ptr[:-1]] = False  # nothing predicts a branch's first token
    n = np.bincount(branch_of, weights=target, minlength=B)
    s = np.bincount(branch_of, weights=np.where(target, pair, 0.0), minlength=B)
    tree.branch_token_adv = pair
    tree.branch_adv = np.divide(s, n, out=np.zeros(B), where=n > 0)
    br = getattr(tree, "source_branches", None)
    if br is not None:
        br.token_adv = [pair[ptr[b]:ptr[b + 1]].copy() for b in range(B)]
        br.adv = tree.branch_adv.copy()
