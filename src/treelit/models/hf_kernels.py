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

**Interception.** For a model the adapter loads, every mixer instance whose ``forward`` reaches one of
these entry points gets its own copy of that ``forward``: the same code object (and the same
decorator chain, rebuilt around it) with a globals dict in which each entry point is replaced by
a dispatcher. Nothing in transformers' modules is changed; other models in the process, and the
class itself, keep the original functions. transformers is loaded with ``use_kernels=False``
(5.25 kernelizes by default when the ``kernels`` package is installed, which would fetch code from
the hub and drop the rebound forwards), and the adapter checks before each tree forward that the
rebound forwards are still in place.

**Recognition** (the rule that survives renames). An entry point is recognised by its *kernel-hub
name* - the name its decorator was given: ``func_name`` in the closure of
``use_kernel_func_from_hub_with_fallback``'s wrapper, or ``kernel_layer_name`` when the ``kernels``
package turned it into a layer - never by the Python name it is imported under (5.25 calls
``chunk_gated_delta_rule`` ``torch_chunk_gated_delta_rule``). Only globals the forward *loads* count
(bytecode ``LOAD_GLOBAL``; ``nn.functional.silu`` is not the global ``silu``). Every hub name
belongs to one table: ``TREE_KERNELS`` (sequence mixing with a tree version), ``WRAPPER_KERNELS``
(5.25's ``causal_conv1d_forward`` / ``mamba2_scan_forward``: cache plumbing around other entry
points - their torch body is followed and rebound the same way; one reaching no entry point is
refused), ``TOKENWISE_KERNELS`` (norms, activations, RoPE, MoE routers: tree-exact as they are, left
alone), ``MIXER_KERNELS`` (a whole mixer as a hub layer, used only by ``kernelize``) and
``NO_TREE_KERNELS`` (known sequence mixers without a tree version: refused). transformers' own
helper functions without a hub name (what ``causal_conv1d_forward`` is when ``kernels`` is not
installed) are followed the same way when they reach an entry point. A hub name in no table refuses
the model at load time, naming the layer, the kernel, the installed transformers and the releases
treelit was tested with (:data:`treelit.utils.versions.TESTED`); a test reads every hub name the
installed transformers declares and fails on an unclassified one
(``tests/models/test_hf_kernel_names.py``).

**Dispatch.** The instance's ``forward`` records which layer is running and the ``treelit_ctx``
keyword (the tree context the attention function also receives); the dispatcher then runs
treelit's tree version: the convolution reads each token's ancestors across segments
(:func:`treelit.ssm.layers.causal_conv`), the recurrences start every segment from its parent
segment's final state (:func:`treelit.ssm.scan.chunked_scan`, exact in the input precision, float32 for
bf16 / fp16 inputs as transformers' torch functions compute them), and
with partitioning the states and convolution contexts at partition boundaries are captured and
read back (named ``conv0``, ``state0``, ... per layer, in call order). They are read through the
context's hooks (``ctx.recurrent_conv_inputs``, ``ctx.recurrent_scan``), as treelit's native recurrent
layers read theirs, so context parallelism routes them between ranks the same way
(:mod:`treelit.partition.context_parallel`). Without a treelit context
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
import dis
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
from treelit.utils.versions import TESTED

__all__ = ["TREE_KERNELS", "WRAPPER_KERNELS", "TOKENWISE_KERNELS", "MIXER_KERNELS", "NO_TREE_KERNELS",
           "HYBRID_FAMILIES", "bind_tree_kernels", "bind_torch_kernels", "kernel_name", "kernel_class",
           "no_hub_kernels", "check_bound"]

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
    # the context's hook: its external input (partitioning), or the path's rows (context parallelism)
    given, contexts = call.ctx.recurrent_conv_inputs(call.layer, K, {name: x})
    x, context = given[name], contexts[name]
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
          like, graph):
    """Run the recurrence over the context's segments - ``ssm=torch``: the blocks of ``torch_chunk()``;
    ``ssm=fla``: ``fla_scan(layout, initial state)`` - and capture / read the boundary state. The
    initial state comes through the context's hook (``ctx.recurrent_scan``: the external state under
    this scan's name, or the states context parallelism routes between ranks); ``graph`` (see
    :func:`_graph`) is what the hook's exchange hangs on in the layer's autograd graph."""
    layout = call.ctx.recurrent_layout(K, B, L, like.device)
    name = call.name("state")

    def scan(init):
        if call.backend == "fla":
            return fla_scan(layout, init)
        return chunked_scan(torch_chunk(), layout, state_shape, out_shape, like, init, call.chunk_size)

    out, cap = call.ctx.recurrent_scan(call.layer, scan, state_shape, graph, name=name)
    if cap is not None:
        call.record(name, cap)
    return out


