"""Partition strategies (registry kind ``partition``): trees larger than memory.

The names below are imported on first use (:mod:`treelit.lazy`): the registry lives in
:mod:`treelit.partition.plan`, so listing it does not load the engine (decoders, objectives).
"""

from typing import TYPE_CHECKING

from treelit.lazy import lazy_exports

if TYPE_CHECKING:
    from treelit.partition.backward import tree_backward
    from treelit.partition.engine import MicroBatchResult, PartitionStats, run_micro_batch
    from treelit.partition.plan import PARTITIONS, BudgetError, PartitionPlan, plan_partitions

_EXPORTS = {
    "tree_backward": "treelit.partition.backward",
    "MicroBatchResult": "treelit.partition.engine",
    "PartitionStats": "treelit.partition.engine",
    "run_micro_batch": "treelit.partition.engine",
    "PARTITIONS": "treelit.partition.plan",
    "BudgetError": "treelit.partition.plan",
    "PartitionPlan": "treelit.partition.plan",
    "plan_partitions": "treelit.partition.plan",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["PARTITIONS", "BudgetError", "MicroBatchResult", "PartitionPlan", "PartitionStats", "plan_partitions",
           "run_micro_batch", "tree_backward"]
