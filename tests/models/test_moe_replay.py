"""MoE routing replay (``model.moe.routing=replay``), exact on trees, on both model paths.

Tree mode with the recorded routing == transformers' model run branch by branch with each MoE
block's top-k replaced by the given experts (``routing_oracle``: no treelit on that side):
loss and every parameter gradient in float64 <= 1e-10, with and without the router loss (both
definitions: the balance loss of the *replayed* assignment), unpartitioned and cut into
partitions. Native ``qwen3_moe`` (treelit's own MoE layer) and ``hf_auto`` on Qwen3-MoE,
Qwen2-MoE (a shared expert behind a sigmoid gate beside the routed ones) and GLM-4.5 (sigmoid
router scores, bias-corrected group-limited choice, routed scaling factor). transformers'
float32 upcasts (RMSNorm, RoPE, router softmax) are rebound to float64 on both instances.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import treelit
from float64_mode import KeepFloat64
from helpers import max_rel_grad_diff
from hf_oracle import hf_grads, load_hf_oracle, make_exact, random_hf_checkpoint
from routing_oracle import per_branch_records, replay_branch_loss, routing_for
from treelit.models.factory import make_model, set_moe_routing, set_router_aux_loss

pytest.importorskip("transformers")

TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MOE = dict(moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)
CONFIGS = {
    "qwen3_moe": ("qwen3_moe", dict(MOE, mlp_only_layers=[1])),  # MoE layers 0 and 2
    "qwen2_moe": ("qwen2_moe", dict(MOE, norm_topk_prob=False, shared_expert_intermediate_size=12,
                                    mlp_only_layers=[1], use_sliding_window=False)),
    # sigmoid gates, bias-corrected group-limited choice, a shared expert, a routed scaling factor;
    # the first layer dense: MoE layers 1 and 2
    "glm4_moe": ("glm4_moe", dict(moe_intermediate_size=8, n_routed_experts=6, num_experts_per_tok=2,
                                  n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, n_group=2,
                                  topk_group=1, norm_topk_prob=True)),
}
FOREST = ([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9], [1, 2, 10], [11, 12, 13, 14], [1, 2, 3, 4, 5, 6, 15]],
          [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1], [0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]],
          [1.0, 0.5, 2.0, 1.0, 1.5])
LIMIT = 1e-10
_CKPT = {}


def checkpoint(config, tmp_path_factory):
    if config not in _CKPT:
        path = tmp_path_factory.mktemp(config)
        model_type, extra = CONFIGS[config]
        random_hf_checkpoint(path, model_type, **TINY, **extra)
        _CKPT[config] = path
    return _CKPT[config]


def routing(branches, last=True):
    """2 MoE layers, top-2 of 6; ``last=False``: the final token unrecorded (as samplers return it)."""
    r = [routing_for(b, 2, 2, 6) for b in branches]
    return r if last else [x[:-1] for x in r]


def ours_for(path, kind):
    if kind == "native":
        return treelit.load_hf_checkpoint(path, dtype=torch.float64), ""
    model = treelit.load_hf_model(path, dtype=torch.float64)
    make_exact(model.hf)
    return model, "hf."


def compare(path, kind, router=None, budget=None, aggregation="token-mean", last=True, forest=FOREST,
            checkpointing=False):
    """(loss, max gradient) relative differences; GLM-4.5's router computes in float32 by itself:
    kept in float64 on both sides (``KeepFloat64``). ``checkpointing``: the model's activation
    checkpointing on (its layers, routers included, recomputed in the backward)."""
    with KeepFloat64() if path.name.startswith("glm4_moe") else contextlib.nullcontext():
        return _compare(path, kind, router, budget, aggregation, last, forest, checkpointing)


def _compare(path, kind, router, budget, aggregation, last, forest, checkpointing=False):
    branches, masks, weights = forest
    rec = routing(branches, last)
    ours, strip = ours_for(path, kind)
    ours.activation_checkpointing = checkpointing
    set_moe_routing(ours, "replay")
    set_router_aux_loss(ours, *((router[1], router[0]) if router else (0.0, None)))
    tree = treelit.TokenTree.from_branches(branches, masks, weights, routed_experts=rec)
    ours.zero_grad(set_to_none=True)
    if budget is None:
        loss = treelit.tree_loss(ours, tree, aggregation)
        loss.backward()
        value = loss.item()
    else:
        value = treelit.tree_backward(ours, tree, aggregation, "redundancy_free", budget)
    ref = load_hf_oracle(path, dtype=torch.float64)
    full = per_branch_records(branches, rec)
    expected = replay_branch_loss(ref, branches, masks, weights, full, aggregation, router)
    expected.backward()
    if kind == "native":
        from treelit.models.hf import hf_to_tune_state_dict

        theirs = hf_to_tune_state_dict(hf_grads(ref, ours.config.tie_word_embeddings), ours.config)
    else:
        theirs = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    mine = {n[len(strip):]: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))
    assert expected.item() != 0 and max(g.norm().item() for g in theirs.values()) > 0
    loss_diff = abs(value - expected.item()) / abs(expected.item())
    grad_diff = max_rel_grad_diff(mine, theirs, 1e-6)
    router_grads = [n for n in theirs if n.endswith("gate.weight") and "shared" not in n]
    assert router_grads and all(theirs[n].norm() > 0 for n in router_grads)  # the router learns under replay
    return loss_diff, grad_diff


@pytest.mark.parametrize("kind, config", [("native", "qwen3_moe"), ("hf_auto", "qwen2_moe")])
def test_replay_equals_transformers_with_replaced_top_k(kind, config, tmp_path_factory):
    """Default suite: one case per path, the router loss on (micro_batch)."""
    d = compare(checkpoint(config, tmp_path_factory), kind, router=("micro_batch", 0.5))
    assert max(d) <= LIMIT, d


def test_replay_through_a_sigmoid_router(tmp_path_factory):
    """GLM-4.5's router (sigmoid scores, a bias that picks experts within a chosen group, weights
    renormalised and scaled): its choice replaced, the rest its own; partitioned. (Its router loss
    is refused: treelit's is the softmax Switch loss.)"""
    for budget in (None, 7):
        d = compare(checkpoint("glm4_moe", tmp_path_factory), "hf_auto", budget=budget)
        assert max(d) <= LIMIT, (budget, d)


CASES = [(kind, config, router, budget, agg)
         for kind, config in (("native", "qwen3_moe"), ("hf_auto", "qwen3_moe"), ("hf_auto", "qwen2_moe"))
         for router in (None, ("micro_batch", 0.5), ("sequence", 0.5))
         for budget in (None, 7)
         for agg in ("token-mean", "seq-mean-token-mean")]


@pytest.mark.slow
@pytest.mark.parametrize("kind, config, router, budget, aggregation", CASES)
def test_replay_equals_transformers_everywhere(kind, config, router, budget, aggregation, tmp_path_factory):
    """Both paths, both families on hf_auto, no router loss / both definitions, whole rows and
    partitions at the longest branch's size, two aggregations."""
    d = compare(checkpoint(config, tmp_path_factory), kind, router=router, budget=budget, aggregation=aggregation)
    assert max(d) <= LIMIT, d


@pytest.mark.parametrize("kind", ["native", "hf_auto"])
def test_partitioned_replay_is_exact(kind, tmp_path_factory):
    """Default suite: cut into partitions (the router loss takes every token's replayed routing
    in a no-gradient pass first)."""
    d = compare(checkpoint("qwen3_moe", tmp_path_factory), kind, router=("sequence", 0.5), budget=7)
    assert max(d) <= LIMIT, d


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["native", "hf_auto"])
def test_unrecorded_final_tokens_route_live(kind, tmp_path_factory):
    """Records one token short (what samplers return): the final token of a branch has no routing
    of its own and feeds no log-prob of its branch; without a router loss the result is exact."""
    d = compare(checkpoint("qwen3_moe", tmp_path_factory), kind, last=False)
    assert max(d) <= LIMIT, d


