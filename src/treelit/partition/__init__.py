"""Partition strategies (registry kind ``partition``): trees larger than memory."""

from treelit.partition.backward import tree_backward
from treelit.partition.engine import MicroBatchResult, PartitionStats, run_micro_batch
from treelit.partition.plan import BudgetError, PartitionPlan, plan_partitions
from treelit.registry import get_registry

PARTITIONS = get_registry("partition", ["treelit.partition"])
PARTITIONS.register("none", "none")
PARTITIONS.register("redundancy_free", "redundancy_free")

__all__ = ["PARTITIONS", "BudgetError", "MicroBatchResult", "PartitionPlan", "PartitionStats", "plan_partitions",
           "run_micro_batch", "tree_backward"]