def _graph(dtype: torch.dtype, *inputs: torch.Tensor) -> torch.Tensor:
    """An empty tensor of the state's ``dtype`` downstream of every one of a scan's ``inputs`` (and so
    of the layer's convolutions), requiring grad when they do: the ``like`` of ``ctx.recurrent_scan``.
    Context parallelism receives the initial states in its dtype and sends their gradients back in
    a backward that must run before the backward of the convolutions' exchanges."""
    return torch.cat([x.reshape(-1)[:0].to(dtype) for x in inputs])


def _gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half inputs, else the input's: transformers computes the gates (``g``, ``dt`` with its
    bias / softplus / limits, ``A``) in float32 and its torch recurrences run in float32, and fla's and
    mamba-ssm's kernels accumulate them in float32; bf16 gates were measured up to 0.4% off (``g``),
    0.75% per token on average (``dt``) and 0.3% systematically per head (``A``)."""
    return torch.promote_types(dtype, torch.float32)


def _gdn(call: _Call, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
         use_qk_l2norm_in_kernel=False, **kwargs):
    """``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``: ``query/key [B, L, H, K]``,
    ``value [B, L, HV, V]``, ``g/beta [B, L, HV]`` -> ``(out [B, L, HV, V], None)``. ``g`` reaches both
    backends in float32 (at least); ``ssm=torch`` runs the recurrence in float32 too, as transformers'
    torch function does."""
    _no_cache("gated delta rule", initial_state, output_final_state)
    B, L, H, Dk = key.shape
    HV, Dv = value.shape[-2:]
    wd = _gate_dtype(query.dtype)
    q, k = query.reshape(B * L, H, Dk).to(wd), key.reshape(B * L, H, Dk).to(wd)
    if use_qk_l2norm_in_kernel:  # in float32 (at least), as transformers and fla normalise
        q, k = _l2norm(q), _l2norm(k)
    q, k = q.to(query.dtype), k.to(query.dtype)  # (no-ops unless half)
    v = value.reshape(B * L, HV, Dv).to(q.dtype)
    b, gg = beta.reshape(B * L, HV).to(q.dtype), g.reshape(B * L, HV).to(wd)

    def heads(x):  # value head j reads q/k head j // (HV/H) (fla's kernels do this themselves)
        return x.repeat_interleave(HV // H, 1) if HV != H else x

    out = _scan(call, lambda: gdn_chunk(heads(q.to(wd)), heads(k.to(wd)), v.to(wd), b.to(wd), gg, Dk**-0.5),
                lambda layout, init: gdn_scan_fla(q, k, v, b, gg, layout, init, Dk**-0.5),
                1, B, L, (HV, Dk, Dv), (HV, Dv), q.new_empty(0, dtype=wd), _graph(wd, q, k, v))
    return out.view(B, L, HV, Dv).to(query.dtype), None


def _kda(call: _Call, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
         use_qk_l2norm_in_kernel=False, **kwargs):
    """``chunk_kda`` / ``fused_recurrent_kda`` (Kimi Delta Attention): ``query/key [B, L, H, K]``,
    ``value [B, L, H, V]``, ``g [B, L, H, K]`` (per-channel log-decay), ``beta [B, L, H]`` ->
    ``(out [B, L, H, V], None)``."""
    _no_cache("kimi delta attention", initial_state, output_final_state)
    B, L, H, Dk = key.shape
    Dv = value.shape[-1]
    wd = _gate_dtype(query.dtype)
    q, k = query.reshape(B * L, H, Dk).to(wd), key.reshape(B * L, H, Dk).to(wd)
    if use_qk_l2norm_in_kernel:  # (fla's form for KDA: x / sqrt(sum x^2 + eps)), in float32 at least
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.to(query.dtype), k.to(query.dtype)  # (no-ops unless half)  # g in float32 for both backends; the torch recurrence in float32 (as _gdn)
    v, b, gg = value.reshape(B * L, H, Dv).to(q.dtype), beta.reshape(B * L, H).to(q.dtype), g.reshape(B * L, H, Dk).to(wd)
    out = _scan(call, lambda: kda_chunk(q.to(wd), k.to(wd), v.to(wd), b.to(wd), gg, Dk**-0.5),
                lambda layout, init: kda_scan_fla(q, k, v, b, gg, layout, init, Dk**-0.5),
                1, B, L, (H, Dk, Dv), (H, Dv), q.new_empty(0, dtype=wd), _graph(wd, q, k, v))
    return out.view(B, L, H, Dv).to(query.dtype), None


def _ssd(call: _Call, hidden_states, dt, A, B, C, chunk_size=256, D=None, dt_bias=None, initial_states=None,
         dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
    """``mamba_chunk_scan_combined``: ``hidden_states [b, L, H, P]``, ``dt [b, L, H]``, ``A [H]``,
    ``B/C [b, L, G, N]``, ``D [H]`` or ``[H, P]``, ``z [b, L, H, P]`` -> ``[b, L, H, P]``."""
    _no_cache("mamba_chunk_scan_combined", initial_states, return_final_states)
    b, L, H, P = hidden_states.shape
    G, N = B.shape[2], B.shape[3]
    out_dtype = torch.promote_types(hidden_states.dtype, dt.dtype)
    # dt's bias, softplus and limits and A in float32 (at least), as mamba-ssm computes them in its kernel
    gd = _gate_dtype(out_dtype)
    dt = dt.to(gd)
    if dt_bias is not None:
        dt = dt + dt_bias.to(gd)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    x = hidden_states.reshape(b * L, H, P)
    wd = torch.promote_types(x.dtype, B.dtype)  # x, B, C as they come (the kernel reads them so)
    x = x.to(wd)
    Bg, Cg = B.reshape(b * L, G, N).to(wd), C.reshape(b * L, G, N).to(wd)
    d, Aw = dt.reshape(b * L, H), A.to(gd)
    Dv = torch.zeros(H, dtype=gd, device=x.device) if D is None else D.to(gd)

    def heads(v):  # head h reads group h // (H/G) (mamba-ssm's kernel does this itself)
        return v.repeat_interleave(H // G, 1)

    y = _scan(call, lambda: ssd_chunk(x.to(gd), d, Aw, heads(Bg).to(gd), heads(Cg).to(gd), Dv),
              lambda layout, init: ssd_scan_mamba(x, d, Aw, Bg, Cg, Dv, layout, init, chunk_size),
              1, b, L, (H, P, N), (H, P), x.new_empty(0, dtype=gd), _graph(gd, x, Bg, Cg)).view(b, L, H, P)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y.to(out_dtype)


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


# -- recognition ----------------------------------------------------------------------------------------
# Every kernel-hub name transformers declares (``use_kernel_func_from_hub_with_fallback(NAME, ...)``,
# ``use_kernel_forward_from_hub(NAME)``) belongs to exactly one of these classes. A name in none of them
# refuses the model (tree mode) naming the kernel, the transformers release and the tested releases;
# tests/models/test_hf_kernel_names.py fails when an installed transformers declares one.
#
# wrappers: hub functions whose torch body reads / writes the cache and calls other entry points
# (transformers 5.25 put the convolution and the Mamba scans behind these). Their torch body is
# followed and rebound like the mixer's forward; one that calls no entry point is refused, since it
# would then mix the DFS row as a sequence.
WRAPPER_KERNELS = frozenset({"causal_conv1d_forward", "mamba2_scan_forward", "mamba_scan_forward"})
# token-wise: each output token depends on that token alone (norms, activations, RoPE at depth
# positions, MoE routers and experts) - tree-exact as they are, left untouched
TOKENWISE_KERNELS = frozenset({
    "RMSNorm", "RMSNormGated", "RMSNormZeroCentered", "rotary_pos_emb",
    "SiLU", "GeLU", "GeluTanh", "FastGELU", "QuickGELU", "NewGELU",
    "SoftmaxTopKRouter", "MegaBlocksMoeMLP", "Llama4TextMoe",
})
# whole mixers as hub layers: replaced only by ``kernelize()`` (``use_kernels=True``), which the adapter
# never calls; treelit binds the entry points inside them
MIXER_KERNELS = frozenset({"Qwen3_5GatedDeltaNet"})
# known and sequence-mixing, with no tree version: a model calling one is refused
NO_TREE_KERNELS = {
    "selective_scan_fn": "Mamba-1's selective scan",
    "mamba_inner_fn": "Mamba-1's fused inner block",
    "MultiScaleDeformableAttention": "a vision kernel",
    "EsmFold2TriangleMultiplication": "a protein-folding kernel",
}


def kernel_class(name: str) -> Optional[str]:
    """``'tree' | 'wrapper' | 'tokenwise' | 'mixer' | 'no_tree'`` for a kernel-hub name, or None
    for a name treelit does not know."""
    if name in TREE_KERNELS:
        return "tree"
    for cls, names in (("wrapper", WRAPPER_KERNELS), ("tokenwise", TOKENWISE_KERNELS), ("mixer", MIXER_KERNELS),
                       ("no_tree", NO_TREE_KERNELS)):
        if name in names:
            return cls
    return None


def _versions() -> str:
    try:
        import transformers  # optional, heavy: only in transformers models
        ver = transformers.__version__
    except ImportError:  # pragma: no cover - the adapter needs it
        ver = "?"
    return f"transformers {ver}; treelit is tested with transformers {', '.join(TESTED['transformers'])}"


def _refusal(owner: str, name: str) -> str:
    kind = kernel_class(name)
    if kind == "no_tree":
        why = f"{NO_TREE_KERNELS[name]}, which has no tree version"
    elif kind == "wrapper":
        why = "a cache wrapper whose torch code calls no kernel treelit can replace (it would mix the DFS row " \
              "as one sequence)"
    else:
        why = "a kernel treelit does not know, so it cannot tell whether it mixes tokens along the sequence"
    return f"{owner} calls the kernel {name!r}: {why} ({_versions()})"


# -- interception -------------------------------------------------------------------------------------
def kernel_name(fn: Any) -> Optional[str]:
    """The kernel-hub name a transformers entry point was declared under, or None for anything else:
    ``func_name`` in the closure of ``use_kernel_func_from_hub_with_fallback``'s wrapper, or the
    ``kernel_layer_name`` of the layer the ``kernels`` package made of it (a function turned into a
    module instance, or a module class / instance)."""
    name = getattr(fn, "kernel_layer_name", None)
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


def _global_loads(code: types.CodeType):
    """The global names ``code`` (and the functions nested in it) loads - not attribute names, so
    ``nn.functional.silu`` is not the global ``silu``."""
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield ins.argval
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _global_loads(c)


def _inner(fn: Callable) -> Callable:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _torch_function(obj: Any) -> Any:
    """The plain torch function behind an entry point: through the ``kernels`` package's function
    layer (its forward's closure cell ``func``) and every ``__wrapped__``."""
    fwd = getattr(type(obj), "forward", None) if isinstance(obj, nn.Module) else None
    code = getattr(fwd, "__code__", None)
    if code is not None and "func" in code.co_freevars and fwd.__closure__:
        obj = _cell(fwd.__closure__[code.co_freevars.index("func")])
    return _inner(obj)


def _is_helper(obj: Any) -> bool:
    """A plain module-level function of transformers' own code (followed for entry points it calls)."""
    return isinstance(obj, types.FunctionType) and (obj.__module__ or "").startswith("transformers.")


@dataclass
class _Plan:
    """What one function's globals become: ``replace`` (global name -> replacement), the kernel names
    reached (directly or through wrappers / helpers) and the refusals met on the way."""

    replace: Dict[str, Callable] = field(default_factory=dict)
    kernels: set = field(default_factory=set)
    refusals: list = field(default_factory=list)
    forward: Optional[Callable] = None  # the class's forward, rebound (set by _bind)


def _plan(fn: types.FunctionType, owner: str, make: Callable[[str, Callable], Callable],
          seen: Optional[set] = None) -> _Plan:
    """Walk the globals ``fn`` calls: entry points with a tree version get ``make(name, torch fn)``;
    wrappers and transformers' helper functions that reach entry points get a rebound copy of their
    torch body (the same walk, one level down); token-wise and mixer hub layers stay; anything
    else with a hub name is a refusal."""
    seen = set() if seen is None else seen
    plan = _Plan()
    if fn.__code__ in seen:
        return plan
    seen.add(fn.__code__)
    for n in sorted(set(_global_loads(fn.__code__))):
        obj = fn.__globals__.get(n)
        name = kernel_name(obj)
        kind = kernel_class(name) if name is not None else None
        if name is not None and kind in ("tokenwise", "mixer"):
            continue
        if kind == "tree":
            plan.replace[n] = make(name, _torch_function(obj))
            plan.kernels.add(name)
        elif kind == "wrapper" or (name is None and _is_helper(obj)):
            body = _torch_function(obj)
            if not isinstance(body, types.FunctionType):
                plan.refusals.append(_refusal(owner, name or n))
                continue
            sub = _plan(body, owner, make, seen)
            plan.refusals += sub.refusals
            if sub.replace:
                plan.replace[n] = _rebind(body, sub.replace)
                plan.kernels |= sub.kernels | ({name} if name else set())
            elif kind == "wrapper":
                plan.refusals.append(_refusal(owner, name))
        elif name is not None:
            plan.refusals.append(_refusal(owner, name))
    return plan


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
    """Give every module of ``model`` whose forward reaches a kernel entry point its own rebound forward."""
    rebuilt: Dict[type, Optional[_Plan]] = {}
    n = 0
    for index, mod in enumerate(model.modules()):
        cls = type(mod)
        if cls not in rebuilt:
            inner = _inner(cls.forward) if hasattr(cls, "forward") else None
            if not isinstance(inner, types.FunctionType) or not (inner.__module__ or "").startswith("transformers."):
                rebuilt[cls] = None
                continue
            plan = _plan(inner, cls.__name__, make)
            if tree and plan.refusals:
                raise NotImplementedError("; ".join(dict.fromkeys(plan.refusals)))
            if plan.replace:
                plan.forward = _rebind(cls.forward, plan.replace)
            rebuilt[cls] = plan if plan.replace else None
        plan = rebuilt[cls]
        if plan is None:
            continue
        mod._treelit_forward = plan.forward
        mod._treelit_kernels = frozenset(plan.kernels)  # (set_ssm_backend: which packages ssm=fla needs)
        layer = getattr(mod, "layer_idx", None)  # the key of its captured states (partitioning)
        mod._treelit_layer = int(layer) if layer is not None else -1 - index
        mod.forward = types.MethodType(_tree_forward, mod)
        n += 1
    return n


def no_hub_kernels() -> Dict[str, Any]:
    """``from_pretrained`` keywords that keep transformers from kernelizing the model: transformers 5.25
    defaults to ``use_kernels=True`` when the ``kernels`` package is installed, which fetches code
    from the hub (a checkpoint's loading must not run outside code) and may swap whole mixers for
    layers that know nothing of trees; ``train()`` / ``eval()`` then kernelize again and drop the
    rebound forwards."""
    from transformers import PreTrainedModel  # optional, heavy: in transformers models only

    return {"use_kernels": False} if hasattr(PreTrainedModel, "set_use_kernels") else {}


def check_bound(layers) -> None:
    """Raise if a hybrid layer :func:`bind_tree_kernels` bound (``layers``: those modules) has lost its
    rebound forward (e.g. a later ``model.use_kernels = True`` kernelized it): its original forward would
    mix the tree's DFS row as one sequence."""
    for mod in layers:
        if "forward" not in vars(mod):
            raise RuntimeError(f"{type(mod).__name__} (layer {mod._treelit_layer}) no longer runs treelit's tree "
                               "kernels: its forward was replaced after loading (kernelize / use_kernels=True?); "
                               "load the model again without hub kernels")


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
