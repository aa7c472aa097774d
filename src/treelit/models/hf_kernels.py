"""Tree-exact kernels for transformers' hybrid layers (Gated DeltaNet, KDA, Mamba2, short convolutions).

transformers' hybrid mixers (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / OLMo-hybrid Gated DeltaNet,
Kimi-Linear Kimi Delta Attention, Nemotron-H / Bamba / Granite-4 / Falcon-H1 Mamba2, LFM2 short
convolutions) compute everything - projections, gates, norms, MoE - in their own code and call a
handful of kernel entry points for the sequence mixing: ``causal_conv1d_fn``,
``chunk_gated_delta_rule``, ``chunk_kda``, ``mamba_chunk_scan_combined``, ... Each
is a module-level function of the modelling file, decorated with
``use_kernel_func_from_hub_with_fallback(name, package)``: the decorator picks fla / mamba-ssm /
causal-conv1d when importable (their CUDA/Triton kernels: they fail on CPU) and keeps the
reference torch function at ``__wrapped__``. The mixer's ``forward`` calls these functions by
their global names.

**Interception.** For a model the adapter loads, every mixer instance whose ``forward`` calls one of
these entry points gets its own copy of that ``forward``: the same code object (and the same
decorator chain, rebuilt around it) with a globals dict in which each entry point is replaced by
a dispatcher. Nothing in transformers' modules is changed; other models in the process, and the
class itself, keep the original functions. The entry points are recognised by the kernel name the
decorator was given (``func_name`` in its closure, or ``kernel_layer_name`` when the ``kernels``
package turned it into a layer), not by the family, so a new family built from the same entry
points needs no code here - only a test and an entry in :data:`HYBRID_FAMILIES`.

**Dispatch.** The instance's ``forward`` records which layer is running and the ``treelit_ctx``
keyword (the tree context the attention function also receives); the dispatcher then runs
treelit's tree version: the convolution reads each token's ancestors across segments
(:func:`treelit.ssm.layers.causal_conv`), the recurrences start every segment from its parent
segment's final state (:func:`treelit.ssm.scan.chunked_scan`, exact in the input precision), and
with partitioning the states and convolution contexts at partition boundaries are captured and
read back (named ``conv0``, ``state0``, ... per layer, in call order). Without a treelit context
(the model called directly) the dispatcher runs transformers' own torch function, never fla.

**Backends** (``ssm=torch|fla``, :func:`treelit.ssm.set_ssm_backend`, per layer
``_treelit_backend``): ``torch`` runs treelit's chunked scans (any device, exact in the input
precision; ``ssm.chunk_size`` sets their block size, ``_treelit_chunk_size``); ``fla`` (CUDA)
runs Gated DeltaNet and KDA through fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` and the
Mamba2 scan through mamba-ssm's ``mamba_chunk_scan_combined``, level by level with per-segment
initial states (:mod:`treelit.ssm.fla_backend`). The inputs are prepared identically for both
(gates, l2-normalised q/k, dt's bias / softplus / limits, z's gate after the scan); the short
convolutions run on treelit's torch gather in both.

Limits: the fused ``mamba_split_conv1d_scan_combined`` answers ``None`` (what its torch
fallback answers), so the layer runs its unfused path; decode steps (``causal_conv1d_update``,
``selective_state_update``, any kernel handed a cache state) never run in tree mode (it runs
without a cache) and raise if reached with a tree context; an entry point not listed in
:data:`TREE_KERNELS` refuses the model at load time.
"""

from __future__ import annotations

import contextvars
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from treelit.ssm.fla_backend import gdn_scan_fla, kda_scan_fla, ssd_scan_mamba
from treelit.ssm.layers import causal_conv, conv_context_at
from treelit.ssm.scan import chunked_scan, gdn_chunk, kda_chunk, ssd_chunk

__all__ = ["TREE_KERNELS", "HYBRID_FAMILIES", "bind_tree_kernels", "bind_torch_kernels", "kernel_name",
           "kernel_calls"]

CHUNK_SIZE = 64  # tokens per block of treelit's chunked scans (exact for any size; ssm.chunk_size sets it)

