"""Data parallelism helpers: FSDP2 sharding per block, and the few collectives treelit issues.

**Sharding.** :func:`shard_model` applies ``fully_shard`` to every entry of
``model.layers`` (whatever its class: attention, recurrent, MoE), to the token
embeddings when the head does not share their weight, and then to the root (which
keeps the final norm and the head). At rest each rank holds 1/world of every
parameter, its gradient and its optimizer state; a block's parameters are gathered
only while that block runs (forward, and again in its backward) because treelit's
passes call every block through its module call (:mod:`treelit.utils.blocks`).
Gradients are *summed* over ranks (divide factor 1): treelit's losses are already
divided by the step-global normaliser, so the sum is the single-process gradient.
Parameters a rank's passes did not reach are reduced as zeros
(``reduce_scatter_unused_params``), so ranks never disagree on which collectives to
run (an MoE expert no token of this rank was routed to, a pass that failed).

**HSDP.** Given an :func:`hsdp_mesh` (``trainer.strategy.replicate_degree`` R > 1),
``fully_shard`` gets its 2-D (replicate, shard) mesh: each rank holds 1/(world/R) of every
parameter; gradients are reduce-scattered within a replica and the shards summed across
replicas (still a plain sum: the single-process gradient).

**Collectives.** :class:`Collectives` wraps the process group (or nothing, on one
process) for the step-level agreements: normaliser sums, budget minimums, the
partition schedules of :mod:`treelit.partition.schedule`, out-of-memory flags.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

__all__ = ["shard_model", "shard_module", "is_sharded", "Collectives", "mixed_precision_policy", "hsdp_mesh", "fsdp_mesh"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` is an FSDP2 module (its parameters are sharded DTensors)."""
    from torch.distributed.fsdp import FSDPModule  # heavy (~0.9 s CPU): sharding only

    return isinstance(model, FSDPModule)


