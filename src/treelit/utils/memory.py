"""Peak tensor memory on CPU and GPU.

CPU has no allocator statistics, so on CPU a small dispatch mode follows every tensor
storage created while it is active (forward and backward kernels alike), adds its bytes
when it appears and subtracts them when the storage is freed (weak-reference callback).
The peak counts tensors allocated inside the measured region only: parameters and
tensors that existed before are excluded, gradients created inside are counted. On
CUDA the allocator's own peak statistic is used.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "peak_memory", "track_peak"]


class LiveBytes(TorchDispatchMode):
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
            if isinstance(t, torch.Tensor) and not t.is_meta and t.device.type == "cpu":
                try:  # a wrapper subclass (an FSDP2 DTensor) has no storage of its own: its local tensor is counted
                    st = t.untyped_storage()
                    key = st.data_ptr()
                except RuntimeError:
                    continue
                if key == 0 or key in self.live:
                    continue
                self.live[key] = st.nbytes()
                self.refs[key] = weakref.ref(st, lambda _r, k=key: self._release(k))
                self.current += st.nbytes()
                self.peak = max(self.peak, self.current)
        return out


@contextmanager
def track_peak(device: Optional[torch.device] = None) -> Iterator[Dict[str, int]]:
    """``with track_peak(dev) as m: ...`` then ``m["peak"]`` holds the region's peak bytes."""
    out: Dict[str, int] = {"peak": 0}
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        yield out
        torch.cuda.synchronize(dev)
        out["peak"] = torch.cuda.max_memory_allocated(dev) - before
        return
    mode = LiveBytes()
    with mode:
        yield out
    out["peak"] = mode.peak


def peak_memory(fn: Callable[[], Any], device: Optional[torch.device] = None) -> Tuple[int, Any]:
    """Run ``fn`` and return (peak bytes of tensors it allocated, its result)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    with track_peak(device) as m:
        out = fn()
    return m["peak"], out
