"""Lightning integration: the training module, the data module, callbacks."""

from treelit.lightning.data import StepBatch, TreeDataModule
from treelit.lightning.module import TreeLitModule

__all__ = ["StepBatch", "TreeDataModule", "TreeLitModule"]
