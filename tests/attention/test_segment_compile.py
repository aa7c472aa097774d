"""The segment backend under ``torch.compile``: its autograd function traces whole (forward and
backward, no graph break) and gives the eager outputs and gradients. Its forward used to save
the buffer its output is a view of, which dynamo refuses ("an intermediate tensor 'out' ...
aliases an input or output") when it traces the backward."""

from __future__ import annotations

import random

import pytest
import torch

from treelit.attention.segment import SegmentAttention
from treelit.models.context import TreeLayout
from treelit.tree.token_tree import TokenTree


def _grpo(n: int, prompt: int = 10, completion: int = 6, seed: int = 0):
    rng = random.Random(seed)
    pre = [rng.randrange(1, 60) for _ in range(prompt)]
    return [pre + [rng.randrange(1, 60) for _ in range(rng.randint(2, completion))] for _ in range(n)]


NESTED = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 11, 12, 13], [1, 2, 9, 10, 20, 21]]


@pytest.mark.parametrize("branches", [_grpo(8), NESTED], ids=["grpo", "nested"])
def test_segment_attention_compiles_fullgraph_with_its_backward(branches):
    """``nested``: a prefix part merged into chains that read the output rows as a slice."""
    torch._dynamo.reset()
    batch = TokenTree.from_branches(branches).to_batch()
    backend = SegmentAttention()
    N = batch.num_tokens
    plan = backend.plan(TreeLayout(batch, torch.arange(N), batch.subtree_end, 0))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, N, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    probe = torch.randn(1, 4, N, 8, generator=g)

    def loss(q, k, v):
        return (backend(q, k, v, plan) * probe).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)  # first: the plan's work list is built inside the trace
    grads = torch.autograd.grad(out, (q, k, v))
    ref = loss(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"grad {name}")
