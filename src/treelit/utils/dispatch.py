"""What a step would ask of a GPU's host, counted on any device: launches, syncs, uploads.

On a GPU every kernel a step dispatches costs ~5-20 us of host time (Python, the dispatcher,
the launch itself), every ``.item()``, ``nonzero`` or boolean mask blocks the host until the
queue drains, and every tensor made from host data is a host-to-device copy. Those costs do
not depend on the device the step runs on, only on what it dispatches, so they can be counted
exactly on CPU with a :class:`~torch.utils._python_dispatch.TorchDispatchMode`:

* **launches**: aten operators that run a kernel: every dispatched operator except views
  (``view``, ``transpose``, ``slice``, ... alias their input), allocations (``empty*``) and
  the scalar reads counted as syncs; operators whose tensor inputs all live on the host (index
  planning done with torch on CPU tensors) run on the host on a GPU too and are not counted;
* **syncs**: reads of a device value by the host: ``.item()`` / ``int()`` / ``bool()``
  (``_local_scalar_dense``), ``nonzero``, boolean-mask indexing and ``masked_select``, ``unique``,
  ``repeat_interleave`` without its output size, a copy to the CPU, and ``.tolist()`` /
  ``.numpy()`` of a device tensor;
* **uploads**: tensors made from host data inside the counted region (``torch.from_numpy``,
  ``torch.tensor``, ``torch.as_tensor``, ``torch.asarray``), counted once: when they are moved
  with ``.to(device)`` (any device: the move to ``cpu`` stands for the move to the GPU), or
  else when a device operator first reads them.

"Device tensor" means one that did not come from host data inside the region: the batch, the
parameters and everything computed from them. On CPU a copy ``.to("cpu")`` of a host tensor is
a no-op and dispatches nothing, which is why uploads are counted where the host data becomes a
tensor rather than where it is moved.

    with DispatchCounter() as c:
        loss = step(); loss.backward()
    print(c.counts.launches, c.counts.syncs, c.counts.uploads)
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["DispatchCounter", "StepCounts", "host_floats", "upload", "upload_all"]

_aten = torch.ops.aten
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.detach.default, _aten.lift_fresh.default, _aten.alias.default,
    _aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default,
    _aten.is_same_size.default, _aten.set_.source_Storage_storage_offset, _aten._unsafe_view.default,
}
_ALWAYS_SYNC = {
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.nonzero_static.default, _aten.masked_select.default,
    _aten.argwhere.default, _aten.is_nonzero.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default, _aten._unique.default,
}
_HOST_FACTORIES = ("from_numpy", "tensor", "as_tensor", "asarray")


@dataclass
class StepCounts:
    """What one counted region dispatched. ``ops``: launches per operator name."""

    launches: int = 0
    syncs: int = 0
    uploads: int = 0
    ops: Counter = field(default_factory=Counter)
    sync_ops: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)  # with ``where=True``: "sync|upload file:line" of each

    def as_dict(self) -> Dict[str, Any]:
        return {"launches": self.launches, "syncs": self.syncs, "uploads": self.uploads,
                "sync_ops": dict(self.sync_ops)}


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs))
    return (a for a in flat if isinstance(a, torch.Tensor))


def _syncs(func, args, kwargs) -> bool:
    if func in _ALWAYS_SYNC:
        return True
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None)
    if func is _aten._to_copy.default:  # a device tensor copied to the host (``.cpu()``, ``.to("cpu")``)
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu"
    return False


class DispatchCounter(TorchDispatchMode):
    """Counts launches, syncs and uploads (module docs) of the code run inside it.

    ``counts`` holds the totals; :meth:`reset` starts them again (e.g. after a warm-up step)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.where = where  # record the treelit line of each sync and upload (slower)
        self.counts = StepCounts()
        self._host: Dict[int, "weakref.ref[torch.Tensor]"] = {}  # made from host data, not uploaded yet (by id)
        self._patched: Dict[str, Any] = {}

    def reset(self) -> None:
        self.counts = StepCounts()

    # -- host data becoming tensors, and device tensors read by the host --------------------------------
    def _mark_host(self, t):
        if isinstance(t, torch.Tensor):
            self._host[id(t)] = weakref.ref(t)
        return t

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _site(self, kind: str) -> None:
        if self.where:
            for fr in reversed(traceback.extract_stack()[:-2]):
                if "treelit" in fr.filename and not fr.filename.endswith("dispatch.py"):
                    self.counts.sites[f"{kind} {fr.filename.split('src/')[-1]}:{fr.lineno}"] += 1
                    return
            self.counts.sites[f"{kind} ?"] += 1

    def _sync(self, what: str) -> None:
        self.counts.syncs += 1
        self.counts.sync_ops[what] += 1
        self._site("sync")

    def _upload(self) -> None:
        self.counts.uploads += 1
        self._site("upload")

    def __enter__(self):
        counter = self
        self._own_tensor_attrs = {a for a in ("to", "tolist", "numpy") if a in torch.Tensor.__dict__}
        for name in _HOST_FACTORIES:
            orig = getattr(torch, name)
            self._patched[name] = orig

            def made_on_host(*a, __orig=orig, **k):
                dev = k.get("device")
                out = __orig(*a, **k)
                if a and isinstance(a[0], torch.Tensor):  # a tensor already: no host data involved
                    return out
                if dev is not None and torch.device(dev).type != "cpu":
                    counter._upload()  # straight onto an accelerator
                    return out
                return counter._mark_host(out)

            setattr(torch, name, made_on_host)
        orig_to = torch.Tensor.to
        self._patched["Tensor.to"] = orig_to

        def moved(t, *a, **k):
            out = orig_to(t, *a, **k)
            dev = k.get("device", a[0] if a and isinstance(a[0], (str, torch.device)) else None)
            if dev is not None and counter._is_host(t):  # host data sent to the device: the upload
                counter._upload()
                counter._host.pop(id(t), None)
                counter._host.pop(id(out), None)
            return out

        torch.Tensor.to = moved
        for name in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, name)
            self._patched["Tensor." + name] = orig

            def host_read(t, *a, __orig=orig, __name=name, **k):
                if not counter._is_host(t):
                    counter._sync(__name)
                return __orig(t, *a, **k)

            setattr(torch.Tensor, name, host_read)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, orig in self._patched.items():
                if name.startswith("Tensor."):
                    attr = name[len("Tensor."):]
                    if attr in self._own_tensor_attrs:
                        setattr(torch.Tensor, attr, orig)
                    else:  # inherited (from TensorBase): leave torch.Tensor's own dict as it was
                        delattr(torch.Tensor, attr)
                else:
                    setattr(torch, name, orig)
            self._patched.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = list(_tensors(args, kwargs))
        host_ins = [t for t in ins if self._is_host(t)]
        on_host = bool(ins) and len(host_ins) == len(ins)
        out = func(*args, **kwargs)
        if on_host:  # planning on host tensors: runs on the host on a GPU too; its results stay host data
            for t in _tensors((out,), {}):
                self._mark_host(t)
            return out
        for t in host_ins:  # host data read by a device operator: one upload each
            self._upload()
            self._host.pop(id(t), None)
        if _syncs(func, args, kwargs):
            self._sync(str(func.overloadpacket.__name__))
        elif func not in _NO_KERNEL and not getattr(func, "is_view", False):
            self.counts.launches += 1
            self.counts.ops[str(func.overloadpacket.__name__)] += 1
        return out

    @classmethod
    def of(cls, fn, *args, **kwargs) -> StepCounts:
        """Counts of one call ``fn(*args, **kwargs)``."""
        with cls() as c:
            fn(*args, **kwargs)
        return c.counts


def upload(a, device) -> torch.Tensor:
    """Host array ``a`` on ``device`` in one copy: from pinned memory and non-blocking on an
    accelerator (the copy joins the queue; the host goes on planning)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def upload_all(arrays, device) -> List[torch.Tensor]:
    """Integer host arrays on ``device`` in one copy (:func:`upload` of their concatenation):
    views of one buffer, each of its array's shape."""
    arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
    buf = upload(np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, np.int64), device)
    ends = np.cumsum([0] + [a.size for a in arrays])
    return [buf[int(a): int(b)].view(x.shape) for a, b, x in zip(ends[:-1], ends[1:], arrays)]


def host_floats(metrics: Dict[str, Any]) -> Dict[str, float]:
    """``metrics`` with every tensor value read to a Python float in one device-to-host copy
    (one sync for all of them, not one per value); other values as ``float``."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist() if keys else []
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    out.update(zip(keys, values))
    return {k: out[k] for k in metrics}
