"""Independent oracles for the recurrences.

* Gated DeltaNet: fla's ``naive_recurrent_gated_delta_rule`` run branch by branch (it
  computes in float32, so the comparison is at float32 tolerance).
* Mamba2 (SSD): a plain sequential scan written here from the published definition,
  h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = C_t h_t + D x_t.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import treelit
from helpers import randomize_
from treelit.ssm.layers import GatedDeltaNet, Mamba2

BRANCHES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [1, 2, 8, 9, 10], [1, 11]]


def _tree_mixer_outputs(mixer, x_tokens_fn):
    """Mixer outputs for every tree token (tree mode) and for each branch alone (causal)."""
    batch = treelit.TokenTree.from_branches(BRANCHES).to_batch()
    from treelit.models.context import TreeContext
    from treelit.attention import get_backend

    x_tree = x_tokens_fn(batch.input_ids)[None]
    out_tree = mixer(x_tree, 0, TreeContext(batch, get_backend("sdpa_dense")))[0]
    per_branch = []
    for b, br in enumerate(BRANCHES):
        x = x_tokens_fn(torch.tensor(br))[None]
        per_branch.append((batch.branch_tokens[batch.branch_ptr[b] : batch.branch_ptr[b + 1]], x))
    return batch, out_tree, per_branch


def test_gdn_recurrence_agrees_with_fla_naive_per_branch():
    fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    torch.manual_seed(0)
    mixer = GatedDeltaNet(hidden_size=16, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2.0, conv_size=3)
    randomize_(mixer, seed=1, std=0.4)
    mixer = mixer.double()
    emb = torch.randn(20, 16, dtype=torch.float64)
    batch, out_tree, per_branch = _tree_mixer_outputs(mixer, lambda ids: emb[ids])
    for path, x in per_branch:
        xf = x[0]
        T = xf.shape[0]
        conv = lambda name, t: F.silu(F.conv1d(F.pad(t.T[None], (2, 0)), getattr(mixer, name).weight, groups=t.shape[1])[0].T)  # noqa: E731
        q = conv("q_conv1d", mixer.q_proj(xf)).view(T, 2, 8)
        k = conv("k_conv1d", mixer.k_proj(xf)).view(T, 2, 8)
        v = conv("v_conv1d", mixer.v_proj(xf)).view(T, 4, 16)
        l2 = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
        q, k = l2(q).repeat_interleave(2, 1), l2(k).repeat_interleave(2, 1)
        beta = torch.sigmoid(mixer.b_proj(xf))
        g = -mixer.A_log.exp() * F.softplus(mixer.a_proj(xf) + mixer.dt_bias)
        o, _ = fla_naive.naive_recurrent_gated_delta_rule(q[None], k[None], v[None], beta[None], g[None])
        o = o[0].double()
        y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + mixer.norm_eps) * mixer.o_norm.weight
        y = y * F.silu(mixer.g_proj(xf).view(T, 4, 16))
        ref = mixer.o_proj(y.reshape(T, 64))
        torch.testing.assert_close(out_tree[path].detach(), ref.detach(), rtol=1e-4, atol=1e-5)


def test_mamba2_recurrence_agrees_with_a_plain_scan():
    torch.manual_seed(0)
    mixer = Mamba2(hidden_size=16, head_dim=8, state_size=4, expand=2, n_groups=2, conv_kernel=3, D_has_hdim=True)
    randomize_(mixer, seed=2, std=0.4)
    mixer = mixer.double()
    emb = torch.randn(20, 16, dtype=torch.float64)
    batch, out_tree, per_branch = _tree_mixer_outputs(mixer, lambda ids: emb[ids])
    H, P, N, G, I = 4, 8, 4, 2, 32
    for path, x in per_branch:
        xf = x[0]
        T = xf.shape[0]
        z, xBC, dt = torch.split(mixer.in_proj(xf), [I, I + 2 * G * N, H], -1)
        w, bias = mixer.conv1d.weight, mixer.conv1d.bias
        xBC = F.silu(F.conv1d(F.pad(xBC.T[None], (2, 0)), w, bias, groups=xBC.shape[1])[0].T)
        xs, Bm, Cm = torch.split(xBC, [I, G * N, G * N], -1)
        dt = F.softplus(dt + mixer.dt_bias)
        A = -mixer.A_log.exp()
        h = torch.zeros(H, P, N, dtype=torch.float64)
        ys = []
        for t in range(T):
            for head in range(H):
                grp = head // (H // G)  # the kernels' grouping
                Bt = Bm[t].view(G, N)[grp]
                xt = xs[t].view(H, P)[head]
                h[head] = torch.exp(dt[t, head] * A[head]) * h[head] + dt[t, head] * torch.outer(xt, Bt)
            y = torch.stack([h[hd] @ Cm[t].view(G, N)[hd // (H // G)] for hd in range(H)])
            ys.append((y + mixer.D.view(H, P) * xs[t].view(H, P)).reshape(I))
        y = torch.stack(ys) * F.silu(z)
        yg = y.view(T, G, I // G)
        y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + mixer.norm_eps)).reshape(T, I) * mixer.norm.weight
        ref = mixer.out_proj(y)
        torch.testing.assert_close(out_tree[path].detach(), ref.detach(), rtol=1e-10, atol=1e-10)
