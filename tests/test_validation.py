"""Bad input fails before any compute, with a message naming the branch and the problem."""

from __future__ import annotations

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit import TreeInputError


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.tok_embeddings.register_forward_hook(lambda *a: setattr(self, "calls", self.calls + 1))


@pytest.fixture
def model():
    return tiny_model("llama3_2_tiny", torch.float32, max_seq_len=8)


def test_token_outside_vocabulary(model):
    counter = ForwardCounter(model)
    tree = treelit.TokenTree.from_branches([[1, 2], [1, 2, 11]])
    with pytest.raises(TreeInputError, match=r"token id 11 at position 2 of branch 1 is outside .*vocabulary \(size 11\)"):
        treelit.tree_loss(model, tree)
    with pytest.raises(TreeInputError, match=r"token id 11 at position 2 of branch 1"):
        treelit.linear_loss(model, [[1, 2], [1, 2, 11]])
    assert counter.calls == 0


def test_branch_longer_than_max_seq_len(model):
    counter = ForwardCounter(model)
    tree = treelit.TokenTree.from_branches([[1] * 3, [2] * 9])
    with pytest.raises(TreeInputError, match="branch 1 has 9 tokens, more than the model's max_seq_len 8"):
        treelit.tree_loss(model, tree)
    with pytest.raises(TreeInputError, match="branch 1 has 9 tokens"):
        treelit.linear_loss(model, [[1] * 3, [2] * 9])
    assert counter.calls == 0


def test_linear_baseline_rejects_what_the_tree_rejects():
    with pytest.raises(TreeInputError, match="branch 0 is empty"):
        treelit.linear_loss(tiny_model("qwen2_tiny"), [[]])
    with pytest.raises(TreeInputError, match="weight -1.0"):
        treelit.linear_loss(tiny_model("qwen2_tiny"), [[1, 2]], weights=[-1.0])
