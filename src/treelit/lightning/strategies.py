"""Lightning strategies with treelit's multi-process options.

``DDP`` and ``FSDP2`` are Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` (FSDP2
over the data-parallel mesh; treelit's module shards the decoder per block) with:

* ``timeout_s``: every collective fails after this many seconds instead of waiting for
  ever when ranks disagree (the module reports the step it happened in);
* ``param_dtype`` / ``reduce_dtype`` (FSDP2 only): an FSDP2 mixed precision policy, e.g.
  bfloat16 parameters in the passes with float32 gradient reduction (the sharded master
  parameters and the optimizer state stay in the model's dtype);
* ``replicate_degree`` (FSDP2 only): HSDP - the processes form R replicas of world/R
  shards; every parameter is sharded within a replica (reduce-scatter of gradients there)
  and the shards are replicated across replicas (all-reduce of the reduced shards). With
  one replica per node, only the all-reduce crosses the network between nodes.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from treelit.utils.distributed import hsdp_mesh, mixed_precision_policy

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
                 replicate_degree: int = 1, **kwargs: Any) -> None:
        super().__init__(timeout=_timeout(timeout_s), **kwargs)
        self.treelit_mp_policy = mixed_precision_policy(param_dtype, reduce_dtype)
        if isinstance(replicate_degree, bool) or not isinstance(replicate_degree, int) or replicate_degree < 1:
            raise ValueError(f"trainer.strategy.replicate_degree must be a positive number of replicas (1: FSDP2 "
                             f"over every process), got {replicate_degree!r}")
        self.replicate_degree = replicate_degree

    def setup_environment(self) -> None:
        """``data_parallel_size: auto`` is every process of the run (``devices x num_nodes``, over
        ``tensor_parallel_size``); with ``replicate_degree`` R > 1 the mesh is HSDP's
        (:func:`~treelit.utils.distributed.hsdp_mesh`)."""
        world = self.num_nodes * self.num_processes
        tp = self._tensor_parallel_size
        if self._data_parallel_size == "auto":
            if tp == "auto":
                self._tensor_parallel_size = tp = 1
            self._data_parallel_size = max(world // int(tp), 1)
        if self.replicate_degree > 1:
            if tp != 1:
                raise ValueError(f"trainer.strategy.replicate_degree={self.replicate_degree} (HSDP) needs "
                                 f"trainer.strategy.tensor_parallel_size=1, got {tp!r}")
            if world % self.replicate_degree:
                raise ValueError(f"trainer.strategy.replicate_degree={self.replicate_degree} does not divide the "
                                 f"{world} processes (trainer.devices x trainer.num_nodes)")
        super().setup_environment()
        if self.replicate_degree > 1:
            # torch >= 2.11 warns on every mesh["data_parallel"] (a flattened dim sliced from the root mesh),
            # which this strategy's data sampler and treelit's module read; it is still the slice they need
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
            self._device_mesh = hsdp_mesh(self.replicate_degree, world, self.root_device.type)
            self.lightning_module._device_mesh = self._device_mesh
