"""The decoder's MLP on blocks of tokens (``model.mlp_token_block``) computes the same loss and
every parameter gradient: tree mode with blocks of 1-5 tokens against per-branch training
without blocks, on random forests (float64 1e-9, float32 1e-4), and the block sizes the
default chooses on CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import treelit
from helpers import assert_equivalent, cached_model
from strategies import examples, forests
from treelit.models import decoder
from treelit.models.decoder import MLP_BLOCK_BYTES_CPU, mlp_rows_per_block

CPU = torch.device("cpu")


class _Counting(torch.nn.Module):
    """Wraps an MLP and records the rows of every call."""

    def __init__(self, mlp):
        super().__init__()
        self.inner, self.rows = mlp, []

    def forward(self, x):
        self.rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return self.inner(x)


def _blocked(model, block):
    model.mlp_token_block = block
    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("family", ["qwen2_5_tiny", "qwen3_tiny"])
@pytest.mark.parametrize("block", [1, 2, 5])
@settings(max_examples=examples(6))
@given(data=forests())
def test_blocked_tree_equals_unblocked_per_branch(family, block, dtype, data):
    branches, masks, weights = data
    model = cached_model(family, dtype)
    tree = treelit.TokenTree.from_branches(branches, masks, weights)

    def tree_blocked():
        _blocked(model, block)
        try:
            return treelit.tree_loss(model, tree, "token-mean", attention="segment")
        finally:
            model.mlp_token_block = 0

    assert_equivalent(
        model,
        tree_blocked,
        lambda: treelit.linear_loss(model, branches, masks, weights, "token-mean"),
        dtype,
        f"{family}/block {block}/{dtype}",
        forest=data,
    )
    assert model.mlp_token_block == 0
    model.mlp_token_block = None


def test_blocks_run_and_cover_every_token():
    """The blocked path runs (the MLP sees blocks no larger than asked) and the hidden
    states equal the unblocked ones."""
    model = treelit.build_model("qwen2_5_tiny", vocab_size=11, max_seq_len=64).double()
    layer = model.layers[0]
    layer.mlp = _Counting(layer.mlp)
    ids = torch.randint(0, 11, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    from treelit.models.context import CausalContext

    model.mlp_token_block = 0
    ref = decoder.layers_hidden(model, ids, pos, CausalContext())
    assert layer.mlp.rows == [18]
    layer.mlp.rows.clear()
    model.mlp_token_block = 4
    out = decoder.layers_hidden(model, ids, pos, CausalContext())
    assert layer.mlp.rows == [4, 4, 4, 4, 2]  # 18 tokens in 5 blocks of at most 4, nearly equal
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_default_blocks_on_cpu_only():
    inter = 2816
    cap = MLP_BLOCK_BYTES_CPU // (inter * 4)
    assert mlp_rows_per_block(None, cap, inter, torch.float32, CPU) == cap  # fits: one call
    rows = mlp_rows_per_block(None, 4614, inter, torch.float32, CPU)
    assert rows <= cap and -(-4614 // rows) == -(-4614 // cap)  # fewest blocks, of equal size
    assert rows * inter * 4 <= MLP_BLOCK_BYTES_CPU
    assert mlp_rows_per_block(None, 4614, inter, torch.float64, CPU) <= cap // 2 + 1  # twice the bytes per token
    assert mlp_rows_per_block(None, 10**6, inter, torch.float32, torch.device("meta")) == 10**6  # accelerators: no blocks
    assert mlp_rows_per_block(0, 10**6, inter, torch.float32, CPU) == 10**6  # 0: off
    assert mlp_rows_per_block(7, 20, inter, torch.float32, torch.device("meta")) == 7  # explicit: any device


@pytest.mark.parametrize("bad", [-1, 2.5, "1024", True])
def test_bad_setting_is_refused(bad):
    with pytest.raises(ValueError, match="mlp_token_block"):
        mlp_rows_per_block(bad, 100, 64, torch.float32, CPU)