def mixed_precision_policy(param_dtype: Optional[str] = None, reduce_dtype: Optional[str] = None):
    """An FSDP2 ``MixedPrecisionPolicy`` from dtype names (None: no policy)."""
    if param_dtype is None and reduce_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy  # heavy (~0.9 s CPU): sharding only

    def parse(name):
        if name is None:
            return None
        if name not in _DTYPES:
            raise ValueError(f"FSDP mixed precision dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
        return _DTYPES[name]

    return MixedPrecisionPolicy(param_dtype=parse(param_dtype), reduce_dtype=parse(reduce_dtype))


def _head_shares_embedding(model: nn.Module) -> bool:
    """Whether the head's weight is the embeddings' (read as :func:`treelit.models.decoder.output_weight`
    reads it, without importing the models layer above this one)."""
    out = getattr(model, "output", None)
    if hasattr(out, "tied_module"):  # torchtune's TiedLinear
        weight = out.tied_module.weight
    elif isinstance(out, nn.Linear) and out.bias is None:
        weight = out.weight
    else:
        return True  # an unknown head: keep it with the embeddings in the root
    return weight is model.tok_embeddings.weight


def shard_model(model: nn.Module, mesh=None, *, mp_policy=None) -> nn.Module:
    """FSDP2 per block: ``fully_shard`` each of ``model.layers`` (or the modules a model lists
    in ``fsdp_blocks()``), the embeddings (untied heads only) and the root. Returns ``model``
    (now an ``FSDPModule``). The blocks must be called through their module call in every
    pass (they are in treelit's decoders)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard  # heavy (~0.9 s CPU): sharding only

    if is_sharded(model):
        return model
    kw: dict = {"mesh": fsdp_mesh(mesh)}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    blocks = model.fsdp_blocks() if hasattr(model, "fsdp_blocks") else getattr(model, "layers", None)
    if blocks is None:
        raise TypeError(f"{type(model).__name__} has no `layers` (nor `fsdp_blocks()`): cannot shard it per block")
    for block in blocks:
        fully_shard(block, **kw)
    if hasattr(model, "tok_embeddings") and not _head_shares_embedding(model):
        fully_shard(model.tok_embeddings, **kw)
    fully_shard(model, **kw)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
            mod.set_reduce_scatter_unused_params(True)
    return model


def shard_module(module: nn.Module, mesh=None, *, mp_policy=None) -> nn.Module:
    """FSDP2 on one small module as a single unit (a value head), with the reduction settings
    of :func:`shard_model` (plain sums, no divide factor)."""
    from torch.distributed.fsdp import fully_shard  # heavy (~0.9 s CPU): sharding only

    if is_sharded(module):
        return module
    kw: dict = {"mesh": fsdp_mesh(mesh)}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    fully_shard(module, **kw)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
    module.set_reduce_scatter_unused_params(True)
    return module


HSDP_DIMS = ("dp_replicate", "dp_shard")


def data_parallel_rank(trainer) -> Tuple[int, int]:
    """``(rank, world)`` for reading data: under context parallelism (``context_parallel_degree``
    C > 1 on the strategy) the C consecutive ranks of a group read the same micro-batches, so
    the data is split over ``world / C`` readers."""
    rank, world = int(trainer.global_rank), int(trainer.world_size)
    C = int(getattr(getattr(trainer, "strategy", None), "context_parallel_degree", 1) or 1)
    return (rank // C, world // C) if C > 1 else (rank, world)


def hsdp_mesh(replicas: int, world: int, device_type: str = "cpu"):
    """HSDP's device mesh: ``replicas`` x ``world / replicas`` (dims ``dp_replicate``,
    ``dp_shard``, and a ``tensor_parallel`` dim of size 1), its two data-parallel dims also
    flattened to ``data_parallel`` (every process: what Lightning and the data readers see).
    Consecutive ranks share a replica: with one replica per node, parameters are sharded
    within the node and only the replicas' all-reduce crosses nodes."""
    if replicas < 1 or world % replicas:
        raise ValueError(f"replicate_degree={replicas} does not divide the {world} processes")
    mesh = init_device_mesh(device_type, (replicas, world // replicas, 1),
                            mesh_dim_names=(*HSDP_DIMS, "tensor_parallel"))
    mesh[HSDP_DIMS]._flatten("data_parallel")
    return mesh


def fsdp_mesh(mesh):
    """The mesh ``fully_shard`` gets: the 2-D (replicate, shard) mesh when ``mesh`` is (a
    dimension of) an :func:`hsdp_mesh` with several replicas, else ``mesh`` itself."""
    if mesh is None:
        return None
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = tuple(root.mesh_dim_names or ())
    if all(n in names for n in HSDP_DIMS) and root[HSDP_DIMS[0]].size() > 1:
        return root[HSDP_DIMS]
    return mesh


class Collectives:
    """The step-level collectives over the default process group; no-ops on one process."""

    def __init__(self, world_size: Optional[int] = None, device: Optional[torch.device] = None) -> None:
        active = dist.is_available() and dist.is_initialized()
        self.world = int(world_size) if world_size is not None else (dist.get_world_size() if active else 1)
        self.rank = dist.get_rank() if active and self.world > 1 else 0
        self.device = device if device is not None else torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def _reduce(self, value: float, op) -> float:
        if not self.distributed:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return float(t[0])

    def sum(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.SUM if self.distributed else None)

    def min(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MIN if self.distributed else None)

    def sum_vector(self, values) -> np.ndarray:
        """Elementwise sums over ranks of a short float vector (one collective), as float64 numpy."""
        t = torch.as_tensor(np.asarray(values, dtype=np.float64), device=self.device)
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().numpy()

    def max(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.MAX if self.distributed else None)

    def gather_lists(self, values: List[int]) -> List[List[int]]:
        """Every rank's list of small ints (all ranks receive all lists)."""
        if not self.distributed:
            return [list(values)]
        n = torch.tensor([len(values)], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        width = max(int(s[0]) for s in sizes)
        buf = torch.full((max(width, 1),), -1, dtype=torch.long, device=self.device)
        if values:
            buf[: len(values)] = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf)
        return [o[: int(s[0])].tolist() for o, s in zip(out, sizes)]

    def __repr__(self) -> str:
        return f"Collectives(rank={self.rank}, world={self.world})"


def gather_full(t: Any) -> torch.Tensor:
    """A sharded (DTensor) tensor gathered to a full local tensor; plain tensors unchanged.
    A collective under FSDP2: every rank must call it."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
