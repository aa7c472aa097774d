"""Shared helpers: tiny random models of every family, and gradient comparison."""

from __future__ import annotations

import contextlib

import os
import sys
from typing import Callable, Dict

import torch

sys.path.insert(0, os.path.dirname(__file__))

import treelit  # noqa: E402

torch.set_num_threads(1)  # tiny models: OpenMP overhead dominates with more threads

FAMILIES = ["llama3_2_tiny", "qwen2_tiny", "qwen2_5_tiny", "mistral_tiny"]
RECURRENT = ["gdn_tiny", "mamba2_tiny", "hybrid_tiny"]
TEST_VOCAB = 11


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Give every parameter (biases and norm scales included) a random non-trivial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
            else:
                p.copy_((std * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(p.dtype))
    return model


def tiny_model(name: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> torch.nn.Module:
    kw = dict(vocab_size=TEST_VOCAB, max_seq_len=64)
    kw.update(overrides)
    torch.manual_seed(seed)
    return randomize_(treelit.build_model(name, **kw), seed).to(dtype)


_CACHE: Dict[tuple, torch.nn.Module] = {}


def cached_model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    key = (name, dtype)
    if key not in _CACHE:
        _CACHE[key] = tiny_model(name, dtype)
    return _CACHE[key]


def loss_and_grads(model: torch.nn.Module, fn: Callable[[], torch.Tensor]):
    model.zero_grad(set_to_none=True)
    loss = fn()
    if loss.requires_grad:
        loss.backward()
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def max_rel_grad_diff(ga: Dict[str, torch.Tensor], gb: Dict[str, torch.Tensor], floor: float = 0.0) -> float:
    """max over parameters of ||ga - gb|| / max(||gb||, floor * max_p ||gb_p||).

    The floor keeps parameters whose true gradient is exactly zero (e.g. q/k of a query that
    sees a single key) from turning rounding noise into an infinite ratio; it is set far
    below the tolerance so that a wrong gradient of any visible size still fails.
    """
    assert ga.keys() == gb.keys()
    scale = max((g.double().norm().item() for g in gb.values()), default=0.0)
    worst = 0.0
    for k in gb:
        d = (ga[k] - gb[k]).double().norm().item()
        if d == 0.0:
            continue
        n = max(gb[k].double().norm().item(), floor * scale)
        worst = max(worst, d / n if n > 0 else float("inf"))
    return worst


def tol(dtype: torch.dtype) -> float:
    return 1e-9 if dtype == torch.float64 else 1e-4


def grad_floor(dtype: torch.dtype) -> float:
    """Floor of the per-parameter denominator, relative to the largest parameter gradient.

    Rounding noise on a mathematically zero gradient is a few eps x the gradient scale
    (eps ~2e-16 in float64, ~1e-7 in float32, amplified by the model). With the floor,
    a difference on such a parameter fails once it exceeds floor x tol x scale: 1e-14
    of the scale in float64 (~45 eps; noise of 5 eps was observed on q/k of a query
    that sees a single key) and 1e-6 in float32 (~8 eps). Parameters with a real
    gradient are still held to the tolerance relative to their own norm.
    """
    return 1e-5 if dtype == torch.float64 else 1e-2


def assert_equivalent(model, fn_tree, fn_ref, dtype, what: str = "", require_grad: bool = True) -> None:
    la, ga = loss_and_grads(model, fn_tree)
    lb, gb = loss_and_grads(model, fn_ref)
    rel_loss = abs(la.item() - lb.item()) / max(abs(lb.item()), 1e-30)
    assert rel_loss <= tol(dtype) or abs(la.item() - lb.item()) <= 1e-12, f"{what}: loss {la.item()} vs {lb.item()}"
    err = max_rel_grad_diff(ga, gb, grad_floor(dtype))
    assert err <= tol(dtype), f"{what}: max relative gradient difference {err:.3e} > {tol(dtype):.0e}"
    # The comparison must not be vacuous: some gradient is non-zero whenever the loss is.
    if require_grad and lb.item() != 0.0:
        assert any(g.abs().sum() > 0 for g in gb.values()), f"{what}: all reference gradients are zero"


@contextlib.contextmanager
def ssm_chunk_size(model: torch.nn.Module, chunk_size: int):
    """Run the model's recurrent layers with the chunked scan at ``chunk_size`` tokens per
    block (1: the token-by-token reference scan), restoring the previous setting after."""
    layers = [m for m in model.modules() if hasattr(m, "chunk_size") and hasattr(m, "reset_tree_parameters")]
    before = [m.chunk_size for m in layers]
    for m in layers:
        m.chunk_size = chunk_size
    try:
        yield
    finally:
        for m, c in zip(layers, before):
            m.chunk_size = c
