"""Vision-language checkpoints in tree mode against transformers + the image processor, branch by branch.

Families (tiny random configs saved locally): Qwen2.5-VL (windowed tower), Qwen3-VL (deepstack
features into the first text layers, interleaved M-RoPE), Qwen3.5 (vision tower + Gated DeltaNet
hybrid). The loss and every parameter gradient - language model, projector (the patch merger),
vision tower - in float64 agree to 1e-10 with transformers' float32 upcasts kept in float64 on
both sides (``KeepFloat64``). Cases: two screenshots with the same placeholder ids (never merged),
identical screenshots (merged, encoded once), a fork inside the text right after an image, an
image as the last shared token, random forests with shared and distinct images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treelit
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from treelit.partition.engine import PartitionStats
from vision_oracle import (END, IMAGE, START, image_processor, load_reference, processed, random_forest,
                           random_image, span, text_mask, vision_checkpoint, vlm_branch_loss)

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

F64 = torch.float64
_CACHE = {}


def models(family, tmp_path_factory, freeze_vision=False, per_pass=0):
    key = (family, freeze_vision, per_pass)
    if key not in _CACHE:
        path = _CACHE.get(family) or vision_checkpoint(tmp_path_factory.mktemp(family), family)
        _CACHE[family] = path
        ours = treelit.load_hf_model(path, dtype=F64, vision=True, freeze_vision=freeze_vision,
                                     vision_images_per_pass=per_pass)
        _CACHE[key] = (ours, load_reference(path))
    return _CACHE[key]


@pytest.fixture(scope="module")
def pool():
    """Screenshots: a, b (same size as a: the same placeholder ids), a copy of a, c (another size)."""
    proc = image_processor()
    rng = np.random.default_rng(0)
    a, b, c = random_image(rng, 16, 24), random_image(rng, 16, 24), random_image(rng, 24, 16)
    return {"a": processed(proc, a, name="a"), "b": processed(proc, b, name="b"),
            "a2": processed(proc, a.copy(), name="a2"), "c": processed(proc, c, name="c")}


def tower(name: str) -> bool:
    """Whether a parameter is the vision tower's or its projector's (Qwen: ``visual``; Gemma-3:
    ``vision_tower`` and ``multi_modal_projector``)."""
    return any(t in name for t in ("visual", "vision_tower", "multi_modal_projector"))


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def compare(family, branches, images, tmp_path_factory, weights=None, aggregation="token-mean",
            attention="sdpa_dense", freeze_vision=False, per_pass=0, budget=None):
    """Tree loss and gradients vs transformers branch by branch; returns (tree, our model)."""
    masks = [text_mask(b) for b in branches]
    weights = weights or [1.0 + 0.5 * (i % 3) for i in range(len(branches))]
    ours, ref = models(family, tmp_path_factory, freeze_vision, per_pass)
    for n, p in ref.named_parameters():
        if tower(n):
            p.requires_grad_(not freeze_vision)
    tree = treelit.TokenTree.from_branches(branches, masks, weights, images=images)
    with KeepFloat64():
        ref.zero_grad(set_to_none=True)
        expected = vlm_branch_loss(ref, branches, images, masks, weights, aggregation)
        expected.backward()
        theirs = _grads(ref)
        ours.zero_grad(set_to_none=True)
        before = ours.vision.images_encoded
        if budget is None:
            loss = treelit.tree_loss(ours, tree, aggregation, attention)
            loss.backward()
            value = loss.item()
        else:
            stats = PartitionStats()
            value = treelit.tree_backward(ours, tree, aggregation, "redundancy_free", budget, attention=attention,
                                          stats=stats)
            assert stats.partitions > 1, "the budget cut nothing"
        mine = _grads(ours, strip="hf.")
    if budget is None:
        assert ours.vision.images_encoded - before == tree.images.num_images  # each distinct image once
    else:  # once per partition that shows it
        assert tree.images.num_images <= ours.vision.images_encoded - before
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))
    assert any(tower(k) for k in mine) != freeze_vision
    assert expected.item() > 0  # the example trains something
    if not freeze_vision:
        assert sum(float(g.norm()) for k, g in mine.items() if tower(k)) > 0
    assert abs(value - expected.item()) <= 1e-10 * abs(expected.item()), (value, expected.item())
    err = max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64))
    assert err <= 1e-10, f"{family}: max relative gradient difference {err:.2e}"
    return tree, ours


def test_distinct_screenshots_with_equal_placeholder_ids_never_merge(pool, tmp_path_factory):
    """Screenshots a and b have the same size, hence the same placeholder ids: the tree must keep
    their spans apart (keyed by content), and the loss and gradients match per-branch training.
    Keyed by token id alone, the b branch would merge into the a branch and train on a's pixels."""
    a, b = pool["a"], pool["b"]
    assert span(a) == span(b) and a.digest != b.digest
    branches = [[1, 2] + span(a) + [3, 4], [1, 2] + span(b) + [3, 4]]
    tree, _ = compare("qwen2_5_vl", branches, [[a], [b]], tmp_path_factory)
    assert tree.num_tokens == 3 + 2 * (len(span(a)) - 1 + 2)  # only [1, 2, <vision start>] is shared
    assert tree.images.num_images == 2


