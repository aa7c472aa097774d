"""Lightning strategies with treelit's multi-process options.

``DDP`` and ``FSDP2`` are Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` (FSDP2
over the data-parallel mesh; treelit's module shards the decoder per block) with:

* ``timeout_s``: every collective fails after this many seconds instead of waiting for
  ever when ranks disagree (the module reports the step it happened in);
* ``param_dtype`` / ``reduce_dtype`` (FSDP2 only): an FSDP2 mixed precision policy, e.g.
  bfloat16 parameters in the passes with float32 gradient reduction (the sharded master
  parameters and the optimizer state stay in the model's dtype).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from treelit.utils.distributed import mixed_precision_policy

__all__ = ["DDP", "FSDP2"]


def _timeout(seconds: float) -> timedelta:
    if not seconds or float(seconds) <= 0:
        raise ValueError(f"trainer.strategy.timeout_s must be a positive number of seconds, got {seconds!r}")
    return timedelta(seconds=float(seconds))


class DDP(DDPStrategy):
    def __init__(self, timeout_s: float = 1800, **kwargs: Any) -> None:
        super().__init__(timeout=_timeout(timeout_s), **kwargs)


class FSDP2(ModelParallelStrategy):
    def __init__(self, timeout_s: float = 1800, param_dtype: Optional[str] = None, reduce_dtype: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(timeout=_timeout(timeout_s), **kwargs)
        self.treelit_mp_policy = mixed_precision_policy(param_dtype, reduce_dtype)
