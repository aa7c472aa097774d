"""The per-branch baseline with images (``mode=linear``, ``verify_every``): every branch its own
causal sequence with its own images, encoded for that branch alone, and its own M-RoPE positions.
Its loss and every gradient equal transformers branch by branch (float64 <= 1e-10); the trainer's
linear mode equals its tree mode, and self-verification finds them equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treelit
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from treelit.loss.branches import Branches, as_branches
from vision_oracle import (image_processor, load_reference, processed, random_forest, random_image, span, text_mask,
                           vision_checkpoint, vlm_branch_loss)

pytest.importorskip("transformers")
pytest.importorskip("PIL")

F64 = torch.float64
_CACHE = {}


def _path(family, tmp_path_factory):
    if family not in _CACHE:
        _CACHE[family] = vision_checkpoint(tmp_path_factory.mktemp(family), family)
    return _CACHE[family]


@pytest.fixture(scope="module")
def pool():
    proc = image_processor()
    rng = np.random.default_rng(0)
    return [processed(proc, random_image(rng, h, w), name=n) for n, (h, w) in zip("abc", [(16, 24), (16, 24), (24, 16)])]


def _case(pool):
    a, b, c = pool
    branches = [[1] + span(a) + [3, 4, 5], [1] + span(a) + [6, 7], [1] + span(a) + [3, 8] + span(c) + [9], [2, 5, 6]]
    return branches, [[a], [a], [a, c], []]


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow),
                                    pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_linear_loss_with_images_equals_transformers_branch_by_branch(family, pool, tmp_path_factory):
    path = _path(family, tmp_path_factory)
    ours, ref = treelit.load_hf_model(path, dtype=F64, vision=True), load_reference(path)
    branches, images = _case(pool)
    masks = [text_mask(b) for b in branches]
    weights = [1.0, 0.5, 2.0, 1.5]
    br = Branches.build(branches, masks, weights, images=images)
    with KeepFloat64():
        expected = vlm_branch_loss(ref, branches, images, masks, weights)
        expected.backward()
        theirs = _grads(ref)
        before = ours.vision.images_encoded
        loss = treelit.linear_loss(ours, br, max_tokens=40)  # several padded micro-batches
        loss.backward()
        mine = _grads(ours, strip="hf.")
    assert ours.vision.images_encoded - before == 4  # once per branch that shows an image, as per branch
    assert mine.keys() == theirs.keys() and any("visual" in k for k in mine)
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item()), (loss.item(), expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10


def test_branches_read_back_from_a_tree_keep_their_images(pool):
    rng = np.random.default_rng(1)
    branches, images = random_forest(rng, pool, n_branches=5)
    tree = treelit.TokenTree.from_branches(branches, [text_mask(b) for b in branches], images=images)
    br = as_branches(tree.to_batch())
    for b, ims in enumerate(images):
        got = br.images[b]
        assert (got.digests if got is not None else []) == [im.digest for im in ims]


@pytest.mark.parametrize("partition", ["none", "redundancy_free"])
def test_the_trainers_linear_mode_and_self_verification_with_images(pool, tmp_path_factory, partition):
    """GRPO with rollout log-probs: ``mode=linear`` (per branch, from the records' branches with their
    images) gives the tree mode's loss and gradients, and ``verify`` on the tree module reports them equal."""
    from treelit.lightning.module import TreeLitModule
    from treelit.objectives import make_objective

    path = _path("qwen2_5_vl", tmp_path_factory)
    branches, images = _case(pool)
    masks = [text_mask(b) for b in branches]
    adv = [1.0, -0.5, 0.3, 0.8]

    def batch():
        tree = treelit.TokenTree.from_branches(branches, masks, advantages=adv, images=images)
        tree.source_branches = Branches.build(branches, masks, advantages=adv, images=images)  # as the builders do
        return tree.to_batch()

    out = {}
    with KeepFloat64():
        for mode in ("tree", "linear"):
            model = treelit.load_hf_model(path, dtype=F64, vision=True)
            module = TreeLitModule(model, make_objective("grpo"), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                                   mode=mode, partition=partition, budget_tokens=max(len(b) for b in branches) + 1,
                                   attention="sdpa_dense", old_logprobs="rollout")
            mb = batch()
            module.record_rollout_logprobs([mb])
            res = module.compute_gradients([mb])
            out[mode] = (res["loss"], _grads(model, strip="hf."))
            if mode == "tree":
                check = module.verify(batch_with_old(mb, batch()), module.normalizers([mb]))
    (lt, gt), (ll, gl) = out["tree"], out["linear"]
    assert gt.keys() == gl.keys() and any("visual" in k for k in gt)
    assert abs(lt - ll) <= 1e-10 * abs(ll), (lt, ll)
    assert max_rel_grad_diff(gt, gl, grad_floor(F64), negligible_grad(F64)) <= 1e-10
    assert check["verify/loss_rel_diff"] <= 1e-10 and check["verify/grad_rel_diff"] <= 1e-10, check


def batch_with_old(src, mb):
    """``mb`` with ``src``'s rollout log-probs (tree and branches)."""
    mb.token_old_logp, mb.branch_old_logp = src.token_old_logp, src.branch_old_logp
    mb.source_branches.old = src.source_branches.old
    return mb
