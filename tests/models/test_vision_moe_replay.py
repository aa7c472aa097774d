"""Routing replay together with images: a vision MoE's recorded routes, exact on trees.

Tree mode with images and the recorded routing (``model.moe.routing=replay``) == transformers'
vision-language model run branch by branch with its images and each MoE block's top-k replaced
by the given experts (``routing_oracle``; no treelit on that side): loss and every parameter
gradient - vision tower and projector included - in float64 <= 1e-10, with and without the
router loss, whole rows and partitions. The routes cover every token, image placeholders
included (a sampler records them all); branches share image prefixes, so their routes agree there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treelit
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from routing_oracle import per_branch_records, replay_branch_loss, routing_for
from test_hf_vision import _CACHE, _fixed_cases, models, pool  # noqa: F401 - the pool fixture
from treelit.models.factory import set_moe_routing, set_router_aux_loss
from treelit.partition.engine import PartitionStats
from vision_oracle import branch_inputs, load_reference, random_forest, text_mask

pytest.importorskip("transformers")

F64 = torch.float64
MOE_LAYERS = {"qwen3_5_moe": 4, "qwen3_vl_moe": 2, "glm4v_moe": 1}  # GLM-4.5V: its first layer dense
E, K = 8, 2


def _grads(model, strip=""):
    out = {n[len(strip):]: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def compare(family, branches, images, tmp_path_factory, router=None, budget=None, aggregation="token-mean",
            attention="sdpa_dense", seed=0, checkpointing=False):
    """(loss, max gradient) relative differences of the replayed tree vs the replayed branches
    (``checkpointing``: the model's activation checkpointing on, tower and text layers recomputed)."""
    models(family, tmp_path_factory)  # the tiny checkpoint, written once per session
    path = _CACHE[family]
    masks = [text_mask(b) for b in branches]
    weights = [1.0 + 0.5 * (i % 3) for i in range(len(branches))]
    rec = [routing_for(b, MOE_LAYERS[family], K, E, seed=seed) for b in branches]
    ours = treelit.load_hf_model(path, dtype=F64, vision=True)
    set_moe_routing(ours, "replay")
    ours.activation_checkpointing = checkpointing
    set_router_aux_loss(ours, *((router[1], router[0]) if router else (0.0, None)))
    ref = load_reference(path)
    tree = treelit.TokenTree.from_branches(branches, masks, weights, images=images, routed_experts=rec)
    with KeepFloat64():
        expected = replay_branch_loss(ref, branches, masks, weights, per_branch_records(branches, rec), aggregation,
                                      router, inputs=branch_inputs(ref, images))
        expected.backward()
        theirs = _grads(ref)
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
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))
    assert expected.item() != 0 and sum(float(g.norm()) for k, g in theirs.items() if "visual" in k) > 0
    routers = [n for n in theirs if n.endswith("mlp.gate.weight")]
    assert len(routers) == MOE_LAYERS[family] and all(theirs[n].norm() > 0 for n in routers)
    # replay changes the result: the live routing gives another loss
    live = treelit.load_hf_model(path, dtype=F64, vision=True)
    with KeepFloat64(), torch.no_grad():
        other = treelit.tree_loss(live, treelit.TokenTree.from_branches(branches, masks, weights, images=images),
                                  aggregation, attention).item()
    assert abs(other - expected.item()) > 1e-6 * abs(expected.item())
    return abs(value - expected.item()) / abs(expected.item()), max_rel_grad_diff(mine, theirs, grad_floor(F64),
                                                                                   negligible_grad(F64))


@pytest.mark.parametrize("family, router", [("qwen3_5_moe", ("micro_batch", 0.5)),
                                            pytest.param("qwen3_vl_moe", ("sequence", 0.5), marks=pytest.mark.slow),
                                            pytest.param("glm4v_moe", None, marks=pytest.mark.slow)])
