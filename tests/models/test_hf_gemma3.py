"""Gemma-3 with its vision tower: bidirectional image blocks in the tree mask, exact per branch.

Tree mode against transformers' Gemma-3 run branch by branch with its images and token types
(its own mask: causal OR same image block, and the sliding window on top in the local layers).
A tiny random checkpoint (``vision_oracle``: a SigLIP tower, 4 tokens per image, a sliding
layer of window 3 - shorter than an image block - and a global one); the loss and every
parameter gradient in float64 agree to 1e-10 with transformers' float32 upcasts kept in
float64. The tokens of one image block see each other; backends that cannot express that are
refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treelit
from float64_mode import KeepFloat64
from test_hf_vision import compare, models
from vision_oracle import END, IMAGE, START, gemma3_processed, random_forest, random_image, span, text_mask

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

F64 = torch.float64


@pytest.fixture(scope="module")
def pool():
    rng = np.random.default_rng(0)
    a, b, c = random_image(rng, 16, 16), random_image(rng, 16, 16), random_image(rng, 24, 16)
    return {"a": gemma3_processed(a, name="a"), "b": gemma3_processed(b, name="b"),
            "a2": gemma3_processed(a.copy(), name="a2"), "c": gemma3_processed(c, name="c")}


def _cases(pool):
    a, b, c = pool["a"], pool["b"], pool["c"]
    return {
        "fork_after_image": ([[1] + span(a) + [3, 4, 5], [1] + span(a) + [6, 7],
                              [1] + span(a) + [3, 8] + span(c) + [9]], [[a], [a], [a, c]]),
        "last_shared": ([[1, 2] + span(a) + [3], [1, 2] + span(a) + [4, 5], [1, 2] + span(b) + [6]], [[a], [a], [b]]),
        "image_ends_shared": ([[1] + span(c) + [2, 3], [1] + span(c)[:-1] + [9, 4]], [[c], [c]]),
    }


def test_tree_equals_transformers_branch_by_branch(pool, tmp_path_factory):
    """Default suite: a fork right after a shared image, a second image on one branch; and the
    blocks matter: the same model with a causal mask inside the blocks gives another loss."""
    branches, images = _cases(pool)["fork_after_image"]
    tree, ours = compare("gemma3", branches, images, tmp_path_factory)
    from treelit.models import hf_gemma3

    masks = [text_mask(b) for b in branches]
    causal = lambda batch: torch.arange(batch.num_tokens, device=batch.device)  # noqa: E731
    with KeepFloat64(), torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        with_blocks = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, images=images)).item()
        mp.setattr(hf_gemma3, "image_blocks", causal)
        without = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, images=images)).item()
    assert abs(with_blocks - without) > 1e-6 * abs(with_blocks)


def test_image_blocks_of_a_row(pool):
    """Each image token's block starts at the image's first token; text tokens are their own."""
    from treelit.models.hf_gemma3 import image_blocks

    a, b = pool["a"], pool["b"]
    batch = treelit.TokenTree.from_branches([[1] + span(a) + [2], [1] + span(b) + [3]], images=[[a], [b]]).to_batch()
    start = image_blocks(batch)
    ids = batch.input_ids
    for i in range(batch.num_tokens):
        j = i  # the first image token of the run of image tokens on i's path
        while int(ids[j]) == IMAGE and int(ids[batch.parent[j]]) == IMAGE:
            j = int(batch.parent[j])
        assert int(start[i]) == j
    assert int((start != torch.arange(batch.num_tokens)).sum()) == 2 * (a.num_tokens - 1)


def test_adjacent_images_and_cut_blocks_are_refused(pool):
    from treelit.models.hf_gemma3 import image_blocks

    a, b = pool["a"], pool["b"]
    glued = treelit.TokenTree.from_branches([[1, START] + [IMAGE] * 8 + [END]], images=[[a, b]]).to_batch()
    with pytest.raises(ValueError, match="two images with no token between them form one bidirectional block"):
        image_blocks(glued)
    row = treelit.TokenTree.from_branches([[1] + span(a) + [2]], images=[[a]]).to_batch()
    with pytest.raises(ValueError, match="ends past this row part"):
        image_blocks(row.subset(torch.arange(4)))
    with pytest.raises(ValueError, match="starts before this row part"):
        image_blocks(row.subset(torch.arange(4, row.num_tokens)))


def test_backends_without_blocks_are_refused_by_name(pool, tmp_path_factory):
    branches, images = _cases(pool)["fork_after_image"]
    ours, _ = models("gemma3", tmp_path_factory)
    tree = treelit.TokenTree.from_branches(branches, [text_mask(b) for b in branches], images=images)
    with pytest.raises(ValueError, match="attention backend 'segment' cannot attend bidirectionally inside a block"):
        treelit.tree_loss(ours, tree, attention="segment")


def test_flex_mask_takes_the_image_blocks(pool, tmp_path_factory, monkeypatch):
    """flex's mask_mod and block bounds read the widened intervals as they are: its forward
    (eager FlexAttention: forward only off CUDA) gives transformers' per-branch loss, with
    blocks of 8 so that block pairs are skipped, partial and full."""
    from treelit.attention.flex import FlexTreeAttention
    from vision_oracle import vlm_branch_loss

    monkeypatch.setattr(FlexTreeAttention, "requires_cuda", False)
    flex = FlexTreeAttention(block_size=8, compile=False)
    rng = np.random.default_rng(1)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["c"]], n_branches=5)
    masks, weights = [text_mask(b) for b in branches], [1.0 + 0.5 * (i % 3) for i in range(len(branches))]
    ours, ref = models("gemma3", tmp_path_factory)
    tree = treelit.TokenTree.from_branches(branches, masks, weights, images=images)
    assert tree.num_tokens > 3 * 8
    with KeepFloat64(), torch.no_grad():
        expected = vlm_branch_loss(ref, branches, images, masks, weights).item()
        got = treelit.tree_loss(ours, tree, "token-mean", flex).item()
    assert abs(got - expected) <= 1e-10 * abs(expected), (got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["last_shared", "image_ends_shared"])
def test_fixed_cases(case, pool, tmp_path_factory):
    branches, images = _cases(pool)[case]
    compare("gemma3", branches, images, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_forests_whole_and_partitioned(seed, pool, tmp_path_factory):
    rng = np.random.default_rng(seed)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["a2"], pool["c"]], n_branches=5)
    aggregation = ("token-mean", "seq-mean-token-mean", "sum")[seed]
    compare("gemma3", branches, images, tmp_path_factory, aggregation=aggregation)
    compare("gemma3", branches, images, tmp_path_factory, budget=max(len(b) for b in branches) + 2)


@pytest.mark.slow
def test_images_a_few_at_a_time_and_a_frozen_tower(pool, tmp_path_factory):
    rng = np.random.default_rng(3)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["c"]], n_branches=5)
    compare("gemma3", branches, images, tmp_path_factory, per_pass=1)
    compare("gemma3", branches, images, tmp_path_factory, freeze_vision=True)


def test_span_markers_are_gemma3s(tmp_path_factory):
    ours, _ = models("gemma3", tmp_path_factory)
    cfg = ours.hf.config
    assert (cfg.boi_token_index, cfg.image_token_id, cfg.eoi_token_index) == (START, IMAGE, END)
    assert ours.vision.image_token_id == IMAGE
