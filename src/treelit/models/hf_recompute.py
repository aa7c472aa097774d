"""What a layer recomputed by transformers' activation checkpointing must see as its forward did.

``model.activation_checkpointing`` on ``hf_auto`` is transformers' own (per layer,
non-reentrant ``torch.utils.checkpoint``): each layer's forward runs again in the backward,
outside treelit's pass. :func:`checkpoint_contexts` is the checkpoint's ``context_fn``, called
when the layer first runs; its recompute context puts back what the forward ran under:

* the pass of a routing replay (:class:`~treelit.models.hf_replay.ReplayBinding`'s ``ctx``),
  so the recomputed routers replay the same records as the forward did;
* the torch-function modes active in the forward, outermost first (the backward runs outside
  them), so the recompute computes what the forward computed.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

from torch.overrides import _get_current_function_mode_stack

__all__ = ["checkpoint_contexts", "function_modes", "entered"]


def function_modes() -> List:
    """The torch-function modes active now (outermost first)."""
    return list(_get_current_function_mode_stack())


@contextlib.contextmanager
def entered(modes) -> Iterator[None]:
    """Inside: ``modes`` entered again, outermost first."""
    with contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        yield


@contextlib.contextmanager
def _recompute(replay, ctx, modes) -> Iterator[None]:
    before = replay.ctx if replay is not None else None
    if replay is not None:
        replay.ctx = ctx
    try:
        with entered(modes):
            yield
    finally:
        if replay is not None:
            replay.ctx = before


def checkpoint_contexts(replay: Optional[object] = None) -> Tuple[contextlib.AbstractContextManager, ...]:
    """``(forward, recompute)`` contexts of one checkpointed layer call (``replay``: the model's
    routing replay binding, or None)."""
    ctx = getattr(replay, "ctx", None)
    return contextlib.nullcontext(), _recompute(replay if ctx is not None else None, ctx, function_modes())
