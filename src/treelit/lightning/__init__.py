"""Lightning integration: the training module, the data module, callbacks.

The face imports its children on first use (:mod:`treelit.lazy`): ``treelit.lightning.schedules``
(a learning-rate schedule the config check builds before launch) does not load Lightning."""

from treelit.lazy import lazy_exports

_EXPORTS = {
    "StepBatch": "treelit.lightning.data",
    "TreeDataModule": "treelit.lightning.data",
    "TreeLitModule": "treelit.lightning.module",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
