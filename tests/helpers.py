"""Shared helpers: tiny random models of every family, and gradient comparison."""

from __future__ import annotations

import contextlib

import os
import sys
from typing import Callable, Dict, Optional

import torch

sys.path.insert(0, os.path.dirname(__file__))

import treelit  # noqa: E402

torch.set_num_threads(1)  # tiny models: OpenMP overhead dominates with more threads

FAMILIES = ["llama3_2_tiny", "qwen2_tiny", "qwen2_5_tiny", "mistral_tiny", "qwen3_tiny", "qwen3_moe_tiny"]
RECURRENT = ["gdn_tiny", "mamba2_tiny", "hybrid_tiny"]
TEST_VOCAB = 11


def has_attention(name: str) -> bool:
    """Whether model ``name`` has softmax-attention layers (recurrent-only models have none)."""
    types = treelit.build_model(name, vocab_size=TEST_VOCAB, max_seq_len=64).config.layer_types
    return types is None or "attention" in types


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


def max_rel_grad_diff(
    ga: Dict[str, torch.Tensor], gb: Dict[str, torch.Tensor], floor: float = 0.0, negligible: Optional[float] = None
) -> float:
    """max over parameters of ||ga - gb|| / denominator, ``gb`` the reference.

    With ``negligible`` given (a fraction of the largest reference gradient norm ``scale``):
    a parameter whose reference gradient exceeds ``negligible * scale`` is compared relative
    to its own norm; one at or below it (rounding noise on a mathematically zero gradient,
    e.g. q/k of a query that sees a single key) relative to ``floor * scale``.
    Without it the denominator is ``max(||gb||, floor * scale)``.
    """
    assert ga.keys() == gb.keys(), sorted(set(ga) ^ set(gb))
    scale = max((g.double().norm().item() for g in gb.values()), default=0.0)
    worst = 0.0
    for k in gb:
        d = (ga[k] - gb[k]).double().norm().item()
        if d == 0.0:
            continue
        own = gb[k].double().norm().item()
        if negligible is None:
            n = max(own, floor * scale)
        elif own > negligible * scale:
            n = max(own, resolution(gb[k].dtype) * scale)
        else:
            n = floor * scale
        worst = max(worst, d / n if n > 0 else float("inf"))
    return worst


def resolution(dtype: torch.dtype) -> float:
    """float32: a gradient below 2e-3 of the scale is held to 2e-3 x scale x tol = 2e-7 x scale
    (under two float32 eps of the scale) instead of 1e-4 of its own norm, which float32
    arithmetic cannot resolve: the gradients of a small parameter are sums of terms of the
    scale's size, each rounded to eps32 ~ 1.2e-7 of it. Found by the thorough profile on one
    Qwen3-MoE example (a single two-token branch) whose float64 gradients agree to 4e-13:
    k_norm at 9.7e-5 x scale differing by 2.2e-4 relative, k_proj at 1.2e-3 x scale by
    1.1e-4 (1.3e-7 x scale, one eps). Float64: none (0)."""
    return 2e-3 if dtype == torch.float32 else 0.0


def tol(dtype: torch.dtype) -> float:
    return 1e-9 if dtype == torch.float64 else 1e-4


def grad_floor(dtype: torch.dtype) -> float:
    """Denominator of a parameter with a negligible gradient, relative to the largest
    parameter gradient ``scale`` (see :func:`negligible_grad`).

    Rounding noise on a mathematically zero gradient is a few eps x scale, amplified by the
    model: up to 5 eps (~1e-15) measured in float64, up to 5.5e-7 x scale in float32 (q/k of
    a query that sees a single key). Such a parameter fails once its difference exceeds
    floor x tol x scale: 1e-14 x scale in float64, 1e-6 x scale in float32.
    """
    return 1e-5 if dtype == torch.float64 else 1e-2


def negligible_grad(dtype: torch.dtype) -> float:
    """A reference gradient at or below this fraction of ``scale`` counts as zero (rounding
    noise); every parameter above it is held to ``tol`` relative to its own norm.

    float64: 1e-5 (noise ~1e-15 x scale). float32: 1e-5, 18x the largest noise measured on a
    zero gradient (5.5e-7 x scale); real gradients of tiny-model parameters down to 1e-4 x
    scale were measured within 5e-5 relative of the float32 per-branch reference.
    """
    return 1e-5


EXAMPLES = {"compared": 0, "vacuous": 0, "vacuous_allowed": 0}


def _is_zero(loss: torch.Tensor, grads: Dict[str, torch.Tensor]) -> bool:
    return loss.item() == 0.0 and not any(bool(g.abs().sum() > 0) for g in grads.values())


def assert_equivalent(model, fn_tree, fn_ref, dtype, what: str = "", require_grad: bool = True, forest=None) -> None:
    """Loss and every parameter gradient of ``fn_tree`` equal those of the reference ``fn_ref``
    (float64: 1e-9 relative, float32: 1e-4; see :func:`max_rel_grad_diff`).

    The comparison must train something: with ``require_grad`` (the default) some reference
    gradient is non-zero, otherwise the example is vacuous (loss and every gradient 0 on both
    sides) and fails. ``require_grad=False`` is for objectives whose gradient may vanish
    legitimately (every ratio clipped) and for the fixed case that checks an untrained tree
    gives zero; such examples are counted separately in the session summary. ``forest``
    (``(branches, masks, weights)``, or a list of them for packed rows) is checked to train
    something in every tree before anything runs.
    """
    if forest is not None:
        for f in forest if isinstance(forest, list) else [forest]:
            assert_trains(*f)
    la, ga = loss_and_grads(model, fn_tree)
    lb, gb = loss_and_grads(model, fn_ref)
    vacuous = _is_zero(la, ga) and _is_zero(lb, gb)
    EXAMPLES["compared"] += 1
    if vacuous:
        EXAMPLES["vacuous" if require_grad else "vacuous_allowed"] += 1
    rel_loss = abs(la.item() - lb.item()) / max(abs(lb.item()), 1e-30)
    assert rel_loss <= tol(dtype) or abs(la.item() - lb.item()) <= 1e-12, f"{what}: loss {la.item()} vs {lb.item()}"
    err = max_rel_grad_diff(ga, gb, grad_floor(dtype), negligible_grad(dtype))
    assert err <= tol(dtype), f"{what}: max relative gradient difference {err:.3e} > {tol(dtype):.0e}"
    if require_grad:
        assert not vacuous, f"{what}: vacuous example (loss and every gradient zero on both sides)"
        assert any(bool(g.abs().sum() > 0) for g in gb.values()), f"{what}: all reference gradients are zero"


def assert_trains(branches, masks=None, weights=None) -> None:
    """Every tree of the forest trains at least one target in at least one branch."""
    from strategies import untrained_trees

    bad = untrained_trees(branches, masks, weights)
    assert not bad, f"trees with roots {bad} train nothing: {branches} {masks} {weights}"


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
