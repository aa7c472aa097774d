"""Images with the rest of training: RL objectives and LoRA on the language model exact against
transformers branch by branch (float64 <= 1e-10); what does not run with images yet (context
parallelism) refused by option before training, one line each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import test_hf_hybrid_objectives as objectives_oracle
import treelit
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from test_hf_hybrid_objectives import OBJECTIVE_CASES, reference_loss
from test_hf_vision import _fixed_cases, models, pool  # noqa: F401 - the pool fixture
from treelit.objectives import make_objective
from vision_oracle import IMAGE, text_mask

pytest.importorskip("transformers")

F64 = torch.float64


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _vlm_logprobs(images_of):
    """``branch_logprobs`` of the objectives' oracle for branches with images (looked up by ids)."""
    def branch_logprobs(hf, ids):
        x = torch.tensor([list(ids)])
        ims = images_of[tuple(ids)]
        kw = {}
        if ims:
            kw = dict(pixel_values=torch.cat([i.pixel_values for i in ims]),
                      image_grid_thw=torch.tensor([list(i.grid_thw) for i in ims]), mm_token_type_ids=(x == IMAGE).int())
        hf.model.rope_deltas = None
        logp_all = torch.log_softmax(hf(input_ids=x, **kw).logits[0], -1)[:-1]
        return logp_all.gather(1, x[0, 1:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)
    return branch_logprobs


@pytest.mark.parametrize("case", ["grpo", pytest.param("ppo", marks=pytest.mark.slow),
                                  pytest.param("gspo", marks=pytest.mark.slow)])
def test_rl_objectives_with_images_equal_transformers_branch_by_branch(case, pool, tmp_path_factory, monkeypatch):  # noqa: F811
    branches, images = _fixed_cases(pool)["fork_after_image"]
    images_of = {tuple(b): ims for b, ims in zip(branches, images)}
    monkeypatch.setattr(objectives_oracle, "branch_logprobs", _vlm_logprobs(images_of))
    ours, hf = models("qwen2_5_vl", tmp_path_factory)
    spec = OBJECTIVE_CASES[case]
    masks = [text_mask(b) for b in branches]
    weights = [1.0, 0.5, 2.0]
    rng = np.random.default_rng(0)
    with KeepFloat64():
        offsets, old, ref = {}, [], []
        with torch.no_grad():  # rollout log-probs near the model's own, agreeing on shared prefixes
            for ids in branches:
                lp, _ = objectives_oracle.branch_logprobs(hf, ids)
                o, r = [None], [None]
                for t in range(1, len(ids)):
                    key = tuple(ids[: t + 1])
                    offsets.setdefault(key, (float(rng.normal(0, 0.3)), float(rng.normal(0, 0.5))))
                    o.append(min(float(lp[t - 1]) + offsets[key][0], -1e-3))
                    r.append(min(float(lp[t - 1]) + offsets[key][1], -1e-3))
                old.append(o)
                ref.append(r)
        adv = [1.0, -0.7, 0.4]
        data = (branches, masks, weights, adv, old, ref)
        aggregation = objectives_oracle.AGGREGATION[case]
        hf.zero_grad(set_to_none=True)
        expected = reference_loss(hf, spec, data, aggregation)
        expected.backward()
        theirs = _grads(hf)
        tree = treelit.TokenTree.from_branches(branches, masks, weights, advantages=adv, old_logprobs=old,
                                               ref_logprobs=ref, images=images)
        obj = make_objective(spec["name"], **{k: v for k, v in spec.items() if k != "name"})
        ours.zero_grad(set_to_none=True)
        loss = treelit.tree_loss(ours, tree, aggregation, "segment", objective=obj)
        loss.backward()
        mine = _grads(ours, strip="hf.")
    assert expected.item() != 0 and any("visual" in k for k in mine)
    assert mine.keys() == theirs.keys()
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item()), (loss.item(), expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10


def test_lora_on_the_language_model_with_images(pool, tmp_path_factory):  # noqa: F811
    """LoRA adapters go into the language model only (the tower frozen); the tree's adapter
    gradients equal transformers' with the same adapters, branch by branch."""
    import peft

    from test_hf_vision import _CACHE
    from treelit.models.lora import apply_lora
    from vision_oracle import load_reference, vlm_branch_loss

    path = _CACHE.get("qwen2_5_vl") or models("qwen2_5_vl", tmp_path_factory) and _CACHE["qwen2_5_vl"]
    ours = treelit.load_hf_model(path, dtype=F64, vision=True)
    torch.manual_seed(0)
    apply_lora(ours, {"rank": 4, "alpha": 8, "init": False})
    names = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n and "language_model" in n for n in names)
    ref = load_reference(path)
    peft.inject_adapter_in_model(ours.treelit_lora_config, ref, adapter_name="default")
    ref.load_state_dict({k[len("hf."):]: v for k, v in ours.state_dict().items()}, strict=True)
    ref.to(F64)
    for n, p in ref.named_parameters():
        p.requires_grad_(".lora_" in n)
    branches, images = _fixed_cases(pool)["last_shared"]
    masks = [text_mask(b) for b in branches]
    weights = [1.0, 2.0, 0.5]
    with KeepFloat64():
        expected = vlm_branch_loss(ref, branches, images, masks, weights)
        expected.backward()
        theirs = _grads(ref)
        loss = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, weights, images=images),
                                 "token-mean", "sdpa_dense")
        loss.backward()
        mine = _grads(ours, strip="hf.")
    assert mine.keys() == theirs.keys() and len(mine) == len(names)
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10


