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


@pytest.mark.parametrize("objective", ["sft", "grpo", "gspo"])
@pytest.mark.parametrize("family", ["attention", "hybrid"])
def test_syncs_and_uploads_per_step_stay_within_the_budget_whatever_the_tree(models, family, objective):
    seen = {}
    for name, make in TREES.items():
        tree = B.rl_tree(make()) if objective != "sft" else treelit.TokenTree.from_branches(make())
        c = B.count_step(models[family], tree, "sdpa_dense", objective=objective, where=True)
        assert c["launches"] > 100, c  # the step ran
        assert c["syncs"] <= SYNCS and c["uploads"] <= UPLOADS, (name, c["sites"])
        seen[name] = (c["syncs"], c["uploads"])
    # constant, not merely small: the branchiest tree asks no more than the plainest
    assert seen["every_turn_24"] == seen["every_turn_6"], seen


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
