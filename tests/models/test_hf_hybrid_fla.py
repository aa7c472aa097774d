"""``ssm=fla`` for transformers' hybrid layers: fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` and
mamba-ssm's ``mamba_chunk_scan_combined``, one call per depth level with per-segment initial states
(treelit.ssm.fla_backend), against the exact ``ssm=torch`` backend of the same model.

On CPU the CUDA kernels are replaced by stand-ins with their signature and contract (varlen
``cu_seqlens`` with ``initial_state [N, ...]`` for fla; batch rows with ``initial_states [b, ...]``
for mamba-ssm; final states returned), written here as the plain per-token recurrence in the input
precision. With them the ``fla`` routing - level packing, parents' final states as initial states,
grouped value heads / B-C groups, mamba's padding with ``dt = 0``, states relayed across partitions -
must reproduce the torch backend to float64 rounding, loss and every parameter gradient. The real
kernels are compared on CUDA only (``cuda`` marker; benchmarks/gpu_check.py does the same at size).
"""

from __future__ import annotations

import sys

import pytest
import numpy as np
import torch

import treelit
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from hf_oracle import random_hf_checkpoint
from test_hf_hybrid import HYBRID
from treelit.ssm import fla_backend, set_ssm_backend

pytest.importorskip("transformers")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# grouped value heads (4 value heads read 2 q/k heads), Mamba2 with 2 B/C groups, KDA, a router loss
FAMILIES = {f: HYBRID[f] for f in ("qwen3_5", "qwen3_next", "kimi_linear", "nemotron_h")}
# two roots, depth up to 4 segments, one-token segments ([4], [6], [1], [2], ...), and levels whose
# segments range from 1 to 10 tokens: several of mamba's length classes in one level, and padded
# rows ([9, 8, 7] beside [4, 5, 6, 7]) whose final state starts their children
BRANCHES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 2],
            [1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1], [1, 2, 3, 4, 5, 6, 7, 4], [1, 2, 3, 9, 8, 7, 6],
            [1, 2, 3, 9, 8, 7, 5, 4, 3, 2, 1, 2, 3, 4, 5], [1, 2, 3, 9, 8, 7, 5, 4, 3, 2, 1, 2, 3, 4, 6],
            [4, 5, 6, 7, 8], [4, 5, 1]]
MASKS = [[1] * len(b) for b in BRANCHES]
MASKS[2][:9] = [0] * 9
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 0.7, 1.0, 1.3]
BUDGETS = (None, 17, 20)  # (the longest branch has 17 tokens: partitions cut inside segments)


# -- stand-ins of the CUDA kernels (their signatures and contracts; the plain recurrence) ------------
CALLS = []