def test_identical_screenshots_merge_and_are_encoded_once(pool, tmp_path_factory):
    a, a2 = pool["a"], pool["a2"]
    assert a is not a2 and a.digest == a2.digest
    branches = [[1, 2] + span(a) + [3, 4], [1, 2] + span(a2) + [5]]
    tree, _ = compare("qwen2_5_vl", branches, [[a], [a2]], tmp_path_factory)
    assert tree.num_tokens == 2 + len(span(a)) + 3
    assert tree.images.num_images == 1


def _fixed_cases(pool):
    a, b, c = pool["a"], pool["b"], pool["c"]
    fork_after_image = ([[1] + span(a) + [3, 4, 5], [1] + span(a) + [6, 7], [1] + span(a) + [3, 8] + span(c) + [9]],
                        [[a], [a], [a, c]])
    # the image's last token (the end marker) is the last shared one; and an image token itself last shared
    last_shared = ([[1, 2] + span(a) + [3], [1, 2] + span(a) + [4, 5], [1, 2] + span(b) + [6]],
                   [[a], [a], [b]])
    image_ends_shared = ([[1] + span(c) + [2, 3], [1] + span(c)[:-1] + [9, 4]], [[c], [c]])
    return {"fork_after_image": fork_after_image, "last_shared": last_shared, "image_ends_shared": image_ends_shared}


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow),
                                    pytest.param("qwen3_5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", ["fork_after_image", pytest.param("last_shared", marks=pytest.mark.slow),
                                  pytest.param("image_ends_shared", marks=pytest.mark.slow)])
def test_tree_equals_transformers_branch_by_branch(family, case, pool, tmp_path_factory):
    branches, images = _fixed_cases(pool)[case]
    compare(family, branches, images, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_forests_with_shared_and_distinct_images(family, seed, pool, tmp_path_factory):
    rng = np.random.default_rng(seed)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["a2"], pool["c"]], n_branches=5)
    compare(family, branches, images, tmp_path_factory, aggregation=("token-mean", "seq-mean-token-mean", "sum")[seed])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_segment_backend(family, pool, tmp_path_factory):
    branches, images = _fixed_cases(pool)["fork_after_image"]
    compare(family, branches, images, tmp_path_factory, attention="segment")


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow),
                                    pytest.param("qwen3_5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_partitioned_rows_with_images(family, extra, pool, tmp_path_factory):
    """Partitions of the longest branch's length plus ``extra`` tokens. Partitions are unions of
    segments and a segment never starts inside an image (branches fork at the first token whose
    content key differs), so every image stays whole in one partition; an image shown in several
    partitions is encoded by each (the tower's gradient is the sum over partitions, as over
    branches); positions are the whole row's. Exact against per-branch training."""
    branches, images = _fixed_cases(pool)["fork_after_image"]
    longest = max(len(b) for b in branches)
    tree, _ = compare(family, branches, images, tmp_path_factory, budget=longest + extra)
    batch = tree.to_batch()
    inner = (batch.image_row >= 0) & ~torch.isin(batch.image_row, batch.images.row_offsets)
    assert not bool(torch.isin(batch.seg_start, torch.nonzero(inner).squeeze(1)).any())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
@pytest.mark.parametrize("seed", [4, 5])
def test_partitioned_random_forests(family, seed, pool, tmp_path_factory):
    rng = np.random.default_rng(seed)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["a2"], pool["c"]], n_branches=5)
    compare(family, branches, images, tmp_path_factory, budget=max(len(b) for b in branches) + 2)


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_images_encoded_a_few_at_a_time(family, pool, tmp_path_factory):
    """model.vision_images_per_pass: the tower runs groups of images, recomputed in the backward;
    the loss and every gradient stay per-branch training's (Qwen3-VL: its deepstack rows too)."""
    rng = np.random.default_rng(3)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["c"]], n_branches=5)
    tree, _ = compare(family, branches, images, tmp_path_factory, per_pass=1)
    assert tree.images.num_images >= 2  # more than one group


