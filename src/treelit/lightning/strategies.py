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

A sharded checkpoint (FSDP2) is written as Lightning writes it - torch's distributed
checkpoint, then ``meta.pt`` on rank 0 - except that a shard write that fails keeps its
``errno`` (a full disk, the file-size limit) on its way through torch's gather of the ranks'
errors, so every rank can say why, and ``meta.pt`` is fsync'ed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from datetime import timedelta
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from treelit.models.lora import lora_of
from treelit.utils.distributed import hsdp_mesh, mixed_precision_policy
from treelit.utils.integrity import disk_full

__all__ = ["DDP", "FSDP2"]


def _timeout(seconds: float) -> timedelta:
    if not seconds or float(seconds) <= 0:
        raise ValueError(f"trainer.strategy.timeout_s must be a positive number of seconds, got {seconds!r}")
    return timedelta(seconds=float(seconds))


class DDP(DDPStrategy):
    def __init__(self, timeout_s: float = 1800, context_parallel_degree: int = 1, **kwargs: Any) -> None:
        if context_parallel_degree != 1:
            raise ValueError(f"trainer.strategy.context_parallel_degree={context_parallel_degree}: context parallelism "
                             "runs on the FSDP2 strategies (trainer=fsdp2 or fsdp2_cpu), not under DDP")
        super().__init__(timeout=_timeout(timeout_s), **kwargs)
        self.context_parallel_degree = 1


class FSDP2(ModelParallelStrategy):
    def __init__(self, timeout_s: float = 1800, param_dtype: Optional[str] = None, reduce_dtype: Optional[str] = None,
                 replicate_degree: int = 1, context_parallel_degree: int = 1, **kwargs: Any) -> None:
        super().__init__(timeout=_timeout(timeout_s), **kwargs)
        cp = context_parallel_degree
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ValueError(f"trainer.strategy.context_parallel_degree must be a positive integer (1: off), got {cp!r}")
        self.context_parallel_degree = cp
        self.treelit_mp_policy = mixed_precision_policy(param_dtype, reduce_dtype)
        if isinstance(replicate_degree, bool) or not isinstance(replicate_degree, int) or replicate_degree < 1:
            raise ValueError(f"trainer.strategy.replicate_degree must be a positive number of replicas (1: FSDP2 "
                             f"over every process), got {replicate_degree!r}")
        self.replicate_degree = replicate_degree

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's, with the shard writer of :func:`_shard_writer` (see the module's text)."""
        if not self._save_distributed_checkpoint or storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        import torch.distributed.checkpoint as dcp  # heavy: sharded checkpoints only

        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{idx}": opt for idx, opt in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(state, storage_writer=_shard_writer(path))
        if self.global_rank == 0:
            with open(path / "meta.pt", "wb") as f:  # Lightning's name for the loop state
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Any:
        """Lightning's, except for a sharded checkpoint of a LoRA model, which holds only the trained
        parameters: those (and their optimizer state) are read and the frozen base is left as built."""
        path = Path(self.broadcast(checkpoint_path))
        if lora_of(self.lightning_module.model) is None or not path.is_dir():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        import torch.distributed.checkpoint as dcp  # heavy: sharded resumes only
        from torch.distributed.checkpoint.state_dict import (  # as above
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
            set_optimizer_state_dict)

        trained = StateDictOptions(ignore_frozen_params=True)
        state = {"state_dict": get_model_state_dict(self.model, options=trained)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(strict=False))
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            opt_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(opt_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=opt_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return torch.load(path / "meta.pt", weights_only=True if weights_only is None else weights_only)

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
        cp = self.context_parallel_degree
        if cp > 1 and (world // self.replicate_degree) % cp:
            raise ValueError(f"trainer.strategy.context_parallel_degree={cp} does not divide the "
                             f"{world // self.replicate_degree} processes of a replica (trainer.devices x "
                             f"trainer.num_nodes / trainer.strategy.replicate_degree)")
        super().setup_environment()
        if cp > 1:  # groups of C consecutive ranks (inside a replica): each splits its trees' rows
            group, _ = dist.new_subgroups(group_size=cp)
            self.lightning_module._cp_group = group
        if self.replicate_degree > 1:
            # torch >= 2.11 warns on every mesh["data_parallel"] (a flattened dim sliced from the root mesh),
            # which this strategy's data sampler and treelit's module read; it is still the slice they need
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
            self._device_mesh = hsdp_mesh(self.replicate_degree, world, self.root_device.type)
            self.lightning_module._device_mesh = self._device_mesh


def _shard_writer(path: Path) -> Any:
    """torch's ``FileSystemWriter`` whose write of this rank's shard, when it fails for want of
    space, raises a plain ``OSError`` with that ``errno``: torch gathers the ranks' errors by
    pickling them, which drops the ``OSError`` its own ``RuntimeError`` was raised from."""
    from torch.distributed.checkpoint import FileSystemWriter  # heavy: sharded checkpoints only

    class ShardWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().write_data(plan, planner)
            except Exception as exc:
                code = disk_full(exc)
                if code is None:
                    raise
                raise OSError(code, f"{os.strerror(code)} (writing a shard into {path})") from exc

    return ShardWriter(path)
