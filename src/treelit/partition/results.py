"""What the partition engine's micro-batches report and share (:mod:`treelit.partition.engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from treelit.utils.distributed import Collectives

__all__ = ["PartitionStats", "MicroBatchResult", "PassState"]


@dataclass
class PartitionStats:
    partitions: int = 0  # gradient passes with work (empty passes not counted)
    token_forwards: int = 0  # tokens through the model with gradients (== tree tokens: redundancy-free)
    extra_forwards: int = 0  # tokens through the model without gradients (log-prob / reference passes)
    empty_passes: int = 0  # passes run only to take part in the other ranks' collectives
    tree_tokens: int = 0
    budget: Optional[int] = None
    max_chain_tokens: int = 0
    # context parallelism: the passes' most loaded rank's cost and mean cost, summed over passes
    cp_max_cost: float = 0.0
    cp_mean_cost: float = 0.0
    # context parallelism: the largest (this rank's queries) x (received path keys) of a pass,
    # the attention-score term of the memory planner's model (:func:`score_pair_bytes`)
    cp_score_pairs: int = 0
    # the most targets of a pass on this rank: the rows of the head's logits (in chunks), the
    # memory planner's head term
    max_pass_targets: int = 0

    @property
    def cp_imbalance(self) -> float:
        """The step's cost on its most loaded rank (pass by pass) over the mean, minus 1."""
        return self.cp_max_cost / self.cp_mean_cost - 1.0 if self.cp_mean_cost > 0 else 0.0
    per_partition: List[int] = field(default_factory=list)


@dataclass
class MicroBatchResult:
    loss: float
    metrics: Dict[str, float]
    failed: bool = False  # an out-of-memory error: the gradients are not usable


@dataclass
class PassState:
    """What the micro-batches of one update share: the partition statistics they add to, the
    data-parallel ranks, and whether an earlier micro-batch ran out of memory (the rest then
    runs empty passes only, keeping the other ranks' collectives company)."""

    stats: PartitionStats = field(default_factory=PartitionStats)
    comm: Collectives = field(default_factory=lambda: Collectives(1))
    failed: bool = False
