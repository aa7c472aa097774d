"""The chunked log-prob head against a plain full log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from treelit.loss.logprobs import token_logprobs


def reference(h, W, t):
    logp_all = torch.log_softmax(h @ W.t(), dim=-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(1, t[:, None]).squeeze(1), ent


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 100])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_values_and_gradients(chunk_rows, dtype):
    g = torch.Generator().manual_seed(1)
    M, D, V = 13, 6, 29
    h = torch.randn(M, D, generator=g, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (M,), generator=g)
    a = torch.randn(M, generator=g, dtype=dtype)
    b = torch.randn(M, generator=g, dtype=dtype)
    logp, ent = token_logprobs(h, W, t, chunk_rows=chunk_rows, with_entropy=True)
    (logp * a + ent * b).sum().backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    rl, re = reference(h, W, t)
    (rl * a + re * b).sum().backward()
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logp, rl.detach(), **tol)
    torch.testing.assert_close(ent, re.detach(), **tol)
    torch.testing.assert_close(gh, h.grad, **tol)
    torch.testing.assert_close(gW, W.grad, **tol)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (5,), generator=g)

    def f(h, W):
        lp, en = token_logprobs(h, W, t, chunk_rows=2, with_entropy=True)
        return lp, en

    assert torch.autograd.gradcheck(f, (h, W))


def test_bfloat16_inputs_upcast():
    h = torch.randn(4, 8).bfloat16()
    W = torch.randn(16, 8).bfloat16()
    t = torch.randint(0, 16, (4,))
    logp, _ = token_logprobs(h, W, t)
    assert logp.dtype == torch.float32
    ref, _ = reference(h.float(), W.float(), t)
    torch.testing.assert_close(logp, ref)


def test_shape_errors():
    with pytest.raises(ValueError, match="expected hidden"):
        token_logprobs(torch.randn(3, 2), torch.randn(5, 2), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, 10, 50])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_weighted_nll(chunk_rows, dtype):
    from treelit.loss.logprobs import weighted_nll

    g = torch.Generator().manual_seed(4)
    M, D, V = 11, 5, 23
    h = torch.randn(M, D, generator=g, dtype=dtype, requires_grad=True)
    W = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (M,), generator=g)
    c = torch.rand(M, generator=g, dtype=dtype)
    loss = weighted_nll(h, W, t, c, chunk_rows=chunk_rows)
    (2.5 * loss).backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    ref = -(c * reference(h, W, t)[0]).sum()
    (2.5 * ref).backward()
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, ref.detach(), **tol)
    torch.testing.assert_close(gh, h.grad, **tol)
    torch.testing.assert_close(gW, W.grad, **tol)


def test_even_chunk_rows():
    """As few chunks as the bound allows, of equal size (within one row), never above the bound."""
    from treelit.loss.logprobs import even_chunk_rows

    assert even_chunk_rows(778, 256) == 195  # 4 chunks of <= 195, not 3 x 256 + 10
    assert even_chunk_rows(11, 10) == 6
    assert even_chunk_rows(7, 100) == 7 and even_chunk_rows(0, 100) == 1
    for rows in range(1, 300):
        for bound in (1, 2, 7, 64, 256):
            r = even_chunk_rows(rows, bound)
            sizes = [min(r, rows - s) for s in range(0, rows, r)]
            assert r <= bound and len(sizes) == -(-rows // bound)
            assert max(sizes) - min(sizes) <= len(sizes)  # the last one is short by less than one per chunk
