"""Compiled decoder layers (``compile=true``): ``torch.compile`` over each layer, the tree
attention (and a recurrent layer's mixer) one opaque operator in its graph.

Why not compile the model as it stands: a tree attention backend is data-dependent Python
over a host-side plan (the segment backend's groups, slices and gathers), so tracing it breaks
the graph at every ``.item()`` and recompiles on every new tree (the planner's Python ints
become guards), and the layer index a layer passes to its context is baked in as a constant,
so each layer compiles its own graph until dynamo's recompile limit (8) leaves the rest eager.

Here an attention layer's dense arithmetic - the norms, the q/k/v projections, q/k norms, RoPE,
the output projection and the MLP - is traced once, with a dynamic token dimension
(:func:`torch._dynamo.maybe_mark_dynamic` on ``h [B, L, D]``), and the attention call is
``treelit::tree_attention(q, k, v, token)``, a :func:`torch.library.custom_op` that dynamo
does not look into. What varies per tree and per layer (the sequence context, the layer index,
its sliding window) is not an argument of the traced function: the caller files it under a
fresh integer key, and ``token`` is a 0-dim CPU ``int64`` tensor holding that key (a tensor's
value is never guarded on, and reading a CPU tensor does not sync a GPU). Every attention layer
of the model then runs the same compiled graph (dynamo inlines ``nn.Module`` calls and treats
the parameters as inputs), whatever the tree, until the grad mode or a layer's structure
changes.

The operator runs the context's attention exactly as the eager layer would (same backend, same
plan), on leaves detached from ``q, k, v``, and keeps that small autograd graph under the key;
its backward (``treelit::tree_attention_backward``, also opaque) differentiates that graph, so
the gradients are the backend's own. A record lives until the backward has used it or the
compiled graph that holds ``token`` is freed (a forward whose backward never runs).

A recurrent block (:class:`~treelit.ssm.layers.RecurrentBlock`: GDN, Mamba2) compiles its norms
and MLP around ``treelit::tree_mixer(x, params, token)``: the mixer (projections, short
convolutions, the scan over the tree's depth levels) runs eager inside, as in the eager layer,
and its backward returns the gradients of the input and of the mixer's parameters (passed in as
``params`` so that the compiler routes them). One graph per kind of block (GDN, Mamba2).

The compiled MLP runs on all of a pass's tokens at once (``model.mlp_token_block``, the eager
CPU path's split into blocks of at most 32 MiB of activations, does not apply).

Not compiled here (they run eager, through :func:`treelit.models.decoder._layer_forward`):
passes with external K/V or state, or that capture K/V or recurrent state (partitioning), and
mixture-of-experts layers (refused by :func:`compile_layers`: their router records per layer).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
from torchtune.modules import TransformerSelfAttentionLayer

from treelit.models.decoder import attention_inputs
from treelit.models.moe import MoEFeedForward
from treelit.ssm.layers import RecurrentBlock
from treelit.utils.numerics import rms_norm

__all__ = ["BACKENDS", "CompiledLayers", "compile_layers", "compile_backend", "compile_line"]

BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends the ``compile`` option names

_CALLS: Dict[int, Tuple[Callable[..., torch.Tensor], bool, List[torch.Tensor]]] = {}  # key -> (run, grad, params)
_RECORDS: Dict[int, Tuple[torch.Tensor, List[torch.Tensor]]] = {}  # key -> (output, what it is differentiated by)
_KEYS = itertools.count()


def _forget(key: int) -> None:
    _CALLS.pop(key, None)
    _RECORDS.pop(key, None)


def _like(x: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """``x`` with ``layout``'s strides (what the fake implementations promise the compiler)."""
    same = all(a == b for n, a, b in zip(x.shape, x.stride(), layout.stride()) if n > 1)
    return x if same and x.dtype == layout.dtype else torch.empty_like(layout).copy_(x)


@contextlib.contextmanager
def _recording():
    """Autograd on inside an operator's implementation (the dispatcher runs it below autograd)."""
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
            torch._C.DispatchKey.AutogradNestedTensor)
    with contextlib.ExitStack() as stack:
        for key in keys:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        yield