def test_replay_with_images_equals_transformers_branch_by_branch(family, router, pool, tmp_path_factory):  # noqa: F811
    """Default suite: the Qwen3.5-MoE-shaped hybrid, images on shared prefixes, the router loss
    of the replayed assignment on."""
    branches, images = _fixed_cases(pool)["fork_after_image"]
    d = compare(family, branches, images, tmp_path_factory, router=router)
    assert max(d) <= 1e-10, d


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_vl_moe", "glm4v_moe"])
@pytest.mark.parametrize("seed", [0, 1])
def test_replay_with_images_on_random_forests_whole_and_partitioned(family, seed, pool, tmp_path_factory):  # noqa: F811
    rng = np.random.default_rng(10 + seed)
    branches, images = random_forest(rng, [pool["a"], pool["b"], pool["a2"], pool["c"]], n_branches=5)
    router = None if family == "glm4v_moe" else (("micro_batch", "sequence")[seed], 0.5)
    for budget in (None, max(len(b) for b in branches) + 2):
        d = compare(family, branches, images, tmp_path_factory, router=router, budget=budget, seed=seed,
                    aggregation=("token-mean", "seq-mean-token-mean")[seed])
        assert max(d) <= 1e-10, (budget, d)


@pytest.mark.slow
@pytest.mark.parametrize("partitioned", [False, True])
def test_replay_with_images_and_activation_checkpointing(partitioned, pool, tmp_path_factory):  # noqa: F811
    """Every layer recomputed in the backward, the routers replaying the pass's records there."""
    branches, images = _fixed_cases(pool)["fork_after_image"]
    budget = max(len(b) for b in branches) + 1 if partitioned else None
    d = compare("qwen3_5_moe", branches, images, tmp_path_factory, router=("micro_batch", 0.5), budget=budget,
                checkpointing=True)
    assert max(d) <= 1e-10, d


@pytest.mark.slow
def test_lora_replay_and_images_on_the_qwen3_5_moe_shape(pool, tmp_path_factory):  # noqa: F811
    """LoRA adapters on the language model (Gated DeltaNet and attention projections; the experts
    stay frozen), the routes replayed, images on shared prefixes: the adapters' gradients equal
    transformers' with the same adapters and routes, branch by branch."""
    import peft

    from treelit.models.lora import apply_lora

    models("qwen3_5_moe", tmp_path_factory)
    path = _CACHE["qwen3_5_moe"]
    ours = treelit.load_hf_model(path, dtype=F64, vision=True)
    torch.manual_seed(0)
    apply_lora(ours, {"rank": 4, "alpha": 8, "init": False})
    set_moe_routing(ours, "replay")
    ref = load_reference(path)
    peft.inject_adapter_in_model(ours.treelit_lora_config, ref, adapter_name="default")
    ref.load_state_dict({k[len("hf."):]: v for k, v in ours.state_dict().items()}, strict=True)
    ref.to(F64)
    for n, p in ref.named_parameters():
        p.requires_grad_(".lora_" in n)
    branches, images = _fixed_cases(pool)["fork_after_image"]
    masks, weights = [text_mask(b) for b in branches], [1.0, 2.0, 0.5]
    rec = [routing_for(b, MOE_LAYERS["qwen3_5_moe"], K, E) for b in branches]
    with KeepFloat64():
        expected = replay_branch_loss(ref, branches, masks, weights, per_branch_records(branches, rec),
                                      inputs=branch_inputs(ref, images))
        expected.backward()
        theirs = _grads(ref)
        tree = treelit.TokenTree.from_branches(branches, masks, weights, images=images, routed_experts=rec)
        loss = treelit.tree_loss(ours, tree, "token-mean", "sdpa_dense")
        loss.backward()
        mine = _grads(ours, strip="hf.")
    assert mine.keys() == theirs.keys() and mine and all(".lora_" in n for n in mine)
    assert any("linear_attn" in n for n in mine) and any("self_attn" in n for n in mine)
    assert abs(loss.item() - expected.item()) <= 1e-10 * abs(expected.item())
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10
