"""Independent oracles for the recurrent layers: outputs and every gradient, float64, 1e-10.

A treelit mixer runs once over a tree (its recurrence in blocks of ``chunk`` tokens; 1 is
the step-by-step scan). Each reference runs every branch on its own, with code that has
no treelit in it, on the same parameters (every one cast to float64, ``A_log`` included):

* Gated DeltaNet: fla's ``naive_recurrent_gated_delta_rule`` and
  ``naive_chunk_gated_delta_rule``; and a plain scan from the definition,
  ``S_t = exp(g_t) S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T``, ``o_t = S_t q_t / sqrt(K)``.
  Projections, short convolutions, L2 norms, gates and the output norm are written here
  from fla's layer definition.
* Mamba2: fla's own ``Mamba2`` layer, its pure-torch path (``torch_forward``: the SSD
  chunked form, in chunks of 4 tokens; its Triton SiLU and gated norm replaced by
  ``F.silu`` and fla's own ``rms_norm_ref``, which run on CPU), with one
  B/C group (where fla's prefill and its kernels agree on the grouping); and a plain scan
  from the definition, ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``,
  ``y_t = C_t h_t + D x_t``, with two groups (head h reads group h // (H/G)).

fla casts its inputs to float32 (``.to(torch.float32)``, ``.float()``);
:func:`fla_in_float64` makes those casts keep float64 while a reference runs (test-only),
so the comparison is exact to rounding. The loss is ``sum_t probe_t . out_t`` over tree
tokens; per branch, a token's term is divided by the number of branches through it, so
both sides have the same value and the same gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings

import treelit
from helpers import max_rel_grad_diff, randomize_
from strategies import examples, forests
from treelit.attention import get_backend
from treelit.models.context import TreeContext
from treelit.ssm.layers import GatedDeltaNet, Mamba2

fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule.naive")

TOL = 1e-10
# A gradient at or below 1e-4 of the largest one counts as mathematically zero and may differ by
# 1e-4 x TOL x scale = 1e-14 x scale (~45 eps; 5 eps of rounding was measured on q/k of a query
# that sees a single key); every larger gradient is held to TOL relative to its own norm.
FLOOR = 1e-4
D_MODEL, VOCAB = 16, 12
GDN = dict(hidden_size=D_MODEL, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2.0, conv_size=3)
MAMBA = {
    "groups2": dict(hidden_size=D_MODEL, head_dim=8, state_size=4, expand=2, n_groups=2, conv_kernel=3, D_has_hdim=True),
    "groups1": dict(hidden_size=D_MODEL, head_dim=8, state_size=4, expand=2, n_groups=1, conv_kernel=3, D_has_hdim=False),
}
FIXED = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 10], [1, 2, 8, 9, 10, 11, 3], [1, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9], [5]]


@contextlib.contextmanager
def fla_in_float64():
    """While active, ``Tensor.to(torch.float32)`` and ``Tensor.float()`` leave float64 tensors
    in float64 (fla's reference code casts its inputs to float32)."""
    own = {n: n in torch.Tensor.__dict__ for n in ("to", "float")}
    orig_to, orig_float = torch.Tensor.to, torch.Tensor.float

    def to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return orig_to(self, *args, **kwargs)

    def flt(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else orig_float(self, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.float = to, flt
    try:
        yield
    finally:
        for name, orig in (("to", orig_to), ("float", orig_float)):
            if own[name]:
                setattr(torch.Tensor, name, orig)
            else:
                delattr(torch.Tensor, name)


def float64_mixer(cls, cfg, seed):
    torch.manual_seed(seed)
    mixer = randomize_(cls(**cfg), seed=seed, std=0.4)
    for p in mixer.parameters():  # every parameter, A_log included
        p.data = p.data.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in mixer.parameters())
    return mixer


def causal_conv(x, weight, bias=None):
    """Depthwise causal convolution of ``x [T, C]`` with ``weight [C, 1, K]``, then SiLU."""
    K = weight.shape[-1]
    return F.silu(F.conv1d(F.pad(x.T[None], (K - 1, 0)), weight, bias, groups=x.shape[1])[0].T)


# --- Gated DeltaNet -----------------------------------------------------------------------


def gdn_inputs(m: GatedDeltaNet, x):
    """q, k [T, HV, K] (L2-normalised, value head i reading q/k head i // (HV/H)), v [T, HV, V],
    beta, g [T, HV], from the layer definition."""
    T = x.shape[0]
    q = causal_conv(m.q_proj(x), m.q_conv1d.weight).view(T, m.H, m.dk)
    k = causal_conv(m.k_proj(x), m.k_conv1d.weight).view(T, m.H, m.dk)
    v = causal_conv(m.v_proj(x), m.v_conv1d.weight).view(T, m.HV, m.dv)
    l2 = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    rep = m.HV // m.H
    q, k = l2(q).repeat_interleave(rep, 1), l2(k).repeat_interleave(rep, 1)
    beta = torch.sigmoid(m.b_proj(x))
    g = -m.A_log.exp() * F.softplus(m.a_proj(x) + m.dt_bias)
    return q, k, v, beta, g


def gdn_output(m: GatedDeltaNet, x, o):
    """Per-head RMSNorm of the recurrence output ``o [T, HV, V]``, swish gate, projection."""
    T = x.shape[0]
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm_eps) * m.o_norm.weight
    y = y * F.silu(m.g_proj(x).view(T, m.HV, m.dv))
    return m.o_proj(y.reshape(T, m.value_dim))


def gdn_plain_scan(q, k, v, beta, g):
    T, HV, K = q.shape
    S = q.new_zeros(HV, v.shape[-1], K)  # [V, K] per head
    eye = torch.eye(K, dtype=q.dtype)
    out = []
    for t in range(T):
        kt, bt = k[t], beta[t][:, None, None]
        decay = torch.exp(g[t])[:, None, None]
        S = decay * S @ (eye - bt * kt[:, :, None] * kt[:, None, :]) + bt * v[t][:, :, None] * kt[:, None, :]
        out.append(S @ (q[t] * K**-0.5)[:, :, None])
    return torch.stack(out)[..., 0]


def gdn_reference(kind):
    def run(m, x):
        q, k, v, beta, g = gdn_inputs(m, x)
        if kind == "plain_scan":
            o = gdn_plain_scan(q, k, v, beta, g)
        else:
            with fla_in_float64():
                if kind == "fla_naive_recurrent":
                    o, _ = fla_gdn.naive_recurrent_gated_delta_rule(q[None], k[None], v[None], beta[None], g[None])
                else:
                    o, _ = fla_gdn.naive_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=4)
            o = o[0]
        assert o.dtype == torch.float64
        return gdn_output(m, x, o)

    return run