@pytest.mark.slow
def test_frozen_vision_tower(pool, tmp_path_factory):
    """model.freeze_vision: the tower has no gradient; the language model's still match."""
    branches, images = _fixed_cases(pool)["last_shared"]
    compare("qwen3_5", branches, images, tmp_path_factory, freeze_vision=True)


def test_mrope_positions_are_each_branchs_own(pool, tmp_path_factory):
    """The row's M-RoPE positions are what the model's get_rope_index gives each branch alone,
    kept on the row; text after an image does not continue at its depth."""
    branches, images = _fixed_cases(pool)["fork_after_image"]
    ours, _ = models("qwen2_5_vl", tmp_path_factory)
    batch = treelit.TokenTree.from_branches(branches, [text_mask(b) for b in branches], images=images).to_batch()
    from treelit.models.hf_vision import mrope_positions

    pos = mrope_positions(ours.vision.vlm, batch)
    assert batch.mrope_position_ids is pos and pos.shape == (3, batch.num_tokens)
    for b, (br, ims) in enumerate(zip(branches, images)):
        ids = torch.tensor([br])
        want, _ = ours.vision.vlm.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(),
                                           image_grid_thw=torch.tensor([list(i.grid_thw) for i in ims]))
        idx = batch.branch_tokens[batch.branch_ptr[b]:batch.branch_ptr[b + 1]]
        assert torch.equal(pos[:, idx], want[:, 0])
    assert not torch.equal(pos[0], batch.position_ids)  # an image advances positions by its grid, not its length


def test_parts_of_parts_keep_their_rows_mrope_positions(pool, tmp_path_factory):
    """A part of a part (context parallelism cuts a partition's row again) has the whole row's
    M-RoPE positions, also where the middle part shows no image (its positions after the image
    are shifted by the image's grid, not its depth); a part of a row of text has the position thrice."""
    from treelit.models.hf_vision import mrope_positions

    a = pool["a"]
    vlm = models("qwen2_5_vl", tmp_path_factory)[0].vision.vlm
    branches = [[1] + span(a) + [2, 3, 4, 5], [1] + span(a) + [2, 6, 7]]
    row = treelit.TokenTree.from_branches(branches, images=[[a], [a]]).to_batch()
    want = mrope_positions(vlm, row).clone()
    row.mrope_position_ids = None
    text = torch.nonzero(torch.arange(row.num_tokens) > int(torch.nonzero(row.image_row >= 0).max())).flatten()
    part = row.subset(text)  # after the image: shows none of it
    assert part.images is None
    inner = part.subset(torch.arange(1, part.num_tokens))
    assert torch.equal(mrope_positions(vlm, inner), want[:, text[1:]])
    assert not torch.equal(want[0, text[1:]], row.position_ids[text[1:]])  # (the shift is there to keep)
    words = treelit.TokenTree.from_branches([[1, 2, 3, 4], [1, 2, 5]]).to_batch()
    cut = torch.tensor([2, 3, 4])
    assert torch.equal(mrope_positions(vlm, words.subset(cut)), mrope_positions(vlm, words)[:, cut])


