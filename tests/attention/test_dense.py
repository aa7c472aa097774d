"""The reference backend: dense ancestor mask, GQA, and externally supplied ancestor K/V."""

from __future__ import annotations

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit.attention import get_backend, resolve_backend
from treelit.loss.tree import tree_hidden
from treelit.models.context import ExternalKV

BRANCHES = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8], [1, 2, 9], [1, 2, 3, 4, 10, 1]]


def test_mask_is_ancestor_relation():
    batch = treelit.TokenTree.from_branches(BRANCHES).to_batch()
    from treelit.models.context import TreeLayout

    N = batch.num_tokens
    idx = torch.arange(N)
    mask = TreeLayout(batch, idx, batch.subtree_end, 0).dense_mask()
    for q in range(N):
        anc, a = set(), q
        while a >= 0:
            anc.add(a)
            a = int(batch.parent[a])
        assert set(torch.nonzero(mask[q]).squeeze(1).tolist()) == anc


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_external_ancestor_kv_reproduces_outputs_and_gradients(dtype):
    """Cut the tree below its root segment. The subtree row, fed its ancestors' K/V as
    external tensors that require grad, reproduces the subtree's hidden states; relaying
    the gradients of those tensors into the ancestors' own graph reproduces every
    parameter gradient of the uncut forward."""
    model = tiny_model("qwen2_tiny", dtype)  # 4 heads over 2 kv heads: GQA
    batch = treelit.TokenTree.from_branches(BRANCHES).to_batch()
    start = int(batch.seg_len[0])  # the root segment [1, 2] holds every ancestor of the cut
    end = int(batch.subtree_end[start])
    n = end - start
    probe = torch.randn(n, model.config.embed_dim, dtype=dtype, generator=torch.Generator().manual_seed(3))
    params = list(model.parameters())

    h_full, _ = tree_hidden(model, batch, "sdpa_dense")
    full = torch.autograd.grad((h_full[start:end] * probe).sum(), params, allow_unused=True)

    h_par, pctx = tree_hidden(model, batch.token_slice(0, start), "sdpa_dense", capture_kv=True)
    torch.testing.assert_close(h_par, h_full[:start].detach(), rtol=1e-5, atol=1e-5)
    layers = sorted(pctx.captured)
    ext_k = {i: pctx.captured[i][0].detach().requires_grad_() for i in layers}
    ext_v = {i: pctx.captured[i][1].detach().requires_grad_() for i in layers}
    lo = torch.zeros(start, dtype=torch.long)
    hi = torch.full((start,), n, dtype=torch.long)
    h_sub, _ = tree_hidden(model, batch.token_slice(start, end), "sdpa_dense", external=ExternalKV(ext_k, ext_v, lo, hi))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(h_sub, h_full[start:end].detach(), **tol)

    ext = [t for i in layers for t in (ext_k[i], ext_v[i])]
    sub = torch.autograd.grad((h_sub * probe).sum(), params + ext, allow_unused=True)
    sub_params, ext_grads = sub[: len(params)], sub[len(params) :]
    assert all(g is not None and g.abs().sum() > 0 for g in ext_grads), "every external tensor gets a gradient"
    relayed = torch.autograd.grad(
        [t for i in layers for t in pctx.captured[i]], params, grad_outputs=list(ext_grads), allow_unused=True
    )
    for p, f, a, b in zip(model.named_parameters(), full, sub_params, relayed):
        zero = torch.zeros_like(p[1])
        total = sum((g for g in (a, b) if g is not None), zero)
        torch.testing.assert_close(total, f if f is not None else zero, **tol, msg=p[0])


def test_unknown_backend_lists_known():
    with pytest.raises(KeyError, match="unknown attention 'fast'.*sdpa_dense"):
        get_backend("fast")


def test_auto_on_cpu_is_not_cuda_only():
    batch = treelit.TokenTree.from_branches(BRANCHES).to_batch()
    assert not resolve_backend("auto", "cpu", batch).requires_cuda


def test_auto_choice_depends_on_device_and_row_size(caplog):
    from treelit.attention.base import auto_backend_name

    small = treelit.TokenTree.from_branches(BRANCHES).to_batch()
    large = treelit.TokenTree.from_branches([list(range(300)) + [1] * 300, list(range(300)) + [2] * 300]).to_batch()
    assert auto_backend_name(torch.device("cpu"), small) == "sdpa_dense"
    assert auto_backend_name(torch.device("cpu"), large) == "segment"
    assert auto_backend_name(torch.device("cuda"), large) == "flex"
    import logging

    from treelit.attention import base

    base._AUTO_LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="treelit.attention.base"):
        resolve_backend("auto", "cpu", large)
        resolve_backend("auto", "cpu", large)
    assert [r.getMessage() for r in caplog.records].count("attention=auto: using 'segment' on cpu (exact, work = sum of segment x path)") == 1
