"""Run fla's real Triton kernels on CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

Import this module before anything imports Triton or fla, in a process of its own (the test runs it
as a subprocess): ``triton.jit`` picks the interpreter when a kernel is decorated. Three shims make
fla's kernels run there, each because the interpreter differs from a GPU launch in one way:

1. **The autotuner times nothing.** It would benchmark every config on a device that is not there;
   it takes the first config (the results do not depend on the config).
2. **``torch.cuda.device`` / ``get_device_properties``** are asked by fla's launch code for the
   device's index and properties; CPU stand-ins answer (a context that does nothing, fixed sizes).
3. **Loop indices get ``.to(dtype)``.** Compiled kernels see a loop index as a scalar tensor, and fla
   writes ``i_t.to(tl.int64)``; the interpreter hands over a Python int. Loops over ``range`` in fla's
   modules yield ints that have ``.to`` (``tl.full([], i, dtype)``, the same value).

Float32 dots run in IEEE (``TRITON_F32_DEFAULT=ieee``), as the torch reference does.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["TRITON_F32_DEFAULT"] = "ieee"
os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_FLASH_KDA", "0")

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import autotuner  # noqa: E402

__all__ = ["install"]

_run = autotuner.Autotuner.run


def _first_config(self, *args, **kwargs):
    if len(self.configs) > 1:
        self.configs = self.configs[:1]
    return _run(self, *args, **kwargs)


class _Properties:
    multi_processor_count = 4
    max_shared_memory = 2**16
    name = "cpu (Triton interpreter)"
    major, minor = 9, 0


class _LoopIndex(int):
    def to(self, dtype, **kwargs):
        return tl.full([], int(self), dtype)


class _Range:
    def __init__(self, *args):
        self._r = builtins.range(*args)

    def __iter__(self):
        return (_LoopIndex(i) for i in self._r)

    def __len__(self):
        return len(self._r)


def install() -> None:
    """The three shims (call once, before the kernels run)."""
    autotuner.Autotuner.run = _first_config
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda *a, **k: _Properties()
    import fla.ops  # noqa: F401  (the kernels' modules, so their loops can be given _Range)
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.kda  # noqa: F401

    try:  # mamba-ssm built without CUDA (MAMBA_SKIP_CUDA_BUILD): its package imports a CUDA extension
        import types

        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except ImportError:
        pass
    for name, mod in list(sys.modules.items()):
        if (name.startswith("fla.ops") or name.startswith("mamba_ssm.ops")) and mod is not None:
            mod.__dict__["range"] = _Range
