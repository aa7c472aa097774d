"""Routing replay for transformers' mixture-of-experts routers (the ``hf_auto`` path).

Replay fixes *which* experts each token goes to (the sampler's record) and leaves everything
else to the family's own router: its logits, its softmax or sigmoid scores, its normalisation
(``norm_topk_prob``, a routed scaling factor), its shared expert. transformers' routers pick
their experts with one ``torch.topk`` over the ``[tokens, experts]`` scores; while a router
runs, a torch-function mode answers that one call with the recorded experts and the scores
*at* those experts (the values the family then normalises exactly as it would its own top-k),
so the router's code stays transformers' and the router keeps its gradient. Tokens without a
record (rows of -1) keep the router's own top-k.

The routers are the modules transformers records as ``router_logits`` (the model's
``_can_record_outputs``), in layer order: the i-th of them reads MoE layer i of the record.
A router whose forward does not make exactly one such top-k call (a family that chooses its
experts another way) is an error at its first replayed pass, never a silent live routing.

With activation checkpointing (transformers' own, per layer, non-reentrant) a layer's forward
runs again in the backward, outside the pass: :mod:`treelit.models.hf_recompute` puts the
pass's context back around the recompute, so the recomputed routers replay the same records.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["router_modules", "ReplayBinding"]


def router_modules(hf_model: nn.Module) -> List[nn.Module]:
    """The modules whose first output transformers records as ``router_logits``, in layer order."""
    classes = []
    for mod in hf_model.modules():
        spec = getattr(type(mod), "_can_record_outputs", None) or {}
        rec = spec.get("router_logits") if isinstance(spec, dict) else None
        target = getattr(rec, "target_class", rec)
        if isinstance(target, type) and target not in classes:
            classes.append(target)
    return [m for m in hf_model.modules() if isinstance(m, tuple(classes))] if classes else []


class _ReplayTopK(TorchFunctionMode):
    """``torch.topk(scores [T, E], k)`` -> the recorded experts ``[T, k]`` and the scores at them."""

    def __init__(self, experts: torch.Tensor, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.experts, self.E, self.k = experts, int(num_experts), int(top_k)
        self.hits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            x = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape == (self.experts.shape[0], self.E)
                    and k == self.k and dim in (-1, 1)):
                _, idx = func(*args, **kwargs)
                r = self.experts.to(idx.device)
                idx = torch.where(r[:, :1] >= 0, r, idx)
                self.hits += 1
                return torch.return_types.topk((x.gather(-1, idx), idx))
        return func(*args, **kwargs)


class ReplayBinding:
    """Forward hooks on a model's routers that replay the routing of the pass in ``self.ctx``
    (set by the adapter around each forward; outside one, a replayed router refuses to run)."""

    def __init__(self, hf_model: nn.Module, num_experts: int, top_k: int) -> None:
        self.routers = router_modules(hf_model)
        if not self.routers:
            raise ValueError(f"{type(hf_model).__name__}: no router module found (transformers records none as "
                             "router_logits), so its routing cannot be replayed")
        self.E, self.k = int(num_experts), int(top_k)
        self.ctx = None
        self._active: List[_ReplayTopK] = []
        self._handles = []
        for r in self.routers:  # bound methods: a deep copy of the model (a reference policy) copies the binding
            self._handles.append(r.register_forward_pre_hook(self._enter))
            self._handles.append(r.register_forward_hook(self._exit))

    def _index(self, module) -> int:
        return next(i for i, r in enumerate(self.routers) if r is module)

    def _enter(self, module, args):
        if self.ctx is None:
            raise RuntimeError("model.moe.routing=replay: a router ran outside treelit's passes (a layer "
                               "recomputed by a checkpoint that does not restore the pass: hf_recompute)")
        mode = _ReplayTopK(self.ctx.replay_experts(self._index(module), self.k), self.E, self.k)
        mode.__enter__()
        self._active.append(mode)

    def _exit(self, module, args, output):
        mode = self._active.pop()
        mode.__exit__(None, None, None)
        if mode.hits != 1:
            raise RuntimeError(f"{type(module).__name__} (MoE layer {self._index(module)}) made {mode.hits} top-k "
                               f"choices over its [tokens, {self.E}] scores, not one: routing replay cannot replace "
                               "its choice")

    def unwind(self) -> None:
        """Leave every mode a failed forward left entered (innermost first)."""
        while self._active:
            self._active.pop().__exit__(None, None, None)

    def remove(self) -> None:
        self.unwind()
        for h in self._handles:
            h.remove()
        self._handles = []

