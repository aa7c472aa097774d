"""Keep transformers' float32 upcasts in float64 (test-only), generically.

transformers computes norms, RoPE, router softmax and its recurrent kernels through float32
even in a float64 model (``x.float()``, ``x.to(torch.float32)``, ``torch.zeros(..., dtype=
torch.float32)``), which limits any float64 comparison to ~1e-7. Inside :class:`KeepFloat64`
every such request asks for float64 instead (and the default dtype is float64), so a float64
model computes in float64 throughout - on the reference side and on treelit's side alike.
Nothing of transformers' code is rebound; only dtypes requested while the mode is active change.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_TO = {torch.Tensor.to, torch.Tensor.type, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
       torch.Tensor.new_full, torch.Tensor.new_tensor}


def _f64(x):
    return torch.float64 if x is torch.float32 else x


class KeepFloat64(TorchFunctionMode):
    """``with KeepFloat64(): ...``: float32 requests become float64 (see module docs)."""

    def __enter__(self):
        # a stack: the same mode may be entered again while active (activation checkpointing's
        # recompute re-enters the modes that were active in the forward)
        self.__dict__.setdefault("_defaults", []).append(torch.get_default_dtype())
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._defaults.pop())
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        if "dtype" in kwargs:
            kwargs["dtype"] = _f64(kwargs["dtype"])
        if func in _TO:
            args = tuple(_f64(a) for a in args)
        return func(*args, **kwargs)
