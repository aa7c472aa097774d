"""The image encoder as a step part (treelit.lightning.image_part): the module's step encodes
each micro-batch's distinct images once, whatever the executor cuts the row into, and the loss
and every gradient (the vision tower's included) equal transformers branch by branch (float64,
<= 1e-10) and the library's encode-per-partition path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treelit
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from treelit.lightning.executors import Partitioned, WholeRow
from treelit.lightning.image_part import ImageEncoder
from treelit.lightning.module import TreeLitModule
from treelit.objectives import make_objective
from vision_oracle import (image_processor, load_reference, processed, random_image, span, text_mask,
                           vision_checkpoint, vlm_branch_loss)

pytest.importorskip("transformers")
pytest.importorskip("PIL")

F64 = torch.float64


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = vision_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")
    proc = image_processor()
    rng = np.random.default_rng(0)
    a, b = processed(proc, random_image(rng, 16, 24), name="a"), processed(proc, random_image(rng, 24, 16), name="b")
    # image a in every branch (in several partitions once the row is cut), b in one
    branches = [[1] + span(a) + [3, 4, 5, 6, 7], [1] + span(a) + [6, 7, 2, 9], [1] + span(a) + [3, 8] + span(b) + [9],
                [1] + span(a) + [3, 4, 8, 8, 2, 3]]
    images = [[a], [a], [a, b], [a]]
    return path, branches, images


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("partition", ["none", "redundancy_free"])
def test_the_step_encodes_each_image_once_and_equals_transformers(vlm, partition):
    path, branches, images = vlm
    masks = [text_mask(b) for b in branches]
    weights = [1.0, 0.5, 2.0, 1.5]
    ours = treelit.load_hf_model(path, dtype=F64, vision=True)
    ref = load_reference(path)
    module = TreeLitModule(ours, make_objective("sft"), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                           partition=partition, budget_tokens=max(len(b) for b in branches) + 1, attention="sdpa_dense")
    assert isinstance(module.parts[0], ImageEncoder)
    batch = treelit.TokenTree.from_branches(branches, masks, weights, images=images).to_batch()
    with KeepFloat64():
        expected = vlm_branch_loss(ref, branches, images, masks, weights)
        expected.backward()
        theirs = _grads(ref)
        before = ours.vision.images_encoded
        out = module.compute_gradients([batch])
        encoded = ours.vision.images_encoded - before
        mine = _grads(ours, strip="hf.")
    assert type(module.executor) is (Partitioned if partition != "none" else WholeRow)
    if partition != "none":
        assert module.last_partition_stats.partitions > 2, "the budget cut nothing"
    assert encoded == batch.images.num_images == 2  # once per micro-batch, not once per partition
    assert batch.image_embeds is None  # handed to the passes for this micro-batch only
    assert mine.keys() == theirs.keys() and any("visual" in k for k in mine)
    assert sum(float(g.norm()) for k, g in mine.items() if "visual" in k) > 0
    assert abs(out["loss"] - expected.item()) <= 1e-10 * abs(expected.item()), (out["loss"], expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10


def test_no_gradient_reads_use_the_encoded_rows_and_a_frozen_tower_runs_no_backward(vlm):
    """Rollout log-probs through the partitioned executor (no gradient): each image encoded once,
    equal to the library's unpartitioned log-probs; a frozen tower trains the language model only."""
    from treelit.loss.tree import tree_token_logprobs

    path, branches, images = vlm
    ours = treelit.load_hf_model(path, dtype=F64, vision=True, freeze_vision=True)
    module = TreeLitModule(ours, make_objective("grpo"), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                           partition="redundancy_free", budget_tokens=max(len(b) for b in branches) + 1,
                           attention="sdpa_dense", old_logprobs="rollout")
    batch = treelit.TokenTree.from_branches(branches, [text_mask(b) for b in branches],
                                            advantages=[1.0, -0.5, 0.3, 0.8], images=images).to_batch()
    with KeepFloat64():
        before = ours.vision.images_encoded
        module.record_rollout_logprobs([batch])
        assert ours.vision.images_encoded - before == 2
        with torch.no_grad():
            sel, lp, _ = tree_token_logprobs(ours, batch, "sdpa_dense")
        torch.testing.assert_close(batch.token_old_logp[sel], lp.double(), rtol=1e-12, atol=1e-12)
        module.compute_gradients([batch])
    grads = _grads(ours, strip="hf.")
    assert grads and not any("visual" in k for k in grads)
