"""Where one training step's time goes, per layer kind, for transformers-built hybrid models.

Every mixer of a decoder layer (attention, Gated DeltaNet / Mamba2, MLP) and the head run inside
an autograd function that runs the module on a detached copy of its input and, in the backward
pass, runs the module's own backward (``torch.autograd.backward`` from its output); this
process's CPU time of both is charged to the module's kind. ``attention`` / ``recurrent`` are
whole mixers (projections, convolution, scan, gates, norms inside them); ``head`` is treelit's
chunked head (``weighted_nll``) for treelit's passes, and ``lm_head`` + transformers' loss
function for a transformers model; ``other`` is the rest of the step (embedding, layer norms,
residuals, gathers, autograd bookkeeping). The wrapping leaves the gradients unchanged (the
benchmark checks it: ``split_grad_diff``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Dict

import torch

KINDS = ("attention", "recurrent", "mlp", "head")


def layer_kind(module: torch.nn.Module):
    """The kind of a decoder layer's child by its class name (None: norms and the like)."""
    name = type(module).__name__
    if "GatedDeltaNet" in name or "Mamba" in name:
        return "recurrent"
    if "Attention" in name:
        return "attention"
    if "MLP" in name or "MoE" in name:
        return "mlp"
    return None


def mixers(layers) -> Dict[str, list]:
    out = {k: [] for k in KINDS if k != "head"}
    for layer in layers:
        for child in layer.children():
            kind = layer_kind(child)
            if kind is not None:
                out[kind].append(child)
    return out


CLOCK: Dict[str, float] = {}


class _Charged(torch.autograd.Function):
    """``run(x)`` on a detached copy of ``x``; forward and backward CPU time charged to ``kind``."""

    @staticmethod
    def forward(ctx, kind, run, x):
        leaf = x.detach().requires_grad_(x.requires_grad)
        t0 = time.process_time()
        with torch.enable_grad():
            out = run(leaf)
        CLOCK[kind] += time.process_time() - t0
        ctx.kind, ctx.out, ctx.leaf = kind, out, leaf
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        t0 = time.process_time()
        if ctx.out.requires_grad:
            torch.autograd.backward(ctx.out, g)  # the module's parameters accumulate their gradients here
        CLOCK[ctx.kind] += time.process_time() - t0
        grad = ctx.leaf.grad if ctx.leaf.requires_grad else None
        ctx.out = ctx.leaf = None
        return None, None, grad


def _charge(kind: str, x: torch.Tensor, run: Callable):
    """``run(x) -> tensor or (tensor, ...)`` through :class:`_Charged` (other outputs returned as they are)."""
    box = {}

    def inner(leaf):
        r = run(leaf)
        box["rest"] = r[1:] if isinstance(r, tuple) else None
        return r[0] if isinstance(r, tuple) else r

    out = _Charged.apply(kind, inner, x)
    return out if box["rest"] is None else (out, *box["rest"])


def _module_forward(kind: str, orig: Callable) -> Callable:
    def forward(*args, **kwargs):
        x = args[0] if args else kwargs.pop("hidden_states")

        return _charge(kind, x, lambda leaf: orig(leaf, *args[1:], **kwargs))

    return forward


@contextmanager
def charged(model, kind_of_head: str):
    """Route ``model``'s mixers and head through :class:`_Charged` (restored on exit).
    ``kind_of_head``: ``treelit`` (the chunked head of treelit's passes) or ``hf`` (the
    transformers model's ``lm_head`` and loss function)."""
    from treelit.loss import linear as linear_mod
    from treelit.loss import tree as tree_mod

    layers = model.layers if kind_of_head == "treelit" else model.model.layers
    saved_mods, saved_attrs = [], []
    for kind, mods in mixers(layers).items():
        for m in mods:
            saved_mods.append((m, m.__dict__.get("forward")))
            m.forward = _module_forward(kind, m.forward)
    if kind_of_head == "treelit":
        for mod in (tree_mod, linear_mod):
            orig = mod.weighted_nll
            saved_attrs.append((mod, "weighted_nll", orig))

            def head(hidden, weight, targets, coef, _orig=orig, **kw):
                return _charge("head", hidden, lambda h: _orig(h, weight, targets, coef, **kw))

            mod.weighted_nll = head
    else:
        lm = model.lm_head
        saved_mods.append((lm, lm.__dict__.get("forward")))
        lm.forward = _module_forward("head", lm.forward)
        loss_fn = model.loss_function
        saved_attrs.append((model, "loss_function", loss_fn))

        def loss(logits, labels, *a, **kw):
            return _charge("head", logits, lambda x: loss_fn(x, labels, *a, **kw))

        model.loss_function = loss
    try:
        yield
    finally:
        for obj, name, orig in reversed(saved_attrs):
            setattr(obj, name, orig)
        for m, fwd in saved_mods:
            if fwd is None:
                del m.forward
            else:
                m.forward = fwd


def split(step: Callable, model, kind_of_head: str) -> Dict[str, float]:
    """CPU seconds of one ``step`` in total and per kind (``other`` = the rest)."""
    CLOCK.clear()
    CLOCK.update({k: 0.0 for k in KINDS})
    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    with charged(model, kind_of_head):
        step()
    total = time.process_time() - t0
    out = {"total": total, **CLOCK}
    out["other"] = total - sum(CLOCK[k] for k in KINDS)
    return out