def _run(token: torch.Tensor, inputs: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The call filed under ``token`` on ``inputs``, eager; with gradients, its graph is kept (on
    leaves detached from ``inputs``, and the module parameters it was filed with) for :func:`_grads`."""
    key = int(token)
    run, grad, params = _CALLS.pop(key)
    if not grad:
        with torch.no_grad():
            return _like(run(*inputs), inputs[0])
    with _recording():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = run(*leaves)
    _RECORDS[key] = (out, leaves + list(params))
    return _like(out.detach(), inputs[0])


def _grads(token: torch.Tensor, grad: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Gradients of the call filed under ``token`` by its inputs and parameters (``like``'s layouts;
    zeros for a frozen parameter)."""
    record = _RECORDS.pop(int(token), None)
    if record is None:
        raise RuntimeError("treelit compiled layer: no forward record for this backward (the backward ran twice, "
                           "or its forward ran without gradients)")
    out, wrt = record
    need = [t for t in wrt if t.requires_grad]
    got = iter(torch.autograd.grad(out, need, grad, allow_unused=True))
    grads = [next(got) if t.requires_grad else None for t in wrt]
    return [torch.zeros_like(x) if g is None else _like(g, x) for g, x in zip(grads, like)]


@torch.library.custom_op("treelit::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """The attention of the layer filed under ``token``: ``q [B, Hq, L, D]``, ``k, v [B, Hkv, L, D]``
    (post-RoPE, not expanded) -> ``[B, Hq, L, D]`` in ``q``'s layout."""
    return _run(token, (q, k, v))


@tree_attention.register_fake
def _(q, k, v, token):
    return torch.empty_like(q)


@torch.library.custom_op("treelit::tree_attention_backward", mutates_args=())
def tree_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            token: torch.Tensor) -> List[torch.Tensor]:
    """Gradients ``[dq, dk, dv]`` of the attention filed under ``token`` (in the layouts of q, k, v)."""
    return _grads(token, grad, [q, k, v])


@tree_attention_backward.register_fake
def _(grad, q, k, v, token):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _attention_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _attention_backward(ctx, grad):
    q, k, v, token = ctx.saved_tensors
    dq, dk, dv = tree_attention_backward(grad, q, k, v, token)
    return dq, dk, dv, None


tree_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op("treelit::tree_mixer", mutates_args=())
def tree_mixer(x: torch.Tensor, params: List[torch.Tensor], token: torch.Tensor) -> torch.Tensor:
    """The recurrent mixer of the layer filed under ``token`` over ``x [B, L, D]`` -> ``[B, L, D]``;
    ``params``: the mixer's parameters (their gradients come back through this operator)."""
    return _run(token, (x,))


@tree_mixer.register_fake
def _(x, params, token):
    return torch.empty_like(x)


@torch.library.custom_op("treelit::tree_mixer_backward", mutates_args=())
def tree_mixer_backward(grad: torch.Tensor, x: torch.Tensor, params: List[torch.Tensor],
                        token: torch.Tensor) -> List[torch.Tensor]:
    """Gradients ``[dx, *dparams]`` of the mixer filed under ``token``."""
    return _grads(token, grad, [x, *params])


@tree_mixer_backward.register_fake
def _(grad, x, params, token):
    return [torch.empty_like(x)] + [torch.empty_like(p) for p in params]


def _mixer_setup(ctx, inputs, output) -> None:
    x, params, token = inputs
    ctx.save_for_backward(x, token, *params)


def _mixer_backward(ctx, grad):
    x, token, *params = ctx.saved_tensors
    dx, *dparams = tree_mixer_backward(grad, x, params, token)
    return dx, dparams, None


tree_mixer.register_autograd(_mixer_backward, setup_context=_mixer_setup)


def _attention_layer_body(layer: nn.Module, position_ids: torch.Tensor, token: torch.Tensor,
                          h: torch.Tensor) -> torch.Tensor:
    """One attention layer over ``h [B, L, D]`` (the arithmetic of the eager layer,
    :func:`treelit.models.decoder._layer_forward`, with the attention call opaque). Traced."""
    attn = layer.attn
    x = rms_norm(layer.sa_norm, h)
    B, L, _ = x.shape
    o = torch.ops.treelit.tree_attention(*attention_inputs(attn, x, position_ids), token)
    o = o.transpose(1, 2).reshape(B, L, attn.num_heads * attn.head_dim)
    h = h + layer.sa_scale(attn.output_proj(o))
    return h + layer.mlp_scale(layer.mlp(rms_norm(layer.mlp_norm, h)))


def _recurrent_layer_body(layer: nn.Module, token: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One recurrent block over ``h [B, L, D]`` (:meth:`treelit.ssm.layers.RecurrentBlock.tree_forward`,
    the mixer opaque: its scan walks the tree's depth levels in Python). Traced."""
    h = h + torch.ops.treelit.tree_mixer(rms_norm(layer.sa_norm, h), list(layer.mixer.parameters()), token)
    if layer.mlp is not None:
        h = h + layer.mlp(rms_norm(layer.mlp_norm, h))
    return h


class CompiledLayers:
    """The compiled attention-layer forward a model runs its layers through (``model.compiled_layers``).

    Args:
        backend: a ``torch.compile`` backend: a name (:data:`BACKENDS`) or a backend callable.
    """

    def __init__(self, backend: Any = "inductor") -> None:
        self.backend = backend if callable(backend) else compile_backend(backend)
        self.attention = torch.compile(_attention_layer_body, backend=self.backend)
        self.recurrent = torch.compile(_recurrent_layer_body, backend=self.backend)

    def __deepcopy__(self, memo):  # a copied model (a frozen reference) shares the compiled function
        return self

    def takes(self, layer: nn.Module, ctx) -> bool:
        """Whether ``layer`` runs compiled in the pass of ``ctx`` (else it runs eager)."""
        if getattr(ctx, "capture_kv", False) or getattr(ctx, "external", None) is not None \
                or getattr(ctx, "captures_recurrent", False):
            return False
        return compiles(layer)

    def forward(self, layer: nn.Module, index: int, position_ids: torch.Tensor, ctx, h: torch.Tensor) -> torch.Tensor:
        """Layer ``index`` over ``h [B, L, D]`` (``call_block``'s body), compiled."""
        key = next(_KEYS)
        token = torch.tensor(key, dtype=torch.int64)
        if isinstance(layer, RecurrentBlock):
            params = list(layer.mixer.parameters())
            run = functools.partial(_mixer_call, layer.mixer, index, ctx)
        else:
            params = []
            run = functools.partial(_attention_call, ctx, index, getattr(layer.attn, "sliding_window", None))
        needs_grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in layer.parameters()))
        _CALLS[key] = (run, needs_grad, params)
        weakref.finalize(token, _forget, key)  # the compiled graph holds ``token`` until its backward is done
        for t in (h, position_ids):
            torch._dynamo.maybe_mark_dynamic(t, 1)  # tokens
            torch._dynamo.maybe_mark_dynamic(t, 0)  # rows (per-branch micro-batches)
        if isinstance(layer, RecurrentBlock):
            return self.recurrent(layer, token, h)
        return self.attention(layer, position_ids, token, h)


def _attention_call(ctx, index, window, q, k, v):
    return ctx.attention(index, q, k, v, window=window)


def _mixer_call(mixer, index, ctx, x):
    return mixer(x, index, ctx)


def compiles(layer: nn.Module) -> bool:
    """Whether a layer runs compiled: attention and recurrent layers do, mixture-of-experts ones not."""
    if isinstance(layer, RecurrentBlock):
        return True
    return isinstance(layer, TransformerSelfAttentionLayer) and not isinstance(layer.mlp, MoEFeedForward)


def compile_backend(value: Any) -> str:
    """The backend the ``compile`` option names (``true``: inductor)."""
    if value is True:
        return "inductor"
    if isinstance(value, str) and value in BACKENDS:
        return value
    raise ValueError(f"compile={_shown(value)} is not a choice: use false, true (inductor) or one of "
                     f"{', '.join(BACKENDS)}")


def compile_layers(model: nn.Module, setting: Any) -> nn.Module:
    """Run ``model``'s attention layers compiled (``setting``: the ``compile`` option; false: eager).

    Refused, in one line: a model whose layers treelit does not run itself (the transformers
    adapter) and mixture-of-experts models."""
    if setting in (False, None):
        model.compiled_layers = None
        return model
    backend = compile_backend(setting)
    setting = _shown(setting)
    if not hasattr(model, "layers") or not hasattr(model, "config") or hasattr(model, "hf"):
        raise ValueError(f"compile={setting}: only treelit's own decoders compile their layers; the transformers "
                         "adapter (model=hf_auto) runs eager, set compile=false")
    if any(isinstance(getattr(layer, "mlp", None), MoEFeedForward) for layer in model.layers):
        raise ValueError(f"compile={setting}: mixture-of-experts layers (their router is recorded per layer) run "
                         "eager only, set compile=false")
    model.compiled_layers = CompiledLayers(backend)
    return model


def compile_line(model: nn.Module) -> str:
    """The startup line of a compiled model: its backend and the layers that run compiled."""
    layers = list(getattr(model, "layers", []))
    recurrent = sum(isinstance(x, RecurrentBlock) for x in layers)
    backend = getattr(model.compiled_layers.backend, "__name__", model.compiled_layers.backend)
    kinds = f"{len(layers)} layers" if not recurrent else \
        f"{len(layers) - recurrent} attention and {recurrent} recurrent layers (the recurrent mixers opaque)"
    return f"compile={backend}: {kinds} run compiled; the first step compiles"


def _shown(value: Any) -> str:
    """An option value as written on the command line (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