# --- Mamba2 -------------------------------------------------------------------------------


def mamba_plain_scan(m: Mamba2, x):
    T = x.shape[0]
    H, P, N, G, I = m.H, m.P, m.N, m.G, m.I
    z, xBC, dt = torch.split(m.in_proj(x), [I, m.conv_dim, H], -1)
    xBC = causal_conv(xBC, m.conv1d.weight, m.conv1d.bias)
    xs, Bm, Cm = torch.split(xBC, [I, G * N, G * N], -1)
    xs, Bm, Cm = xs.view(T, H, P), Bm.view(T, G, N), Cm.view(T, G, N)
    dt = F.softplus(dt + m.dt_bias)
    A = -m.A_log.exp()
    D = m.D.view(H, P) if m.D_has_hdim else m.D[:, None]
    grp = [h // (H // G) for h in range(H)]
    h = x.new_zeros(H, P, N)
    ys = []
    for t in range(T):
        Bt, Ct = Bm[t][grp], Cm[t][grp]  # [H, N]
        h = torch.exp(dt[t] * A)[:, None, None] * h + dt[t][:, None, None] * xs[t][:, :, None] * Bt[:, None, :]
        ys.append(((h @ Ct[:, :, None])[..., 0] + D * xs[t]).reshape(I))
    y = torch.stack(ys) * F.silu(z)
    yg = y.view(T, G, I // G)
    y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + m.norm_eps)).reshape(T, I) * m.norm.weight
    return m.out_proj(y)


def fla_mamba2(m: Mamba2, cfg):
    """fla's Mamba2 layer holding float64 copies of ``m``'s parameters (same names)."""
    from fla.layers.mamba2 import Mamba2 as FlaMamba2
    from fla.modules.norm.layernorm_gated import rms_norm_ref

    ref = FlaMamba2(num_heads=m.H, chunk_size=4, **cfg)
    ref.load_state_dict({n: p.detach().clone() for n, p in m.state_dict().items()})
    for p in ref.parameters():
        p.data = p.data.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in ref.parameters())
    ref.act = F.silu  # fla's activation is a Triton kernel (no CPU path); the same function in torch
    norm = ref.norm
    norm.forward = lambda x, z=None: rms_norm_ref(x, norm.weight, None, z=z, eps=norm.eps, group_size=norm.group_size,
                                                  norm_before_gate=norm.norm_before_gate, upcast=False)
    return ref


