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
    assert not batch.image_embeds  # handed to the passes for this micro-batch only
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


def _critic_oracle():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "critic_oracle", Path(__file__).resolve().parents[1] / "objectives" / "test_critic.py")
    C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(C)
    return C


def _perturb(pairs, seed):
    """The same small change to each (ours, transformers') parameter pair: the update moved them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a, b in pairs:
            d = 0.02 * torch.randn(a.shape, generator=g, dtype=F64)
            a.add_(d)
            b.add_(d)


@pytest.mark.parametrize("partition", ["none", "redundancy_free"])
def test_a_separate_critic_sees_the_images_through_its_own_tower(vlm, tmp_path_factory, monkeypatch, partition):
    """critic=separate on a vision model: the critic's trunk (a vision model of its own) encodes
    the images with its own tower, which its value loss trains. Values, GAE, the clipped policy
    and value losses and every gradient (both towers, both language models, the head) equal the
    per-branch reference of tests/objectives/test_critic.py on two transformers models, each
    branch with its images (float64 1e-10); each tower encodes each image once per micro-batch."""
    from treelit.models.critic import Critic
    from vision_oracle import IMAGE

    C = _critic_oracle()
    path, branches, images = vlm
    critic_path = vision_checkpoint(tmp_path_factory.mktemp("critic"), "qwen2_5_vl", seed=1)
    ours, hf = treelit.load_hf_model(path, dtype=F64, vision=True), load_reference(path)
    trunk, hf_trunk = treelit.load_hf_model(critic_path, dtype=F64, vision=True), load_reference(critic_path)
    images_of = {tuple(b): ims for b, ims in zip(branches, images)}

    def hidden(model, ids):  # transformers' final hidden states of one branch with its images
        x = torch.tensor([list(ids)])
        ims = images_of[tuple(ids)]
        model.model.rope_deltas = None
        return model.model(input_ids=x, pixel_values=torch.cat([i.pixel_values for i in ims]),
                           image_grid_thw=torch.tensor([list(i.grid_thw) for i in ims]),
                           mm_token_type_ids=(x == IMAGE).int()).last_hidden_state[0]

    monkeypatch.setattr(C, "_hidden", hidden)
    monkeypatch.setattr(C, "output_weight", lambda m: hf.lm_head.weight)
    torch.manual_seed(0)
    critic = Critic("separate", 32, trunk, vf_coef=C.VF, value_clip=C.VCLIP, dtype=F64, init_std=0.3)
    ref_critic = Critic("separate", 32, hf_trunk, vf_coef=C.VF, value_clip=C.VCLIP, dtype=F64)
    ref_critic.head.load_state_dict(critic.head.state_dict())
    masks = [text_mask(b) for b in branches]
    weights = [1.0, 0.5, 2.0, 1.5]
    rewards = [[0.0] * (len(b) - 1) + [r] for b, r in zip(branches, [1.0, -0.5, 0.3, 0.8])]
    objective = make_objective("ppo", clip_low=C.CLIP, gamma=C.GAMMA, lam=C.LAM)
    module = TreeLitModule(ours, objective, optimizer=lambda p: torch.optim.SGD(p, lr=0.0), critic=critic,
                           partition=partition, budget_tokens=max(len(b) for b in branches) + 1, attention="sdpa_dense")
    assert [type(p).__name__ for p in module.parts if isinstance(p, ImageEncoder)] == ["ImageEncoder"] * 2
    with KeepFloat64():
        with torch.no_grad():
            old = [C.ref_branch(hf, ref_critic, ids) for ids in branches]
        old_lp, old_v = [lp for lp, _ in old], [v.tolist() for _, v in old]
        batch = treelit.TokenTree.from_branches(
            branches, masks, weights, branch_fields={"reward": [r[-1] for r in rewards],
                                                     "token_rewards": [list(r) for r in rewards]},
            old_logprobs=[[None] + lp.tolist() for lp in old_lp], images=images).to_batch()
        for part in module.parts:  # values and GAE advantages, as the step does before its first update
            part.before_updates(module.executor, [batch], module._read_step())
        _perturb([(p, dict(hf.named_parameters())[n[3:]]) for n, p in ours.named_parameters()]
                 + [(p, dict(hf_trunk.named_parameters())[n[3:]]) for n, p in trunk.named_parameters()], 5)
        for m in (ours, trunk, critic, hf, hf_trunk, ref_critic):
            m.zero_grad(set_to_none=True)
        before = (ours.vision.images_encoded, trunk.vision.images_encoded)
        module.compute_gradients([batch])
        assert (ours.vision.images_encoded - before[0], trunk.vision.images_encoded - before[1]) == (2, 2)
        mine = {**_grads(ours, strip="hf."), **{"trunk." + k: v for k, v in _grads(trunk, strip="hf.").items()},
                **_grads(critic.head)}
        expected = C.reference(hf, ref_critic, branches, masks, weights, rewards, old_lp, old_v, "token-mean")
        expected.backward()
        theirs = {**_grads(hf), **{"trunk." + k: v for k, v in _grads(hf_trunk).items()}, **_grads(ref_critic.head)}
    assert expected.item() != 0 and mine.keys() == theirs.keys()
    assert any(k.startswith("trunk.") and "visual" in k for k in mine)
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10


@pytest.mark.parametrize("tower", ["trained", "frozen"])
@pytest.mark.parametrize("partition", ["none", pytest.param("redundancy_free", marks=pytest.mark.slow)])
def test_lora_on_the_language_model_with_the_tower_trained_or_frozen(vlm, tower, partition):
    """LoRA adapters on the language model; the tower trained in full (``model.lora.modules_to_save:
    [visual]``, PEFT's trained copy) or frozen (``model.freeze_vision``). The module's step gives
    the adapters' and the tower copy's gradients of transformers + PEFT with the same adapters run
    branch by branch (float64 1e-10)."""
    import peft

    from treelit.models.lora import apply_lora

    path, branches, images = vlm
    trained = tower == "trained"
    ours = treelit.load_hf_model(path, dtype=F64, vision=True, freeze_vision=not trained)
    torch.manual_seed(0)
    apply_lora(ours, {"rank": 4, "alpha": 8, "init": False, "modules_to_save": ["visual"] if trained else []})
    names = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert any("visual.modules_to_save" in n for n in names) == trained
    assert all(".lora_" not in n or "language_model" in n for n in names)
    ref = load_reference(path)
    peft.inject_adapter_in_model(ours.treelit_lora_config, ref, adapter_name="default")
    ref.load_state_dict({k[len("hf."):]: v for k, v in ours.state_dict().items()}, strict=True)
    ref.to(F64)
    for n, p in ref.named_parameters():
        p.requires_grad_(".lora_" in n or ".modules_to_save." in n)
    masks = [text_mask(b) for b in branches]
    weights = [1.0, 2.0, 0.5, 1.0]
    module = TreeLitModule(ours, make_objective("sft"), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                           partition=partition, budget_tokens=max(len(b) for b in branches) + 1, attention="sdpa_dense")
    batch = treelit.TokenTree.from_branches(branches, masks, weights, images=images).to_batch()
    with KeepFloat64():
        expected = vlm_branch_loss(ref, branches, images, masks, weights)
        expected.backward()
        theirs = _grads(ref)
        before = ours.vision.images_encoded
        out = module.compute_gradients([batch])
        assert ours.vision.images_encoded - before == 2
        mine = _grads(ours, strip="hf.")
    assert mine.keys() == theirs.keys() and len(mine) == len(names)
    assert any("visual" in k for k in mine) == trained
    assert abs(out["loss"] - expected.item()) <= 1e-10 * abs(expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10