def test_mrope_disagreement_is_refused(pool, tmp_path_factory):
    """A shared token whose positions differ between branches is an error (not a silent pick)."""
    a = pool["a"]
    ours, _ = models("qwen2_5_vl", tmp_path_factory)
    batch = treelit.TokenTree.from_branches([[1] + span(a) + [2]], images=[[a]]).to_batch()

    class Shifted:  # a position function whose answer depends on the call: two answers for one token
        calls = 0

        def get_rope_index(self, ids, **kw):
            self.calls += 1
            p, d = ours.vision.vlm.get_rope_index(ids, **kw)
            return p + self.calls, d

    from treelit.models.hf_vision import mrope_positions

    two = treelit.TokenTree.from_branches([[1] + span(a) + [2], [1] + span(a) + [3]], images=[[a], [a]]).to_batch()
    with pytest.raises(AssertionError, match="M-RoPE positions of its token 0"):
        mrope_positions(Shifted(), two)
    assert mrope_positions(Shifted(), batch).shape[1] == batch.num_tokens


def test_placeholder_count_must_match_the_images(pool):
    a = pool["a"]
    with pytest.raises(treelit.TreeInputError, match="branch 0: 1 image\\(s\\) need 6 placeholder tokens, the branch has 5"):
        treelit.TokenTree.from_branches([[1, START] + [IMAGE] * 5 + [END]], images=[[a]])


def test_packed_rows_keep_each_distinct_image_once(pool):
    a, b = pool["a"], pool["b"]
    t1 = treelit.TokenTree.from_branches([[1] + span(a) + [2], [1] + span(b) + [3]], images=[[a], [b]]).to_batch()
    t2 = treelit.TokenTree.from_branches([[4] + span(b) + [5]], images=[[b]]).to_batch()
    row = treelit.TreeBatch.pack([t1, t2])
    assert row.images.num_images == 2
    n = a.num_tokens
    b_rows = row.image_row[t1.num_tokens:][row.image_row[t1.num_tokens:] >= 0]
    assert torch.equal(b_rows, t1.image_row[t1.image_row >= n])  # t2's b reads t1's copy of b


def test_a_vision_family_treelit_does_not_check_is_refused_by_name(tmp_path):
    """Qwen2-VL is refused naming its model_type (Gemma-3, once refused here, is a vision family:
    tests/models/test_hf_gemma3.py)."""
    cfg = transformers.AutoConfig.for_model(
        "qwen2_vl", text_config=dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2))
    cfg.save_pretrained(tmp_path)
    from treelit.models.errors import CheckpointError

    with pytest.raises(CheckpointError, match="'model_type' = 'qwen2_vl': Qwen2-VL is not among the vision families"):
        treelit.load_hf_model(tmp_path, vision=True)


def test_freeze_vision_needs_vision(tmp_path):
    from treelit.models.hf_adapter import make_hf_model

    with pytest.raises(ValueError, match="model.freeze_vision needs model.vision=true"):
        make_hf_model(str(tmp_path), freeze_vision=True)
    with pytest.raises(ValueError, match="model.vision_images_per_pass needs model.vision=true"):
        make_hf_model(str(tmp_path), vision_images_per_pass=2)


def test_packed_trees_sharing_an_image_equal_transformers(pool, tmp_path_factory):
    """Two trees packed in one row, both showing screenshot b: b is encoded once for the row, each
    tree's tokens read its rows, and the loss and gradients are per-branch training's."""
    a, b = pool["a"], pool["b"]
    first = ([[1] + span(a) + [2, 3], [1] + span(b) + [4]], [[a], [b]])
    second = ([[5] + span(b) + [6, 7]], [[b]])
    ours, ref = models("qwen2_5_vl", tmp_path_factory)
    branches, images = first[0] + second[0], first[1] + second[1]
    masks = [text_mask(x) for x in branches]
    rows = [treelit.TokenTree.from_branches(br, [text_mask(x) for x in br], images=im).to_batch() for br, im in (first, second)]
    row = treelit.TreeBatch.pack(rows)
    assert row.images.num_images == 2
    with KeepFloat64():
        ref.zero_grad(set_to_none=True)
        expected = vlm_branch_loss(ref, branches, images, masks, [1.0] * 3)
        expected.backward()
        theirs = _grads(ref)
        before = ours.vision.images_encoded
        loss = treelit.tree_loss(ours, row, "token-mean", "sdpa_dense")
        loss.backward()
        mine = _grads(ours, strip="hf.")
    assert ours.vision.images_encoded - before == 2
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10
