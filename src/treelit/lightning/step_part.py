"""The base of the training step's parts (:mod:`treelit.lightning.parts`): every hook, doing
nothing until a part fills it (docs/design.md, "The step as parts")."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from treelit.partition.parts import PassPart

__all__ = ["StepPart", "LossFn"]

LossFn = Callable[..., Tuple[torch.Tensor, Dict[str, float]]]


class StepPart:
    """A capability of the step; every hook does nothing until a part fills it."""

    name = ""
    adds: Tuple[str, ...] = ()
    needs: Tuple[str, ...] = ()
    split_row = True  # its pass parts fold into one context-parallel pass over a whole row (ContextParallel)
    summed_metrics: Tuple[str, ...] = ()  # shares of a step total (added over micro-batches, not averaged)
    normalized = False  # it has a step normaliser of its own (:meth:`normalizer`)

    # set-up
    def configure(self, cp_degree: int) -> None:
        """FSDP2 set-up, before the policy is sharded: refuse, with one line, what this part
        cannot run with (``cp_degree``: context parallelism's C), or prepare what it keeps."""

    def shard(self, dp_mesh, mp_policy) -> None:
        """FSDP2: shard this part's own modules over the data-parallel mesh."""

    def modules(self) -> List[torch.nn.Module]:
        return []

    def param_groups(self) -> List[Dict[str, Any]]:
        return []

    def clip_groups(self, groups: List[Tuple[str, list]]) -> List[Tuple[str, list]]:
        return groups

    # per step batch, per update
    def before_updates(self, executor, micro, step) -> None:
        """Before a step batch's first update (``step``: an ``UpdateStep`` without normalisers)."""

    def normalizer(self, mb) -> Optional[float]:
        """This micro-batch's share of the part's step normaliser (None: the part has none)."""
        return None

    # per micro-batch
    def micro_batch(self, spec, mb, grad: bool):
        """A context the executor runs one micro-batch ``mb`` in: its forward and backward
        (``grad``), or a no-gradient read (values, log-probs). Nothing by default."""
        return contextlib.nullcontext()

    def whole_row(self, spec, inner: LossFn, norms) -> LossFn:
        return inner

    def pass_parts(self, norms) -> List[PassPart]:
        return []

    def extra_runs(self, norms) -> List[Tuple[torch.nn.Module, List[PassPart]]]:
        """Further models whose passes run after the policy's, with their own pass parts."""
        return []

    def pad(self, mb):
        return mb

    def pad_loss(self, spec, mb) -> Optional[torch.Tensor]:
        return None

    # per step
    def step_metrics(self, first_updates: Sequence[Dict[str, float]], comm) -> Dict[str, float]:
        return {}