# branch 1 is branch 0 one token longer, branch 3 a prefix of branch 2
PREFIX_FOREST = ([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9], [1, 2, 7, 8]],
                 [[0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1]], [1.0, 0.5, 2.0, 1.0])


@pytest.mark.parametrize("kind, router", [("native", ("micro_batch", 0.5)), ("native", ("sequence", 0.5)),
                                          ("hf_auto", ("micro_batch", 0.5))])
def test_a_prefix_branch_takes_its_final_token_routing_from_the_longer_branch(kind, router, tmp_path_factory):
    """Records one token short, a branch a prefix of another, the router loss on: the shorter
    branch's final token is routed as the longer branch recorded it (the same token on the same
    prefix), in the tree and in the per-branch reference alike."""
    d = compare(checkpoint("qwen3_moe", tmp_path_factory), kind, router=router, last=False, forest=PREFIX_FOREST)
    assert max(d) <= LIMIT, d


def test_per_branch_mode_routes_a_prefix_branch_as_the_tree_does():
    """The per-branch reference the trainer builds from the records (``mode=linear``,
    ``verify_every``) gives the shorter branch's unrecorded final token the longer branch's
    routing, as the tree does: loss and every gradient equal, float64, router loss on."""
    from treelit.builders.base import build_tree_from_branches
    from treelit.tree.routing import encode_routing

    torch.manual_seed(0)
    model = treelit.build_model("qwen3_moe_tiny", vocab_size=16, max_seq_len=64).double()
    set_moe_routing(model, "replay")
    set_router_aux_loss(model, 0.5, "micro_batch")
    ids = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 7, 8]]
    built = build_tree_from_branches(
        [{"input_ids": b, "routed_experts": encode_routing(routing_for(b, 2, 2, 8)[:-1])} for b in ids], "t", "data")
    tree = built.tree
    results = []
    for fn in (lambda: treelit.tree_loss(model, tree, attention="sdpa_dense"),
               lambda: treelit.linear_loss(model, tree.source_branches)):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (t, tg), (lin, lg) = results
    assert lin != 0 and max(g.norm().item() for g in lg.values()) > 0
    assert abs(t - lin) / abs(lin) <= LIMIT, (t, lin)
    assert max_rel_grad_diff(tg, lg, 1e-6) <= LIMIT


