"""Cutting a tree into connected partitions whose root-to-leaf chains fit a token budget.

Partitions are processed depth first: while a partition's descendants run, its graph
stays alive, so the memory of one step is bounded by the largest sum of partition
sizes along a root-to-leaf chain of partitions. The planner guarantees

    for every chain of partitions P_1 -> ... -> P_k (each the parent of the next):
        |P_1| + ... + |P_k| <= budget

and prefers few, large partitions. Every token lies on some root-to-leaf path, and
every token of that path lies in a partition of the chain, so the longest branch is a
lower bound of any feasible budget; below it the planner fails with that length.

Greedy, top down: a partition starts at a segment and keeps absorbing segments from
its frontier (children of its segments) while ``|P| + max over the frontier of
need(f) <= R``, where ``need(f)`` is the longest path below (and including) segment
``f`` and ``R`` the budget left to this partition's chain. Each frontier segment left
then starts a partition of its own with budget ``R - |P|``, which is always feasible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

from treelit.registry import get_registry

__all__ = ["PARTITIONS", "Partition", "PartitionPlan", "plan_partitions", "BudgetError"]

# the strategies (the ``partition`` config group); the engine runs both
PARTITIONS = get_registry("partition", ["treelit.partition.plan"])
PARTITIONS.register("none", "none")
PARTITIONS.register("redundancy_free", "redundancy_free")


class BudgetError(ValueError):
    """The token budget cannot hold one root-to-leaf path."""


@dataclass
class Partition:
    index: int
    parent: int  # parent partition (-1 for a partition holding a root)
    segments: List[int]  # segments of the row, in DFS order
    tokens: np.ndarray  # sorted token indices of the row
    root_segment: int

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class PartitionPlan:
    partitions: List[Partition]  # parents before children (DFS order of the partition tree)
    budget: int
    max_chain_tokens: int  # the largest sum of sizes along a chain of partitions
    longest_branch: int

    def __len__(self) -> int:
        return len(self.partitions)


def plan_partitions(batch, budget: int, per_rank: int = 1) -> PartitionPlan:
    """Partition ``batch``'s row under ``budget`` tokens per chain of partitions (``per_rank``:
    the C ranks of context parallelism share each pass, ``budget`` is C x a rank's)."""
    budget = int(budget)
    seg_start = batch.seg_start.cpu().numpy()
    seg_len = batch.seg_len.cpu().numpy()
    seg_parent = batch.seg_parent.cpu().numpy()
    S = len(seg_start)
    children: List[List[int]] = [[] for _ in range(S)]
    for s in range(S):
        if seg_parent[s] >= 0:
            children[seg_parent[s]].append(s)
    need = seg_len.astype(np.int64).copy()
    for s in range(S - 1, -1, -1):  # children come after parents in DFS order
        if children[s]:
            need[s] += max(need[c] for c in children[s])
    roots = [s for s in range(S) if seg_parent[s] < 0]
    longest = int(max(need[r] for r in roots)) if roots else 0
    if budget < longest and per_rank > 1:
        raise BudgetError(
            f"partition budget of {budget // per_rank} tokens per rank x {per_rank} context-parallel ranks cannot "
            f"hold one root-to-leaf path: the longest branch has {longest} tokens; use a budget of at least "
            f"{-(-longest // per_rank)} tokens per rank"
        )
    if budget < longest:
        raise BudgetError(
            f"partition budget of {budget} tokens cannot hold one root-to-leaf path: the longest branch "
            f"has {longest} tokens; use a budget of at least {longest}"
        )

    partitions: List[Partition] = []
    chain_max = 0
    # explicit stack of (segment, parent partition, budget left for this chain)
    stack = [(r, -1, budget, 0) for r in reversed(roots)]
    while stack:
        s, parent, R, used_above = stack.pop()
        members = [s]
        size = int(seg_len[s])
        frontier = list(children[s])
        grew = True
        while grew and frontier:
            grew = False
            for f in sorted(frontier, key=lambda x: -need[x]):
                rest = [g for g in frontier if g != f] + children[f]
                if size + seg_len[f] + (max(need[g] for g in rest) if rest else 0) <= R:
                    members.append(f)
                    size += int(seg_len[f])
                    frontier = rest
                    grew = True
                    break
        members.sort()
        tokens = np.concatenate([np.arange(seg_start[m], seg_start[m] + seg_len[m]) for m in members])
        idx = len(partitions)
        partitions.append(Partition(idx, parent, members, tokens, s))
        chain_max = max(chain_max, used_above + size)
        for f in sorted(frontier, reverse=True):
            stack.append((f, idx, R - size, used_above + size))
    # parents before children and siblings in DFS order of their root segments
    order = _dfs_order(partitions)
    remap = {p.index: i for i, p in enumerate(order)}
    for p in order:
        p.index, p.parent = remap[p.index], (remap[p.parent] if p.parent >= 0 else -1)
    return PartitionPlan(order, budget, chain_max, longest)


def _dfs_order(partitions: List[Partition]) -> List[Partition]:
    kids: List[List[Partition]] = [[] for _ in partitions]
    roots = []
    for p in partitions:
        (kids[p.parent] if p.parent >= 0 else roots).append(p)
    out: List[Partition] = []
    stack = sorted(roots, key=lambda p: -p.root_segment)
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(sorted(kids[p.index], key=lambda q: -q.root_segment))
    return out
