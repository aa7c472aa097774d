"""Running a block's computation *as that block's forward*, optionally checkpointed.

treelit's passes do not call a layer's own ``forward`` (torchtune's layers take a dense
mask; a tree pass needs a sequence context, external K/V, state capture), so they would
bypass whatever is hooked on the module call: FSDP2's unshard before and reshard after
the forward, the pre-backward unshard and the gradient reduce-scatter that it registers
on the forward's outputs and inputs. :func:`run_as_forward` runs any function through
``module.__call__`` (the function temporarily stands in for the instance's ``forward``),
so every hook fires exactly as for an ordinary call, whatever the layer's class.

:func:`call_block` adds two things around the function, *inside* the module call so that
FSDP's hooks stay outside them:

* activation checkpointing (``torch.utils.checkpoint``, non-reentrant): the block's
  activations are dropped after the forward and recomputed in the backward, when FSDP's
  pre-backward hook has already gathered the block's parameters. A block with side
  effects (recording a router loss, capturing K/V) can ask :func:`recomputing` to skip
  them during the recomputation.
* an out-of-memory guard (multi-process, see :mod:`treelit.partition.engine`): a block
  that runs out of memory marks the pass failed and returns ``0 * input``; the blocks
  after it skip their work the same way. Every module call, and so every collective of
  the pass, still happens, and the ranks agree after the pass to retry with a smaller
  budget instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["run_as_forward", "call_block", "recomputing", "OOMGuard"]

_MISSING = object()
_state = threading.local()


def recomputing() -> bool:
    """True while a checkpointed block is being recomputed in the backward pass."""
    return bool(getattr(_state, "recompute", 0))


@contextlib.contextmanager
def _recompute_scope(active: bool):
    if not active:
        yield
        return
    _state.recompute = getattr(_state, "recompute", 0) + 1
    try:
        yield
    finally:
        _state.recompute -= 1


def run_as_forward(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` called through ``module(*args)``: forward pre-hooks, forward hooks and
    the backward hooks they register see it as the module's forward."""
    prev = module.__dict__.get("forward", _MISSING)
    module.__dict__["forward"] = fn
    try:
        return module(*args)
    finally:
        if prev is _MISSING:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = prev


class OOMGuard:
    """Collects out-of-memory failures of the blocks of one pass (see :func:`call_block`)."""

    def __init__(self) -> None:
        self.failed = False
        self.error: Optional[BaseException] = None


def call_block(
    module: nn.Module,
    body: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    checkpoint: bool = False,
    oom_guard: Optional[OOMGuard] = None,
) -> torch.Tensor:
    """``body(x)`` as ``module``'s forward (``x [..., D] -> [..., D]``).

    Args:
        checkpoint: recompute ``body`` in the backward instead of keeping its activations
            (only when gradients are enabled).
        oom_guard: when given, an out-of-memory error inside ``body`` marks the guard failed
            and the block returns ``0 * x`` (and so does every later block of the pass).
    """

    def forward(inp: torch.Tensor) -> torch.Tensor:
        if oom_guard is not None and oom_guard.failed:
            return inp * 0
        try:
            if checkpoint and torch.is_grad_enabled():
                calls = [0]

                def run(t: torch.Tensor) -> torch.Tensor:
                    calls[0] += 1
                    with _recompute_scope(calls[0] > 1):
                        return body(t)

                return torch.utils.checkpoint.checkpoint(run, inp, use_reentrant=False)
            return body(inp)
        except torch.OutOfMemoryError as exc:
            if oom_guard is None:
                raise
            oom_guard.failed, oom_guard.error = True, exc
            return inp * 0

    return run_as_forward(module, forward, x)
