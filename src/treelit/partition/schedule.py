"""The order of a micro-batch's forward and backward passes, aligned across ranks.

A partition plan runs depth first: forward a partition (``F``), and before forwarding
one that is not a descendant of the chain, backward the finished partitions deepest
first (``B``). Its *word* is that sequence of ``F`` and ``B``, balanced like
parentheses (``F F B F B B`` for a root with two child partitions).

Under FSDP2 every pass issues collectives (each block's parameters are gathered in its
forward and again in its backward, its gradients reduce-scattered after the backward),
which are matched by order across ranks. Ranks whose trees are cut differently (other
trees, another budget) have different words, so they must run one common sequence of
operations in which each rank fills the places it has no work for with *empty passes*
(a two-token row without targets: every collective, no contribution).

:func:`align` builds that sequence from all ranks' words. An empty forward leaves an
empty graph pending until an empty backward consumes it, so at every point of the
common sequence ``open real + open empty`` passes is the same number ``D`` on every
rank. Greedy rule, per step: if some rank's next real operation is ``B`` and every
other rank can backward too (its next real operation is ``B`` or it holds an empty
graph), everyone backwards; once all real work is done, the empty graphs are closed;
otherwise everyone forwards (ranks whose next real operation is not ``F`` forward an
empty pass). Each step consumes a real operation of some rank or closes an empty
graph, so the sequence ends, with every rank's own order preserved.

Forward-only passes (the no-gradient log-prob passes) have no ``B``: ranks simply run
the same number of forwards (:func:`align_forwards`).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["FORWARD", "BACKWARD", "Op", "dfs_word", "align", "align_forwards", "encode", "decode"]

FORWARD, BACKWARD = 1, 2

# (kind, partition index or -1 for an empty pass)
Op = Tuple[int, int]


def dfs_word(parents: Sequence[int]) -> List[Op]:
    """The operations of a plan whose partitions (parents before children, DFS order)
    have parent indices ``parents`` (-1: a root partition)."""
    ops: List[Op] = []
    chain: List[int] = []
    for p, par in enumerate(parents):
        while chain and chain[-1] != par:
            ops.append((BACKWARD, chain.pop()))
        ops.append((FORWARD, p))
        chain.append(p)
    while chain:
        ops.append((BACKWARD, chain.pop()))
    return ops


def _check_word(word: Sequence[Op], rank: int) -> None:
    depth = 0
    for kind, _ in word:
        depth += 1 if kind == FORWARD else -1
        if depth < 0:
            raise ValueError(f"rank {rank}: pass schedule backwards more passes than it forwarded")
    if depth:
        raise ValueError(f"rank {rank}: pass schedule leaves {depth} passes without a backward")


def align(words: Sequence[Sequence[Op]]) -> List[List[Op]]:
    """Per rank, its operations with empty passes ``(kind, -1)`` inserted so that all ranks
    run the same sequence of kinds. Each rank's own operations keep their order."""
    for r, w in enumerate(words):
        _check_word(w, r)
    R = len(words)
    pos = [0] * R
    empty = [0] * R  # empty forwards whose backward is pending
    depth = 0
    out: List[List[Op]] = [[] for _ in range(R)]

    def want(r: int):
        return words[r][pos[r]][0] if pos[r] < len(words[r]) else None

    while depth > 0 or any(pos[r] < len(words[r]) for r in range(R)):
        wants = [want(r) for r in range(R)]
        can_back = depth > 0 and all(w == BACKWARD or empty[r] > 0 for r, w in enumerate(wants))
        all_done = all(w is None for w in wants)
        if can_back and (BACKWARD in wants or all_done):
            for r in range(R):
                if wants[r] == BACKWARD:
                    out[r].append(words[r][pos[r]])
                    pos[r] += 1
                else:
                    out[r].append((BACKWARD, -1))
                    empty[r] -= 1
            depth -= 1
        else:
            for r in range(R):
                if wants[r] == FORWARD:
                    out[r].append(words[r][pos[r]])
                    pos[r] += 1
                else:
                    out[r].append((FORWARD, -1))
                    empty[r] += 1
            depth += 1
    return out


def align_forwards(counts: Sequence[int]) -> int:
    """Forward-only passes: every rank runs the largest count (the rest empty)."""
    return max(counts) if counts else 0


def encode(word: Sequence[Op]) -> List[int]:
    """A word as small ints for a collective: ``+1 + p`` for F(p), ``-(1 + p)`` for B(p)."""
    return [(1 + p) if k == FORWARD else -(1 + p) for k, p in word]


def decode(values: Sequence[int]) -> List[Op]:
    return [(FORWARD, v - 1) if v > 0 else (BACKWARD, -v - 1) for v in values]