# --- the comparison -----------------------------------------------------------------------


def compare(mixer, reference, branches, chunk, seed, ref_module=None):
    """Tree-mode outputs and gradients of ``mixer`` vs ``reference(module, x)`` per branch."""
    batch = treelit.TokenTree.from_branches(branches).to_batch()
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(VOCAB, D_MODEL, generator=gen, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(batch.num_tokens, D_MODEL, generator=gen, dtype=torch.float64)
    paths = [batch.branch_tokens[batch.branch_ptr[b] : batch.branch_ptr[b + 1]] for b in range(len(branches))]
    mult = torch.zeros(batch.num_tokens, dtype=torch.float64)
    for p in paths:
        mult[p] += 1

    mixer.chunk_size = chunk
    out_tree = mixer(emb[batch.input_ids][None], 0, TreeContext(batch, get_backend("sdpa_dense")))[0]
    params = dict(mixer.named_parameters())
    g_tree = torch.autograd.grad((probe * out_tree).sum(), [emb, *params.values()])

    module = ref_module if ref_module is not None else mixer
    ref_params = dict(module.named_parameters())
    assert ref_params.keys() == params.keys()
    total = 0.0
    for br, p in zip(branches, paths):
        out = reference(module, emb[torch.tensor(br)])
        torch.testing.assert_close(out.detach(), out_tree[p].detach(), rtol=TOL, atol=TOL)
        total = total + ((probe[p] / mult[p][:, None]) * out).sum()
    g_ref = torch.autograd.grad(total, [emb, *ref_params.values()])
    names = ["embedding input", *params]
    err = max_rel_grad_diff(dict(zip(names, g_tree)), dict(zip(names, g_ref)), floor=FLOOR, negligible=FLOOR)
    assert err <= TOL, f"max relative gradient difference {err:.2e}"
    assert all(g.abs().sum() > 0 for g in g_ref), "every parameter (and the input) gets a gradient"


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("kind", ["fla_naive_recurrent", "fla_naive_chunk", "plain_scan"])
@settings(max_examples=examples(3))
@given(data=forests(max_branches=6, max_len=12, vocab=VOCAB))
@example(data=(FIXED, None, None))
def test_gated_deltanet_gradients(kind, chunk, data):
    mixer = float64_mixer(GatedDeltaNet, GDN, seed=1)
    compare(mixer, gdn_reference(kind), data[0], chunk, seed=len(data[0]))


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("kind", ["fla_torch_path/groups1", "plain_scan/groups1", "plain_scan/groups2"])
@settings(max_examples=examples(3))
@given(data=forests(max_branches=6, max_len=12, vocab=VOCAB))
@example(data=(FIXED, None, None))
def test_mamba2_gradients(kind, chunk, data):
    how, groups = kind.split("/")
    cfg = MAMBA[groups]
    mixer = float64_mixer(Mamba2, cfg, seed=2)
    if how == "plain_scan":
        compare(mixer, mamba_plain_scan, data[0], chunk, seed=len(data[0]))
        return
    ref = fla_mamba2(mixer, cfg)

    def fla_torch_path(module, x):
        with fla_in_float64():
            out = module.torch_forward(x[None])[0][0]
        assert out.dtype == torch.float64
        return out

    compare(mixer, fla_torch_path, data[0], chunk, seed=len(data[0]), ref_module=ref)


def test_the_float64_shim_is_needed_and_restored():
    """Without :func:`fla_in_float64` fla's naive recurrence rounds through float32 (the
    oracle would then only agree to ~1e-7); the shim leaves torch as it found it."""
    gen = torch.Generator().manual_seed(0)
    T, H, K, V = 7, 2, 4, 3
    q, k, v = (torch.randn(1, T, H, n, generator=gen, dtype=torch.float64) for n in (K, K, V))
    k = F.normalize(k, dim=-1)
    beta, g = torch.rand(1, T, H, generator=gen, dtype=torch.float64), -torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    plain, _ = fla_gdn.naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    with fla_in_float64():
        exact, _ = fla_gdn.naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    ours = gdn_plain_scan(q[0], k[0], v[0], beta[0], g[0])
    assert plain.dtype == torch.float32 and exact.dtype == torch.float64
    torch.testing.assert_close(exact[0], ours, rtol=1e-13, atol=1e-13)
    assert (plain[0].double() - ours).abs().max() > 1e-9
    assert "to" not in torch.Tensor.__dict__ and "float" not in torch.Tensor.__dict__
    assert torch.ones(1, dtype=torch.float64).float().dtype == torch.float32
