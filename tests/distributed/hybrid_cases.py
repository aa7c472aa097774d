"""Worker functions for the multi-process tests of transformers' hybrid checkpoints (run on every
rank by harness.launch): :func:`cases.exact_step` with transformers' float32 upcasts kept in
float64 (:class:`float64_mode.KeepFloat64`) for float64 specs, on the sharded ranks and in the
one-process reference alike, so they compare to 1e-9 rather than to float32's rounding.

Activation checkpointing recomputes the layers in the backward pass, outside any function mode
(the recomputation would see float32 where the forward saw float64): such specs run in float32.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import torch

from cases import exact_step
from float64_mode import KeepFloat64


def exact_steps_float64(rank: int, world: int, specs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for spec in specs:
        f64 = spec.get("dtype", torch.float64) == torch.float64
        if f64 and spec.get("checkpointing"):
            raise ValueError("activation checkpointing recomputes outside KeepFloat64: use dtype=torch.float32")
        with KeepFloat64() if f64 else contextlib.nullcontext():
            out.append(exact_step(rank, world, spec))
    return out