@pytest.mark.parametrize("kind", ["native", "hf_auto"])
def test_replay_changes_the_loss_and_replaying_the_live_choice_changes_nothing(kind, tmp_path_factory):
    path = checkpoint("qwen3_moe", tmp_path_factory)
    branches, masks, weights = FOREST
    ours, _ = ours_for(path, kind)
    live = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, weights)).item()
    # the router's own choice, read from a live pass, then replayed
    from treelit.loss.tree import tree_hidden

    batch = treelit.TokenTree.from_branches(branches, masks, weights).to_batch()
    with torch.no_grad():
        _, ctx = tree_hidden(ours, batch, "sdpa_dense")
    k = 2
    own = torch.stack([torch.topk(ctx.router_logits[i], k).indices.sort(-1).values for i in sorted(ctx.router_logits)], 1)
    per_branch = [own[batch.branch_tokens[batch.branch_ptr[b]:batch.branch_ptr[b + 1]]].numpy()
                  for b in range(batch.num_branches)]
    set_moe_routing(ours, "replay")
    same = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, weights,
                                                                   routed_experts=per_branch)).item()
    other = treelit.tree_loss(ours, treelit.TokenTree.from_branches(branches, masks, weights,
                                                                    routed_experts=routing(branches))).item()
    assert same == pytest.approx(live, rel=1e-13, abs=0)
    assert abs(other - live) > 1e-6 * abs(live)


def test_replay_needs_routing_and_a_moe_model():
    dense = treelit.build_model("qwen3_tiny", vocab_size=16, max_seq_len=64)
    with pytest.raises(ValueError, match=r"model.moe.routing=replay needs a mixture-of-experts model; this model "
                                         r"\(qwen3\) has no MoE layers"):
        set_moe_routing(dense, "replay")
    with pytest.raises(ValueError, match="model.moe.routing must be one of live, replay"):
        make_model("qwen3_moe_tiny", moe={"routing": "sometimes"})
    moe = treelit.build_model("qwen3_moe_tiny", vocab_size=16, max_seq_len=64)
    set_moe_routing(moe, "replay")
    with pytest.raises(ValueError, match="this pass has no recorded routing"):
        treelit.tree_loss(moe, treelit.TokenTree.from_branches([[1, 2, 3]]))


def test_hf_auto_replay_is_refused_on_a_dense_model(tmp_path_factory):
    """A dense transformers model is refused by name."""
    from treelit.models.hf_adapter import make_hf_model

    dense = tmp_path_factory.mktemp("llama")
    random_hf_checkpoint(dense, "llama", **TINY)
    with pytest.raises(ValueError, match=r"routing=replay needs a mixture-of-experts model; this model \(llama\)"):
        make_hf_model(str(dense), moe={"routing": "replay"})


@pytest.mark.parametrize("config, router, budget", [
    ("qwen2_moe", ("micro_batch", 0.5), None),
    pytest.param("qwen3_moe", ("sequence", 0.5), 7, marks=pytest.mark.slow),
    pytest.param("glm4_moe", None, 7, marks=pytest.mark.slow)])
def test_hf_auto_replay_with_activation_checkpointing(config, router, budget, tmp_path_factory):
    """transformers' activation checkpointing recomputes each layer in the backward, outside the
    pass: the recomputed routers replay the pass's records (``hf_replay.checkpoint_contexts``),
    so the loss and every gradient stay per-branch training's. Once refused before the model loaded."""
    from treelit.models.hf_adapter import make_hf_model

    path = checkpoint(config, tmp_path_factory)
    model = make_hf_model(str(path), dtype="float64", activation_checkpointing=True, moe={"routing": "replay"})
    assert model.activation_checkpointing and model.config.moe["routing"] == "replay"
    d = compare(path, "hf_auto", router=router, budget=budget, checkpointing=True)
    assert max(d) <= LIMIT, d


@pytest.mark.parametrize("kind", ["native", "hf_auto"])
def test_a_copied_model_replays_on_its_own(kind, tmp_path_factory):
    """A deep copy (objective.reference=initial keeps one) replays through its own routers."""
    import copy

    branches, masks, weights = FOREST
    ours, _ = ours_for(checkpoint("qwen3_moe", tmp_path_factory), kind)
    set_moe_routing(ours, "replay")
    tree = treelit.TokenTree.from_branches(branches, masks, weights, routed_experts=routing(branches))
    twin = copy.deepcopy(ours)
    with torch.no_grad():
        assert treelit.tree_loss(twin, tree).item() == treelit.tree_loss(ours, tree).item()