def _delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                per_channel=False, **kwargs):
    """fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` contract: ``q/k [1, T, H, K]``, ``v [1, T, HV, V]``,
    ``g [1, T, HV]`` (KDA: ``[1, T, HV, K]``), ``beta [1, T, HV]``, ``initial_state [N, HV, K, V]`` for
    the N sequences of ``cu_seqlens`` -> ``(o [1, T, HV, V], final [N, HV, K, V])``."""
    assert q.shape[0] == 1 and cu_seqlens is not None and output_final_state
    assert initial_state.shape == (len(cu_seqlens) - 1, v.shape[2], q.shape[3], v.shape[3])
    assert not any(kwargs.get(o) for o in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                           "use_beta_sigmoid_in_kernel"))  # (prepared by the tree layer)
    CALLS.append(("kda" if per_channel else "gdn", [int(c) for c in cu_seqlens]))
    r = v.shape[2] // q.shape[2]  # value head j reads q/k head j // r
    q, k, v, g, beta = q[0].repeat_interleave(r, 1), k[0].repeat_interleave(r, 1), v[0], g[0], beta[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, finals = [], []
    for i in range(len(cu_seqlens) - 1):
        S = initial_state[i].to(v.dtype)
        for t in range(int(cu_seqlens[i]), int(cu_seqlens[i + 1])):
            S = S * (g[t].exp()[..., None] if per_channel else g[t].exp()[:, None, None])
            u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
            S = S + k[t][:, :, None] * u[:, None, :]
            out.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
        finals.append(S)
    return torch.stack(out)[None], torch.stack(finals)


def _kda(*args, **kwargs):
    return _delta_rule(*args, per_channel=True, **kwargs)


def _mamba(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
           cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
           return_varlen_states=False):
    """mamba-ssm's ``mamba_chunk_scan_combined`` contract: ``x [b, L, H, P]``, ``dt [b, L, H]``, ``A [H]``,
    ``B/C [b, L, G, N]`` (head h reads group h // (H/G)), ``initial_states [b, H, P, N]`` per batch
    row -> ``y [b, L, H, P]`` and, with ``return_final_states``, ``final [b, H, P, N]``."""
    assert seq_idx is None and not return_varlen_states and isinstance(chunk_size, int)
    CALLS.append(("mamba", list(x.shape[:2])))
    b, L, H, P = x.shape
    r = H // B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = dt.clamp(*dt_limit)
    h = x.new_zeros(b, H, P, B.shape[3]) if initial_states is None else initial_states.to(x.dtype)
    ys = []
    for t in range(L):
        Bt, Ct = B[:, t].repeat_interleave(r, 1), C[:, t].repeat_interleave(r, 1)  # [b, H, N]
        h = h * (dt[:, t] * A).exp()[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None]
        y = torch.einsum("bhpn,bhn->bhp", h, Ct)
        ys.append(y if D is None else y + (D[:, None] if D.dim() == 1 else D) * x[:, t])
    y = torch.stack(ys, 1)
    if z is not None:
        y = y * torch.nn.functional.silu(z)
    return (y, h) if return_final_states else y


STANDINS = {"chunk_gated_delta_rule": _delta_rule, "chunk_kda": _kda, "mamba_chunk_scan_combined": _mamba}


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(fla_backend, "cuda_kernel", lambda name: STANDINS[name])
    CALLS.clear()
    yield CALLS


def select_fla_on_cpu(model, monkeypatch):
    """``set_ssm_backend(model, "fla")`` as on a CUDA machine (its CUDA check passed)."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        set_ssm_backend(model, "fla")


_MODELS = {}


def adapted(family, dtype, tmp_path_factory, **overrides):
    key = (family, dtype, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        path = tmp_path_factory.mktemp(family)
        model_type, cfg = FAMILIES[family]
        random_hf_checkpoint(path, model_type, **{**cfg, **overrides})
        _MODELS[key] = treelit.load_hf_model(path, dtype=dtype)
    return _MODELS[key]


def loss_and_grads(model, batch, budget):
    model.zero_grad(set_to_none=True)
    if budget is None:
        loss = treelit.tree_loss(model, batch, "token-mean", "sdpa_dense")
        loss.backward()
        value = loss.item()
    else:
        value = treelit.tree_backward(model, batch, "token-mean", "redundancy_free", budget, attention="sdpa_dense")
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value, grads


def _levels(batch) -> int:
    parent = batch.seg_parent.tolist()
    depth = []
    for p in parent:
        depth.append(0 if p < 0 else depth[p] + 1)
    return max(depth) + 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fla_routing_equals_the_torch_backend(family, standins, monkeypatch, tmp_path_factory):
    """float64 with float64 stand-ins: ``ssm=fla`` equals ``ssm=torch`` to 1e-10 (loss and every
    parameter gradient), unpartitioned and partitioned; GDN / KDA make one varlen call per depth
    level and layer, mamba-ssm at most one per length class and level."""
    model = adapted(family, torch.float64, tmp_path_factory)
    batch = treelit.TokenTree.from_branches(BRANCHES, MASKS, WEIGHTS).to_batch()
    kinds = {k for m in model.modules() for k in getattr(m, "_treelit_kernels", ())}
    try:
        for budget in BUDGETS:
            results = {}
            for backend in ("torch", "fla"):
                if backend == "fla":
                    select_fla_on_cpu(model, monkeypatch)
                else:
                    set_ssm_backend(model, "torch")
                standins.clear()
                with KeepFloat64():
                    results[backend] = loss_and_grads(model, batch, budget)
                if backend == "torch":
                    assert standins == []  # ssm=torch never reaches the CUDA kernels
            what = f"{family}/budget={budget}"
            (ref, g_ref), (got, g_got) = results["torch"], results["fla"]
            assert abs(got - ref) <= 1e-10 * abs(ref), (what, got, ref)
            assert g_got.keys() == g_ref.keys()
            err = max_rel_grad_diff(g_got, g_ref, grad_floor(torch.float64), negligible_grad(torch.float64))
            assert err <= 1e-10, f"{what}: max relative gradient difference {err:.2e}"
            layers = sum(1 for m in model.modules() if getattr(m, "_treelit_kernels", None) and
                         {"chunk_gated_delta_rule", "chunk_kda", "mamba_chunk_scan_combined"} & m._treelit_kernels)
            assert layers > 0 and standins, what
            if budget is None:  # one forward pass (partitions re-run forwards; the layout differs)
                if kinds & {"chunk_gated_delta_rule", "chunk_kda"}:
                    assert len(standins) == layers * _levels(batch), (what, standins)
                    assert sum(cu[-1] for _, cu in standins) == layers * batch.num_tokens  # every token once
                else:  # several length classes per level: more calls than levels, padded rows
                    assert layers * _levels(batch) < len(standins), (what, standins)
    finally:
        set_ssm_backend(model, "torch")


def _ssd_case(seed: int):
    """A Mamba2 scan's inputs over the BRANCHES tree (float64): ``(H, P, G, N)``, ``(x, dt, A, B, C, D,
    initial state)`` and its layout, with the states captured at three segment ends."""
    from treelit.ssm.layout import tree_layout

    batch = treelit.TokenTree.from_branches(BRANCHES).to_batch()
    T, H, P, G, N = batch.num_tokens, 4, 3, 2, 5
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=gen, dtype=torch.float64)
    dt = torch.rand(T, H, generator=gen, dtype=torch.float64)
    A, D = -torch.rand(H, generator=gen, dtype=torch.float64) - 0.1, torch.randn(H, generator=gen, dtype=torch.float64)
    B, C = (torch.randn(T, G, N, generator=gen, dtype=torch.float64) for _ in range(2))
    init = torch.randn(H, P, N, generator=gen, dtype=torch.float64)
    layout = tree_layout(batch, 1, external=True, capture=torch.tensor([6, 25, T - 1]).numpy())  # (segment ends)
    return (H, P, G, N), (x, dt, A, B, C, D, init), layout


def test_fla_padding_keeps_each_segments_final_state(standins):
    """mamba's batch rows padded with ``dt = 0``: outputs and the states captured at segment ends
    equal the exact torch scan (float64), with their input gradients, on a level of 1- to
    10-token segments whose initial states come from their parents and from outside."""
    from treelit.ssm.scan import chunked_scan, ssd_chunk

    (H, P, G, N), (x, dt, A, B, C, D, init), layout = _ssd_case(seed=0)
    results = []
    for fla in (False, True):
        xs = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, init)]
        if fla:
            out, cap = fla_backend.ssd_scan_mamba(*xs[:6], layout, xs[6], chunk_size=4)
        else:
            heads = [t.repeat_interleave(H // G, 1) for t in xs[3:5]]
            out, cap = chunked_scan(ssd_chunk(xs[0], xs[1], xs[2], *heads, xs[5]), layout, (H, P, N), (H, P),
                                    xs[0], xs[6], 3)
        (out.sin().sum() + cap.cos().sum()).backward()
        results.append([out, cap] + [t.grad for t in xs])
    assert any(n > 1 for kind, (n, _) in standins)  # padded rows ran together
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_fla_selection_on_hybrid_layers(monkeypatch, tmp_path_factory):
    """``ssm=fla`` is refused without CUDA (as for native models); with CUDA it needs the kernels'
    packages - a missing mamba-ssm is one line naming it - and then reaches every hybrid layer;
    ``ssm=torch`` sets them back."""
    qwen = adapted("qwen3_5", torch.float64, tmp_path_factory)
    nemotron = adapted("nemotron_h", torch.float64, tmp_path_factory)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ssm=fla needs CUDA"):
            set_ssm_backend(qwen, "fla")
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # as where it is not installed
    with pytest.raises(ValueError, match=r"ssm=fla needs mamba-ssm for mamba_chunk_scan_combined .*treelit\[cuda\]"):
        select_fla_on_cpu(nemotron, monkeypatch)
    fla_module = sys.modules.get("fla")
    monkeypatch.setitem(sys.modules, "fla", None)  # a Mamba2-only hybrid needs mamba-ssm, not fla
    with pytest.raises(ValueError, match=r"ssm=fla needs mamba-ssm for mamba_chunk_scan_combined"):
        select_fla_on_cpu(nemotron, monkeypatch)
    with pytest.raises(ValueError, match=r"ssm=fla needs flash-linear-attention"):
        select_fla_on_cpu(qwen, monkeypatch)
    monkeypatch.setitem(sys.modules, "fla", fla_module)
    # (a layer never set runs the torch default: _tree_forward's getattr)
    assert {getattr(m, "_treelit_backend", "torch") for m in nemotron.modules() if hasattr(m, "_treelit_kernels")} \
        == {"torch"}
    try:
        select_fla_on_cpu(qwen, monkeypatch)  # fla imports on CPU; its kernels are not called here
        bound = [m for m in qwen.modules() if hasattr(m, "_treelit_kernels")]
        assert bound and all(m._treelit_backend == "fla" for m in bound)
    finally:
        set_ssm_backend(qwen, "torch")
    assert all(m._treelit_backend == "torch" for m in bound)


# head and state sizes of at least 16 for the Triton kernels' matrix blocks
CUDA_SIZES = {"qwen3_5": dict(linear_key_head_dim=32, linear_value_head_dim=32),
              "qwen3_next": dict(linear_key_head_dim=32, linear_value_head_dim=32),
              "kimi_linear": dict(linear_head_dim=32),
              "nemotron_h": dict(mamba_head_dim=16, ssm_state_size=16, chunk_size=16)}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_kernels_match_the_torch_backend(family, tmp_path_factory):
    """fla's and mamba-ssm's kernels (float32, CUDA) against the torch backend: loss 1e-4, every
    gradient 1e-3 relative, unpartitioned and partitioned."""
    model = adapted(family, torch.float32, tmp_path_factory, **CUDA_SIZES[family]).cuda()
    batch = treelit.TokenTree.from_branches(BRANCHES, MASKS, WEIGHTS).to_batch().to("cuda")
    try:
        for budget in BUDGETS:
            results = {}
            for backend in ("torch", "fla"):
                set_ssm_backend(model, backend)
                results[backend] = loss_and_grads(model, batch, budget)
            (ref, g_ref), (got, g_got) = results["torch"], results["fla"]
            assert abs(got - ref) <= 1e-4 * abs(ref), (family, budget, got, ref)
            err = max_rel_grad_diff(g_got, g_ref, grad_floor(torch.float32), negligible_grad(torch.float32))
            assert err <= 1e-3, f"{family}/budget={budget}: max relative gradient difference {err:.2e}"
    finally:
        set_ssm_backend(model, "torch")


@pytest.mark.parametrize("limit", ["grid", "elements"])
def test_mamba_calls_split_below_the_launch_limits_and_stay_exact(standins, monkeypatch, limit):
    """A level's padded rows go to mamba-ssm in several calls when one call would pass its grid limit
    (batch x chunks on grid axis 1) or its int32 offsets (elements of a tensor): tested with the limits
    lowered, outputs, captured states and every input gradient equal the one-call run (float64)."""
    (H, P, G, N), (x, dt, A, B, C, D, init), layout = _ssd_case(seed=1)

    def run():
        standins.clear()
        xs = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, init)]
        out, cap = fla_backend.ssd_scan_mamba(*xs[:6], layout, xs[6], chunk_size=4)
        (out.sin().sum() + cap.cos().sum()).backward()
        return [out, cap] + [t.grad for t in xs], [shape for kind, shape in standins if kind == "mamba"]

    whole, calls_whole = run()
    assert max(b for b, _ in calls_whole) > 2  # some level ran several padded rows in one call

    def chunks(L):
        return -(-L // 4)

    def per_row(L):
        return max(L * H * P, L * G * N, chunks(L) * H * P * N)

    # the lowest limits every single row fits under; some call of the whole run is above them
    if limit == "grid":
        low = max(chunks(L) for _, L in calls_whole)
        assert any(b * chunks(L) > low for b, L in calls_whole)
        monkeypatch.setattr(fla_backend, "MAMBA_MAX_GRID_ROWS", low)
    else:
        low = max(per_row(L) for _, L in calls_whole)
        assert any(b * per_row(L) > low for b, L in calls_whole)
        monkeypatch.setattr(fla_backend, "MAMBA_MAX_ELEMENTS", low)
    split, calls_split = run()
    assert len(calls_split) > len(calls_whole)
    for b, L in calls_split:
        assert b * chunks(L) <= fla_backend.MAMBA_MAX_GRID_ROWS
        assert b * per_row(L) <= fla_backend.MAMBA_MAX_ELEMENTS
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_a_segment_too_long_for_one_mamba_call_is_refused(standins, monkeypatch):
    monkeypatch.setattr(fla_backend, "MAMBA_MAX_ELEMENTS", 10)
    with pytest.raises(ValueError, match="too long for one mamba-ssm call"):
        fla_backend._mamba_calls(np.arange(3), 8, 4, 4, 3, 2, 5)
