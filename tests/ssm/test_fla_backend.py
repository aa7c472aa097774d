"""The fla kernel backend against the exact torch backend (CUDA only; skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

import treelit
from treelit.ssm import set_ssm_backend

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_fla_backend_refuses_cpu():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="ssm=fla needs CUDA"):
        set_ssm_backend(treelit.build_model("gdn_tiny"), "fla")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gdn_tiny", "mamba2_tiny", "hybrid_tiny"])
def test_fla_backend_matches_torch_backend(name):
    torch.manual_seed(0)
    model = treelit.build_model(name).cuda()
    branches = [[1, 2, 3, 4, 5, 6] * 5, [1, 2, 3, 4, 5, 7] * 4, [1, 2, 9] * 7, [4, 5]]
    tree = treelit.TokenTree.from_branches(branches)
    grads = {}
    for backend in ("torch", "fla"):
        set_ssm_backend(model, backend)
        model.zero_grad()
        loss = treelit.tree_loss(model, tree)
        loss.backward()
        grads[backend] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads["fla"][0] == pytest.approx(grads["torch"][0], rel=1e-4)
    for n, g in grads["torch"][1].items():
        d = (grads["fla"][1][n] - g).norm() / g.norm().clamp_min(1e-12)
        assert d < 1e-3, n