# -- refusals -----------------------------------------------------------------------------------------
def _cfg(**over):
    base = {"mode": "tree", "verify_every": 0, "partition": {"name": "none"}, "critic": {"kind": "none"},
            "trainer": {"strategy": "auto"}, "model": {"vision": True}}
    for k, v in over.items():
        base[k] = v
    return OmegaConf.create(base)


@pytest.mark.parametrize("over,match", [
    ({"critic": {"kind": "separate", "model": "hf_auto"}},
     "critic.model=hf_auto with model.vision=true: critic=separate reads the images through a vision tower of its own"),
    ({"model": {"vision": True, "freeze_vision": True, "lora": {"rank": 4, "modules_to_save": ["visual"]}}},
     r"model.freeze_vision=true with model.lora.modules_to_save=\['visual'\]: the one freezes the vision tower"),
])
def test_what_does_not_run_with_images_is_refused_by_option(over, match):
    from treelit.cli.config import ConfigError
    from treelit.cli.model_option_checks import check_vision_options

    check_vision_options(_cfg())  # the plain tree run passes (judged from the options: no model is built)
    with pytest.raises(ConfigError, match=match):
        check_vision_options(_cfg(**over))


def test_rows_with_images_need_a_vision_model(pool):  # noqa: F811
    branches, images = _fixed_cases(pool)["fork_after_image"]
    tree = treelit.TokenTree.from_branches(branches, [text_mask(b) for b in branches], images=images)
    text_model = treelit.build_model("qwen2_tiny", vocab_size=40, max_seq_len=64)
    with pytest.raises(treelit.TreeInputError, match="the row has images and this model has no vision tower"):
        treelit.tree_loss(text_model, tree)
    from treelit.cli.model_option_checks import check_vision_options

    # the per-branch baseline and self-verification run with images (tests/models/test_hf_vision_linear.py)
    check_vision_options(_cfg(mode="linear"))
    check_vision_options(_cfg(verify_every=5))
    # partitioning and a critic, shared or separate (its own copy of the policy's model), run with images
    check_vision_options(_cfg(partition={"name": "redundancy_free"}, critic={"kind": "shared"}))
    check_vision_options(_cfg(partition={"name": "redundancy_free"}, critic={"kind": "separate", "model": "policy"}))
    # context parallelism's degree is no refusal of its own
    check_vision_options(_cfg(trainer={"strategy": {"_target_": "x.Strategy", "context_parallel_degree": 2}}))


@pytest.mark.parametrize("trainer", [
    {"strategy": {"_target_": "treelit.lightning.strategies.DDP"}, "devices": 2, "num_nodes": 1},
    {"strategy": {"_target_": "treelit.lightning.strategies.FSDP2", "context_parallel_degree": 1}, "devices": 2},
    {"strategy": {"_target_": "treelit.lightning.strategies.FSDP2", "replicate_degree": 2}, "devices": 2,
     "num_nodes": 2},
])
def test_images_run_on_several_processes(trainer):
    """DDP, FSDP2 and HSDP run images (exact against one process: tests/distributed/test_vision_parallel.py)."""
    from treelit.cli.model_option_checks import check_vision_options

    check_vision_options(_cfg(trainer=trainer, partition={"name": "redundancy_free"}))
    # LoRA on the language model with the tower trained in full (PEFT's copy), or frozen
    check_vision_options(_cfg(trainer=trainer, model={"vision": True, "lora": {"rank": 4, "modules_to_save": ["visual"]}}))
    check_vision_options(_cfg(trainer=trainer, model={"vision": True, "freeze_vision": True, "lora": {"rank": 4}}))


