"""Peak tensor memory of a function call, on CPU or GPU.

CPU has no allocator statistics, so on CPU a small dispatch mode follows every tensor
storage created while the call runs (forward and backward kernels alike), adds its
bytes when it appears and subtracts them when the storage is freed (a weak reference
callback). The result is the peak of live tensor bytes allocated by the call itself;
parameters and tensors that existed before are not counted, gradients created by the
call are. On CUDA the allocator's own peak statistic is used.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, int] = {}
        self.refs: Dict[int, Any] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                key = st.data_ptr()
                if key == 0 or key in self.live:
                    continue
                self.live[key] = st.nbytes()
                self.refs[key] = weakref.ref(st, lambda _r, k=key: self._release(k))
                self.current += st.nbytes()
                self.peak = max(self.peak, self.current)
        return out


def peak_memory(fn: Callable[[], Any]) -> Tuple[Optional[int], Any]:
    """Run ``fn`` and return (peak bytes of tensors it allocated, its result)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, out
    mode = _LiveBytes()
    with mode:
        out = fn()
    return mode.peak, out
