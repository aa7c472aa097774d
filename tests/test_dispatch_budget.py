"""The host budget of a training step (issue: a GPU step bounded by its FLOPs, not by the host).

Counted exactly on CPU with :class:`treelit.utils.dispatch.DispatchCounter` (what a GPU's host
would do: launches, syncs, uploads): whatever the tree, a step asks the host at most 8 syncs and
makes at most 8 host-to-device uploads; launches per layer do not grow with the tree's segments
where the backend batches a layer's work; the head's launches for 20,000 targets at a 151,936
vocabulary stay near 100 on an 80 GiB device. ``benchmarks/bench_launches.py`` has the full grid."""

import os
import sys

import pytest
import treelit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_launches as B  # noqa: E402

SYNCS, UPLOADS = 8, 8
TREES = {"grpo_4": lambda: B.grpo(4, prompt=64, completion=16),
         "every_turn_6": lambda: B.every_turn(6, turn=24, side=8),
         "every_turn_24": lambda: B.every_turn(24, turn=24, side=8),
         "fanout_d2": lambda: B.fanout(2, call=12, tool=20)}


@pytest.fixture(scope="module")
def models():
    return {fam: B.build(fam, 2) for fam in ("attention", "hybrid")}


@pytest.mark.parametrize("backend,objective", [("sdpa_dense", "sft"), ("sdpa_dense", "grpo"), ("sdpa_dense", "gspo"),
                                               ("segment/cuda", "sft"), ("segment/cuda", "grpo")])
@pytest.mark.parametrize("family", ["attention", "hybrid"])
def test_syncs_and_uploads_per_step_stay_within_the_budget_whatever_the_tree(models, family, backend, objective):
    """``segment/cuda``: segment's CUDA code path (tiles planned once per forward), forced on CPU."""
    seen = {}
    for name, make in TREES.items():
        tree = B.rl_tree(make()) if objective != "sft" else treelit.TokenTree.from_branches(make())
        c = B.count_step(models[family], tree, backend, objective=objective, where=True)
        assert c["launches"] > 100, c  # the step ran
        assert c["syncs"] <= SYNCS and c["uploads"] <= UPLOADS, (name, c["sites"])
        seen[name] = (c["syncs"], c["uploads"])
    # constant, not merely small: the branchiest tree asks no more than the plainest
    assert seen["every_turn_24"] == seen["every_turn_6"], seen


def test_attention_launches_per_layer_do_not_grow_with_the_tree_on_segments_cuda_path(models):
    """One layer more adds the same launches on a 7-segment and a 49-segment tree (and a fan-out)."""
    one = B.build("attention", 1)
    per_layer = {}
    for name in ("every_turn_6", "every_turn_24", "fanout_d2"):
        tree = treelit.TokenTree.from_branches(TREES[name]())
        per_layer[name] = (B.count_step(models["attention"], tree, "segment/cuda")["launches"]
                           - B.count_step(one, tree, "segment/cuda")["launches"])
    assert len(set(per_layer.values())) == 1, per_layer


def test_the_recurrent_scan_asks_the_host_nothing_inside_the_layers(models):
    """Its indices are planned once per forward and uploaded in one copy, whatever the number of
    blocks and levels: the hybrid step's uploads exceed the attention step's by the layout's two."""
    for name in ("every_turn_6", "every_turn_24", "fanout_d2"):
        tree = treelit.TokenTree.from_branches(TREES[name]())
        att = B.count_step(models["attention"], tree, "sdpa_dense")
        hyb = B.count_step(models["hybrid"], tree, "sdpa_dense")
        assert hyb["syncs"] == att["syncs"] == 0, name
        assert hyb["uploads"] - att["uploads"] == 2, name


def test_the_head_is_chunked_by_device_memory():
    rows = {r["where"]: r for r in B.head_counts()}
    gpu, cpu = rows["80 GiB device"], rows["cpu"]
    assert gpu["chunks"] == 5 and gpu["sft"] <= 100 and gpu["rl_entropy"] <= 160, gpu
    assert cpu["chunk_rows"] == (1 << 23) // 151936 and cpu["sft"] > 50 * gpu["sft"], cpu


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_the_modules_update_meets_the_budget_too(models, objective):
    """What the trainer runs per update (TreeLitModule.compute_gradients: the step's normalisers,
    the micro-batch's loss read once, the gradients): still within the budget; the optimizer step
    adds one sync (the gradient norm)."""
    import torch

    from treelit.lightning.module import TreeLitModule
    from treelit.objectives import make_objective
    from treelit.utils.dispatch import DispatchCounter

    module = TreeLitModule(models["hybrid"], make_objective(objective), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           attention="sdpa_dense")

    def row():
        branches = B.every_turn(12, turn=24, side=8)
        return (B.rl_tree(branches) if objective != "sft" else treelit.TokenTree.from_branches(branches)).to_batch()

    module.compute_gradients([row()])
    batch = row()
    with DispatchCounter(where=True) as c:
        out = module.compute_gradients([batch])
    assert out["loss"] != 0 and c.counts.launches > 100
    assert c.counts.syncs <= SYNCS - 1 and c.counts.uploads <= UPLOADS, dict(c.counts.sites)


@pytest.mark.parametrize("options", [dict(behavior_correction="mis", behavior_is_cap=1.01),
                                     dict(behavior_correction="mis", behavior_is_level="geometric", behavior_is_cap=1.01),
                                     dict(behavior_correction="tis", behavior_is_level="sequence", behavior_is_cap=1.01)])
@pytest.mark.parametrize("objective", ["grpo", "gspo"])
def test_behaviour_corrections_ask_the_host_nothing_more(models, objective, options):
    """MIS and the sequence-level corrections (their per-branch path sums, folds and metrics) add no
    sync to the loss and backward; their uploads (the path sums' two plans, kept on the row, the branches'
    plan and PPO's fold plan) keep the step within the budget."""
    import torch

    from treelit.objectives import make_objective
    from treelit.objectives.behavior import split_behavior
    from treelit.utils.dispatch import DispatchCounter

    tree = B.rl_tree(TREES["every_turn_6"]())

    def row():  # as after old_logprobs=rollout: the records' log-probs kept, the proximal ones computed
        batch = tree.to_batch()
        split_behavior(batch)
        batch.token_old_logp = batch.token_old_logp + 0.05 * (torch.arange(batch.num_tokens, dtype=torch.float64) % 3)
        return batch

    def count(obj):
        model = models["attention"]
        obj.tree_loss(model, row(), aggregation="token-mean", normalizer=None, attention="sdpa_dense")[0].backward()
        batch = row()
        with DispatchCounter(where=True) as c:
            loss, metrics = obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None, attention="sdpa_dense")
            loss.backward()
        return c.counts, metrics

    plain, _ = count(make_objective(objective))
    corrected, metrics = count(make_objective(objective, **options))
    key = "behavior/" + ("" if options.get("behavior_is_level", "token") == "token" else "seq_") + (
        "masked_frac" if options["behavior_correction"] == "mis" else "truncated_frac")
    assert 0 < metrics[key] <= 1, metrics  # the correction acted
    assert corrected.syncs == plain.syncs, dict(corrected.sites)
    assert corrected.uploads <= min(UPLOADS, plain.uploads + 4), dict(corrected.sites)