# model types whose layers the adapter runs through these kernels (each is tested against
# transformers branch by branch in tests/models/test_hf_hybrid.py)
HYBRID_FAMILIES = {"qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "olmo_hybrid",
                   "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "lfm2", "kimi_linear"}


@dataclass
class _Call:
    """One mixer forward: its tree context, layer index, and how many kernels of each kind ran."""

    ctx: Any
    layer: int
    chunk_size: int = CHUNK_SIZE
    backend: str = "torch"  # ssm=torch|fla
    counts: Dict[str, int] = field(default_factory=dict)

    def name(self, kind: str) -> str:
        i = self.counts.get(kind, 0)
        self.counts[kind] = i + 1
        return f"{kind}{i}"

    def external(self, name: str):
        ext = self.ctx.recurrent_external(self.layer) if self.ctx is not None else None
        return None if not ext else ext.get(name)

    def record(self, name: str, value: torch.Tensor) -> None:
        if self.ctx.captures_recurrent:
            self.ctx.recurrent_out.setdefault(self.layer, {})[name] = value


_CALL: contextvars.ContextVar[Optional[_Call]] = contextvars.ContextVar("treelit_hybrid_call", default=None)


# -- the tree versions (contract: the torch function's arguments and return value) ---------------------
def _no_cache(kind: str, initial, final) -> None:
    if initial is not None or final:
        raise ValueError(f"{kind}: a recurrent cache (initial / final state) cannot be used in tree mode")


def _conv(call: _Call, hidden_states, weight, bias=None, activation=None, **kwargs):
    """``causal_conv1d_fn``: ``hidden_states [B, C, L]``, ``weight [C, K]`` -> ``[B, C, L]``."""
    from transformers.activations import ACT2FN  # optional, heavy: in transformers models only

    B, C, L = hidden_states.shape
    K = weight.shape[-1]
    layout = call.ctx.recurrent_layout(K, B, L, hidden_states.device)
    x = hidden_states.transpose(1, 2).reshape(B * L, C).to(weight.dtype)
    name = call.name("conv")
    context = call.external(name)
    y = causal_conv(x, weight, layout, context, bias)
    if call.ctx.captures_recurrent:
        toks = torch.from_numpy(layout.capture).to(x.device)
        call.record(name, conv_context_at(x, layout, context, toks))
    if activation is not None:
        y = ACT2FN[activation](y)
    return y.to(hidden_states.dtype).view(B, L, C).transpose(1, 2)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _scan(call: _Call, torch_chunk: Callable, fla_scan: Callable, K: int, B: int, L: int, state_shape, out_shape,
          like):
    """Run the recurrence over the context's segments - ``ssm=torch``: the blocks of ``torch_chunk()``;
    ``ssm=fla``: ``fla_scan(layout, initial state)`` - and capture / read the boundary state."""
    layout = call.ctx.recurrent_layout(K, B, L, like.device)
    name = call.name("state")
    init = call.external(name)
    if call.backend == "fla":
        out, cap = fla_scan(layout, init)
    else:
        out, cap = chunked_scan(torch_chunk(), layout, state_shape, out_shape, like, init, call.chunk_size)
    if cap is not None:
        call.record(name, cap)
    return out


def _gdn(call: _Call, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
         use_qk_l2norm_in_kernel=False, **kwargs):
    """``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``: ``query/key [B, L, H, K]``,
    ``value [B, L, HV, V]``, ``g/beta [B, L, HV]`` -> ``(out [B, L, HV, V], None)``."""
    _no_cache("gated delta rule", initial_state, output_final_state)
    B, L, H, Dk = key.shape
    HV, Dv = value.shape[-2:]
    q, k = query.reshape(B * L, H, Dk), key.reshape(B * L, H, Dk)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    v = value.reshape(B * L, HV, Dv).to(q.dtype)
    b, gg = beta.reshape(B * L, HV).to(q.dtype), g.reshape(B * L, HV).to(q.dtype)

    def heads(x):  # value head j reads q/k head j // (HV/H) (fla's kernels do this themselves)
        return x.repeat_interleave(HV // H, 1) if HV != H else x

    out = _scan(call, lambda: gdn_chunk(heads(q), heads(k), v, b, gg, Dk**-0.5),
                lambda layout, init: gdn_scan_fla(q, k, v, b, gg, layout, init, Dk**-0.5),
                1, B, L, (HV, Dk, Dv), (HV, Dv), q)
    return out.view(B, L, HV, Dv).to(query.dtype), None


def _kda(call: _Call, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
         use_qk_l2norm_in_kernel=False, **kwargs):
    """``chunk_kda`` / ``fused_recurrent_kda`` (Kimi Delta Attention): ``query/key [B, L, H, K]``,
    ``value [B, L, H, V]``, ``g [B, L, H, K]`` (per-channel log-decay), ``beta [B, L, H]`` ->
    ``(out [B, L, H, V], None)``."""
    _no_cache("kimi delta attention", initial_state, output_final_state)
    B, L, H, Dk = key.shape
    Dv = value.shape[-1]
    q, k = query.reshape(B * L, H, Dk), key.reshape(B * L, H, Dk)
    if use_qk_l2norm_in_kernel:  # (fla's form for KDA: x / sqrt(sum x^2 + eps))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    wd = q.dtype
    v, b, gg = value.reshape(B * L, H, Dv).to(wd), beta.reshape(B * L, H).to(wd), g.reshape(B * L, H, Dk).to(wd)
    out = _scan(call, lambda: kda_chunk(q, k, v, b, gg, Dk**-0.5),
                lambda layout, init: kda_scan_fla(q, k, v, b, gg, layout, init, Dk**-0.5),
                1, B, L, (H, Dk, Dv), (H, Dv), q)
    return out.view(B, L, H, Dv).to(query.dtype), None


def _ssd(call: _Call, hidden_states, dt, A, B, C, chunk_size=256, D=None, dt_bias=None, initial_states=None,
         dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
    """``mamba_chunk_scan_combined``: ``hidden_states [b, L, H, P]``, ``dt [b, L, H]``, ``A [H]``,
    ``B/C [b, L, G, N]``, ``D [H]`` or ``[H, P]``, ``z [b, L, H, P]`` -> ``[b, L, H, P]``."""
    _no_cache("mamba_chunk_scan_combined", initial_states, return_final_states)
    b, L, H, P = hidden_states.shape
    G, N = B.shape[2], B.shape[3]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    x = hidden_states.reshape(b * L, H, P)
    wd = torch.promote_types(x.dtype, dt.dtype)
    x = x.to(wd)
    Bg, Cg = B.reshape(b * L, G, N).to(wd), C.reshape(b * L, G, N).to(wd)
    d, Aw = dt.reshape(b * L, H).to(wd), A.to(wd)
    Dv = torch.zeros(H, dtype=wd, device=x.device) if D is None else D.to(wd)

    def heads(v):  # head h reads group h // (H/G) (mamba-ssm's kernel does this itself)
        return v.repeat_interleave(H // G, 1)

    y = _scan(call, lambda: ssd_chunk(x, d, Aw, heads(Bg), heads(Cg), Dv),
              lambda layout, init: ssd_scan_mamba(x, d, Aw, Bg, Cg, Dv, layout, init, chunk_size),
              1, b, L, (H, P, N), (H, P), x).view(b, L, H, P)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _unfused(call: _Call, *args, **kwargs):
    """``mamba_split_conv1d_scan_combined``: ``None``, as its torch fallback - the layer then runs
    its unfused path (convolution and scan through the kernels above)."""
    return None


def _decode_only(kind: str) -> Callable:
    def refuse(call: _Call, *args, **kwargs):
        raise RuntimeError(f"{kind} is a cached decode step; tree mode runs without a cache")

    return refuse


TREE_KERNELS: Dict[str, Callable] = {
    "causal_conv1d_fn": _conv,
    "causal_conv1d_update": _decode_only("causal_conv1d_update"),
    "chunk_gated_delta_rule": _gdn,
    "fused_recurrent_gated_delta_rule": _gdn,
    "mamba_chunk_scan_combined": _ssd,
    "mamba_split_conv1d_scan_combined": _unfused,
    "selective_state_update": _decode_only("selective_state_update"),
    "chunk_kda": _kda,
    "fused_recurrent_kda": _kda,
}


# -- interception -------------------------------------------------------------------------------------
def kernel_name(fn: Any) -> Optional[str]:
    """The kernel-hub name a transformers entry point was declared under, or None for anything else."""
    name = getattr(fn, "kernel_layer_name", None)  # the ``kernels`` package turns it into a layer
    if isinstance(name, str):
        return name
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or not hasattr(fn, "__wrapped__") or "func_name" not in code.co_freevars:
        return None
    value = _cell(cells[code.co_freevars.index("func_name")])
    return value if isinstance(value, str) else None


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _names(code: types.CodeType):
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _names(c)


def _inner(fn: Callable) -> Callable:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def kernel_calls(cls: type) -> Dict[str, str]:
    """Global name -> kernel name of the entry points ``cls.forward`` calls."""
    fwd = getattr(cls, "forward", None)
    inner = _inner(fwd) if fwd is not None else None
    if not isinstance(inner, types.FunctionType):
        return {}
    out = {}
    for n in set(_names(inner.__code__)):
        k = kernel_name(inner.__globals__.get(n))
        if k is not None:
            out[n] = k
    return out


def _copy(fn: types.FunctionType, globals_: dict, closure) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return new


def _rebind(fwd: Callable, replace: Dict[str, Callable]) -> Callable:
    """``fwd`` (a possibly decorated function) with its innermost function's globals ``replace``d;
    each decorator's wrapper is rebuilt around the new function (its closure cell swapped)."""
    chain = [fwd]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    inner = chain[-1]
    new = _copy(inner, {**inner.__globals__, **replace}, inner.__closure__)
    for wrapper, old in zip(reversed(chain[:-1]), reversed(chain[1:])):
        cells = wrapper.__closure__ or ()
        hits = [i for i, c in enumerate(cells) if _cell(c) is old]
        if not isinstance(wrapper, types.FunctionType) or len(hits) != 1:
            raise RuntimeError(f"cannot rebuild the decorator {wrapper!r} around {inner.__qualname__}")
        cells = tuple(types.CellType(new) if i == hits[0] else c for i, c in enumerate(cells))
        prev, new = new, _copy(wrapper, wrapper.__globals__, cells)
        new.__wrapped__ = prev
    return new


def _dispatcher(name: str, torch_fn: Callable) -> Callable:
    tree = TREE_KERNELS[name]
    params = inspect.signature(torch_fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def entry(*args, **kwargs):
        call = _CALL.get()
        if call is not None and call.ctx is not None:
            return tree(call, *args, **kwargs)
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return torch_fn(*args, **kwargs)  # transformers' own torch function (never fla)

    entry.__name__ = entry.__qualname__ = f"treelit_{name}"
    entry.__wrapped__ = torch_fn
    return entry


def _torch_only(torch_fn: Callable) -> Callable:
    params = inspect.signature(torch_fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def entry(*args, **kwargs):
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return torch_fn(*args, **kwargs)

    entry.__wrapped__ = torch_fn
    return entry


def _tree_forward(self, *args, **kwargs):
    call = _Call(kwargs.get("treelit_ctx"), self._treelit_layer, getattr(self, "_treelit_chunk_size", CHUNK_SIZE),
                 getattr(self, "_treelit_backend", "torch"))
    token = _CALL.set(call)
    try:
        return self._treelit_forward(self, *args, **kwargs)
    finally:
        _CALL.reset(token)


def _bind(model: nn.Module, make: Callable[[str, Callable], Callable], tree: bool) -> int:
    """Give every module of ``model`` that calls a kernel entry point its own rebound forward."""
    rebuilt: Dict[type, Callable] = {}
    n = 0
    for index, mod in enumerate(model.modules()):
        cls = type(mod)
        calls = kernel_calls(cls)
        if not calls:
            continue
        if cls not in rebuilt:
            unknown = sorted({k for k in calls.values() if k not in TREE_KERNELS})
            if tree and unknown:
                raise NotImplementedError(f"{cls.__name__} calls the kernel(s) {unknown}, which have no tree version")
            g = _inner(cls.forward).__globals__
            rebuilt[cls] = _rebind(cls.forward, {n_: make(k, _inner(g[n_])) for n_, k in calls.items()})
        mod._treelit_forward = rebuilt[cls]
        mod._treelit_kernels = frozenset(calls.values())  # (set_ssm_backend: which packages ssm=fla needs)
        layer = getattr(mod, "layer_idx", None)  # the key of its captured states (partitioning)
        mod._treelit_layer = int(layer) if layer is not None else -1 - index
        mod.forward = types.MethodType(_tree_forward, mod)
        n += 1
    return n


def bind_tree_kernels(model: nn.Module) -> int:
    """Route the kernel entry points of ``model``'s hybrid layers through treelit's tree versions
    (in place; other models and transformers' modules are untouched). Returns the number of
    layers bound. Raises ``NotImplementedError`` naming a kernel that has no tree version."""
    return _bind(model, _dispatcher, tree=True)


def bind_torch_kernels(model: nn.Module) -> int:
    """Route the kernel entry points of ``model``'s hybrid layers through transformers' own torch
    functions (``__wrapped__``), never fla / mamba-ssm: the reference for the tests, and a
    CPU-safe transformers model."""
    return _bind(model, lambda name, fn: _torch_only(fn), tree=False)