def test_shared_critic_with_images(pool, tmp_path_factory, monkeypatch):  # noqa: F811
    """PPO with a shared critic (a value head on the policy's trunk) on a tree with images: the
    values, GAE per (branch, action), the clipped policy and value losses and every gradient equal
    the per-branch reference of tests/objectives/test_critic.py run on transformers branch by branch
    with each branch's images (float64 1e-10)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "critic_oracle", Path(__file__).resolve().parents[1] / "objectives" / "test_critic.py")
    C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(C)
    from treelit.models.critic import Critic
    from treelit.objectives.critic import critic_tree_loss, prepare_tree, set_tree_advantages, tree_values
    from treelit.rl.gae import whiten

    ours, hf = models("qwen2_5_vl", tmp_path_factory)
    branches, images = _fixed_cases(pool)["fork_after_image"]
    images_of = {tuple(b): ims for b, ims in zip(branches, images)}
    masks = [text_mask(b) for b in branches]
    weights = [1.0, 0.5, 2.0]
    rewards = [[0.0] * (len(b) - 1) + [r] for b, r in zip(branches, [1.0, -0.5, 0.3])]

    def hidden(model, ids):  # transformers' final hidden states of one branch with its images
        x = torch.tensor([list(ids)])
        ims = images_of[tuple(ids)]
        hf.model.rope_deltas = None
        return hf.model(input_ids=x, pixel_values=torch.cat([i.pixel_values for i in ims]),
                        image_grid_thw=torch.tensor([list(i.grid_thw) for i in ims]),
                        mm_token_type_ids=(x == IMAGE).int()).last_hidden_state[0]

    monkeypatch.setattr(C, "_hidden", hidden)
    monkeypatch.setattr(C, "output_weight", lambda m: hf.lm_head.weight)
    torch.manual_seed(0)
    critic = Critic("shared", hf.lm_head.weight.shape[1], None, vf_coef=C.VF, value_clip=C.VCLIP, dtype=F64,
                    init_std=0.3)
    with KeepFloat64():
        with torch.no_grad():
            old = [C.ref_branch(hf, critic, ids) for ids in branches]
        old_lp, old_v = [lp for lp, _ in old], [v.tolist() for _, v in old]
        tree = treelit.TokenTree.from_branches(
            branches, masks, weights, branch_fields={"reward": [r[-1] for r in rewards],
                                                     "token_rewards": [list(r) for r in rewards]},
            old_logprobs=[[None] + lp.tolist() for lp in old_lp], images=images)
        batch = tree.to_batch()
        values = tree_values(critic, ours, batch)
        pairs = prepare_tree(batch, values, C.GAMMA, C.LAM)
        act = pairs.adv[pairs.action]
        (adv,) = whiten([pairs.adv], (len(act), act.sum(), (act * act).sum()))
        set_tree_advantages(batch, pairs, adv)
        objective = make_objective("ppo", clip_low=C.CLIP, gamma=C.GAMMA, lam=C.LAM)
        Z = batch.norm_contribution("token-mean")
        for m in (ours, hf, critic):
            m.zero_grad(set_to_none=True)
        loss = critic_tree_loss(objective, critic, ours, batch, aggregation="token-mean", normalizer=Z)[0]
        loss.backward()
        mine, mine_head = _grads(ours, strip="hf."), _grads(critic)
        expected = C.reference(hf, critic, branches, masks, weights, rewards, old_lp, old_v, "token-mean")
        expected.backward()
        theirs, theirs_head = _grads(hf), _grads(critic)
    assert expected.item() != 0 and mine.keys() == theirs.keys() and mine_head.keys() == theirs_head.keys()
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item()), (loss.item(), expected.item())
    assert max_rel_grad_diff({**mine, **mine_head}, {**theirs, **theirs_head}, grad_floor(F64),
                             negligible_grad(F64)) <= 1e-10
