"""Sparse mixture-of-experts MLP (Qwen3-MoE layout) and its routing record.

Routing is per token: the router's softmax, the top-k choice and the expert outputs
of a token depend on that token's hidden state only, so a tree computes exactly the
expert outputs of every branch through it. What is *not* per token is the router's
load-balancing loss (see :mod:`treelit.loss.router`): the MLP therefore hands its
router logits to the sequence context (``ctx.record_router``), which the loss reads.

Experts run grouped: the (token, slot) assignments are sorted by expert and each
expert multiplies one contiguous slice, so the work is a loop over experts with
tokens, never over tokens. Parameters (per layer ``i``)::

    mlp.gate.weight     [E, D]       router (no bias)
    mlp.w1 / mlp.w3     [E, I, D]    gate / up projections of every expert
    mlp.w2              [E, D, I]    down projections

Routing replay (``moe.routing=replay``): the experts of each token come from the sampler's
record (``ctx.replay_experts``, rows of -1 where none was recorded: those tokens route live);
the combine weights are still the current router's softmax, read at the replayed experts and
renormalised as the live path does (``norm_topk_prob``), so the router keeps its gradient.

Hugging Face names: ``mlp.gate.weight`` and ``mlp.experts.{e}.{gate,up,down}_proj.weight``
(hub checkpoints), or the fused ``mlp.experts.gate_up_proj [E, 2I, D]`` /
``mlp.experts.down_proj [E, D, I]`` of transformers 5; both load (see ``models/hf.py``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoEFeedForward", "route", "collecting", "is_collecting", "record_pass"]


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          replay: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], experts [T, k])`` of each token from router ``logits [T, E]``:
    softmax over experts, top-k, optionally renormalised. The softmax runs one precision up
    (float64 for float32 logits, float32 for half types): the router's gradient is a small
    difference of large terms, and ``[T, E]`` costs nothing next to the experts.
    ``replay [T, k]``: the experts to use instead of the top-k (rows of -1: the top-k); the
    weights are the probabilities at those experts."""
    probs = torch.softmax(logits.to(router_dtype(logits.dtype)), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if replay is not None:
        replay = replay.to(experts.device)
        experts = torch.where(replay[:, :1] >= 0, replay, experts)
        weights = probs.gather(1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts.

    Args:
        dim: model width D.
        hidden_dim: each expert's intermediate width I.
        num_experts: E.
        top_k: experts per token.
        norm_topk_prob: renormalise the top-k probabilities to sum to one.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool = False,
                 moe_index: int = 0, replay: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = int(num_experts), int(top_k), bool(norm_topk_prob)
        self.moe_index = int(moe_index)  # this layer's place among the model's MoE layers (routing records)
        self.replay = bool(replay)  # moe.routing=replay: route by the record (ctx.replay_experts)
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.reset_tree_parameters()

    def reset_tree_parameters(self, std: float = 0.02) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=std)

    def route(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(output [..., D], router logits [T, E])`` for ``x [..., D]`` (T = tokens of x);
        ``replay [T, k]``: recorded experts (see :func:`route`)."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.gate(h)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob, replay)
        flat_expert = experts.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of = torch.div(order, self.top_k, rounding_mode="floor")
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        xs = h.index_select(0, token_of)
        outs = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            xe = xs[start : start + n]
            ye = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
            outs.append(ye)
            start += n
        y = torch.cat(outs, dim=0) if outs else h.new_zeros(0, shape[-1])
        y = y * weights.reshape(-1)[order].to(y.dtype).unsqueeze(-1)
        out = torch.zeros_like(h).index_add(0, token_of, y)
        return out.reshape(shape), logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.route(x)[0]

    def extra_repr(self) -> str:
        E, I, D = self.w1.shape
        return (f"dim={D}, hidden_dim={I}, num_experts={E}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
                + (", routing=replay" if self.replay else ""))


def expert_load(logits: torch.Tensor, top_k: int, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Assignments per expert ``[E]`` of router ``logits [T, E]`` (each token row weighted by ``counts``)."""
    _, experts = torch.topk(logits.detach(), top_k, dim=-1)
    w = torch.ones(experts.shape, dtype=torch.float64, device=logits.device)
    if counts is not None:
        w = w * counts.to(torch.float64).unsqueeze(-1)
    return torch.zeros(logits.shape[-1], dtype=torch.float64, device=logits.device).index_add(
        0, experts.reshape(-1), w.reshape(-1))


# A collection of router logits (the router loss, :mod:`treelit.loss.router`) registers here for
# a model; the decoder reports each forward pass that computed gradients through ``record_pass``.
_collections = threading.local()


@contextlib.contextmanager
def collecting(model, collector):
    """Within the block, ``collector.record(ctx)`` receives every forward pass of ``model``
    (with gradient enabled) whose MoE layers recorded router logits in ``ctx``."""
    stack = getattr(_collections, "stack", None)
    if stack is None:
        stack = _collections.stack = []
    stack.append((model, collector))
    try:
        yield collector
    finally:
        stack.remove((model, collector))


def is_collecting(model) -> bool:
    return any(owner is model for owner, _ in getattr(_collections, "stack", []))


def record_pass(model, ctx) -> None:
    if not getattr(ctx, "router_logits", None) or not torch.is_grad_enabled():
        return
    for owner, collector in reversed(getattr(_collections, "stack", [])):
        if owner is model:
            collector.record(ctx)
            return
