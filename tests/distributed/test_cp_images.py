"""Images under context parallelism (:mod:`treelit.partition.cp_images`, through the step's image
encoder): a vision-language row split over 2 gloo processes, unpartitioned and with partitioned
passes, equals one unpartitioned process in float64 (loss and every parameter gradient, the
vision tower's included, the ranks' gradients summed; <= 1e-9), and each distinct image of the
micro-batch goes through the tower once in the whole group.

The rows: ``ONE`` shows one image whose placeholder rows straddle the rank boundary (rank 0
encodes it, rank 1 owns no image and receives its rows); ``THREE`` shows three images: the
largest straddles the boundary (rank 0's), and the two others, owned by rank 1, have all their
rows on rank 0 (their embeddings travel to the rank that holds their rows, their gradient back)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import treelit
from float64_mode import KeepFloat64
from harness import launch
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from treelit.lightning.executors import ContextParallel, CPPartitioned, WholeRow
from treelit.lightning.module import TreeLitModule
from treelit.objectives import make_objective
from treelit.partition.cp_images import image_owners
from treelit.partition.cp_plan import cp_split
from vision_oracle import image_processor, processed, random_image, span, text_mask, vision_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("PIL")

F64 = torch.float64


def _rows(name):
    """(branches, their images, weights, advantages) of the row ``name`` (the same in every process)."""
    proc = image_processor()
    rng = np.random.default_rng(0)
    a = processed(proc, random_image(rng, 32, 32), name="a")  # 16 rows
    b = processed(proc, random_image(rng, 24, 16), name="b")  # 6 rows
    c = processed(proc, random_image(rng, 16, 16), name="c")  # 4 rows
    if name == "one":
        branches = [[1] + span(a) + [3, 4, 5, 6, 7], [1] + span(a) + [6, 7, 2, 9, 4], [1] + span(a) + [3, 8, 9, 2]]
        images = [[a], [a], [a]]
    else:
        branches = [[1, 2] + span(c) + [3] + span(b) + [5, 6, 7],
                    [1, 2] + span(c) + [3] + span(b) + [9, 4] + span(a) + [2],
                    [1, 2] + span(c) + [8, 9, 2, 3]]
        images = [[c, b], [c, b, a], [c]]
    n = len(branches)
    return branches, images, [1.0, 0.5, 2.0][:n], [1.0, -0.5, 0.3][:n]


def _batch(name):
    branches, images, weights, adv = _rows(name)
    return treelit.TokenTree.from_branches(branches, [text_mask(b) for b in branches], weights, advantages=adv,
                                           images=images).to_batch()


def _micro_batches(name, text):
    """The row ``name``, then (``text``) a row of text only: a micro-batch whose ranks encode nothing."""
    out = [_batch(name)]
    if text:
        out.append(treelit.TokenTree.from_branches([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 9, 4]],
                                                   advantages=[0.5, -1.0, 0.2]).to_batch())
    return out


def _module(path, objective, partition, budget):
    model = treelit.load_hf_model(path, dtype=F64, vision=True)
    module = TreeLitModule(model, make_objective(objective), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                           partition=partition, budget_tokens=budget, attention="sdpa_dense",
                           old_logprobs="rollout" if objective != "sft" else "data")
    return model, module


def _step(module, model, micro, objective):
    """(loss, gradients by name, images encoded by the rollout read and by the update)."""
    with KeepFloat64():
        counts = []
        if objective != "sft":
            before = model.vision.images_encoded
            module.record_rollout_logprobs(micro)
            counts.append(model.vision.images_encoded - before)
        before = model.vision.images_encoded
        out = module.compute_gradients(micro)
        counts.append(model.vision.images_encoded - before)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, counts


def _worker(rank, world, path, name, objective, partition, budget, text):
    model, module = _module(path, objective, partition, budget)
    module._cp_group = dist.group.WORLD  # (what the FSDP2 strategy sets: the row split over the group)
    out, grads, counts = _step(module, model, _micro_batches(name, text), objective)
    executor = type(module.executor).__name__
    loss = torch.tensor([out["loss"]], dtype=F64)
    dist.all_reduce(loss)  # (each rank holds 1/C of the row's loss)
    every = [torch.zeros(len(counts), dtype=torch.long) for _ in range(world)]
    dist.all_gather(every, torch.tensor(counts, dtype=torch.long))
    passes = torch.tensor([float(module.last_partition_stats.partitions)])
    dist.all_reduce(passes, op=dist.ReduceOp.MAX)
    return {"loss": float(loss), "grads": grads, "counts": [c.tolist() for c in every], "executor": executor,
            "passes": float(passes), "received": out.get("cp/received_bytes_max", 0.0)}


class _Checkpoints(dict):
    """A family's tiny checkpoint, written on first use."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, family):
        self[family] = str(vision_checkpoint(self.factory.mktemp(family), family))
        return self[family]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory)


def _layout(path, name):
    """The split of the row over 2 ranks and the images' owners, as the case's docstring says."""
    model = treelit.load_hf_model(path, dtype=F64, vision=True)
    batch = _batch(name)
    end = cp_split(batch, 2, 0, model).end
    rows = batch.image_row
    img = batch.images.image_of_rows(rows.clamp(min=0))
    where = [set((torch.nonzero((rows >= 0) & (img == i)).flatten() >= end).tolist())
             for i in range(batch.images.num_images)]  # per image: on rank 0 (False) and / or rank 1 (True)
    return where, image_owners(batch.images, 2), batch.images.grid_thw.prod(-1).tolist()


def compare(path, name, objective, partition, budget, text=False):
    where, owners, patches = _layout(path, name)
    big = int(np.argmax(patches))
    assert where[big] == {False, True} and owners[big] == 0, "the largest image must straddle the boundary"
    if name == "one":
        assert owners == [0], "rank 1 must own no image"
    else:
        assert owners.count(1) == 2 and all(where[i] == {False} for i in range(3) if owners[i] == 1), \
            "rank 1's images must have their rows on rank 0 only"
    got = launch(_worker, 2, path, name, objective, partition, budget, text, deadline=400)
    assert got["executor"] == (CPPartitioned if partition != "none" else ContextParallel).__name__
    if partition != "none":
        assert got["passes"] > 1, "the budget must cut the row into several passes"
    assert got["received"] > 0
    # each distinct image through the tower once in the group: its owner's
    n = len(owners)
    for run in range(len(got["counts"][0])):
        assert [c[run] for c in got["counts"]] == [owners.count(r) for r in range(2)], got["counts"]
        assert sum(c[run] for c in got["counts"]) == n
    model, module = _module(path, objective, "none", None)
    out, want, counts = _step(module, model, _micro_batches(name, text), objective)
    assert type(module.executor) is WholeRow and counts == [n] * len(counts)
    loss = out["loss"]
    assert abs(got["loss"] - loss) <= 1e-9 * abs(loss), (got["loss"], loss)
    assert got["grads"].keys() == want.keys() and any("visual" in k for k in want)
    assert sum(float(g.norm()) for k, g in want.items() if "visual" in k) > 0, "the tower must train"
    err = max_rel_grad_diff(got["grads"], want, grad_floor(F64), negligible_grad(F64))
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"


def test_cp_images_equal_one_process(checkpoints):
    """C = 2, one pass per row: an image straddling the boundary, a rank without images."""
    compare(checkpoints["qwen2_5_vl"], "one", "sft", "none", None)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("name,objective,partition,budget", [
    ("three", "sft", "none", None),
    ("one", "grpo", "redundancy_free", 12),
    ("three", "grpo", "redundancy_free", 19),
])
def test_cp_images_cases(checkpoints, family, name, objective, partition, budget):
    """Three images (two owned by the rank that holds none of their rows), partitioned passes
    (and the rollout log-probs' no-gradient read, which shares the rows too), Qwen3-VL's deepstack
    rows; each with a second micro-batch of text only (its row cut over the ranks, no image encoded)."""
    compare(checkpoints[family], name, objective, partition, budget, text=True)


def _fsdp_worker(rank, world, path):
    """FSDP2 over the 4 ranks (the tower sharded with the rest: every rank runs it once per
    micro-batch, a blank image where it owns none), 2 context-parallel groups of 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    model, module = _module(path, "sft", "none", None)
    module._device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    module._cp_group, _ = dist.new_subgroups(group_size=2)
    module.configure_model()
    micro = _micro_batches("three" if rank < 2 else "one", text=True)
    out, grads, counts = _step(module, model, micro, "sft")
    grads = {n: g.full_tensor() for n, g in grads.items()}  # (a collective: every rank, the same order)
    loss = torch.tensor([out["loss"]], dtype=F64)
    dist.all_reduce(loss)
    every = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(every, torch.tensor(counts, dtype=torch.long))
    return {"loss": float(loss), "grads": grads, "counts": [int(c) for c in every],
            "executor": type(module.executor).__name__}


@pytest.mark.slow
def test_cp_images_under_fsdp2_data_parallel(checkpoints):
    """4 processes: FSDP2 over all of them and context parallelism C = 2 inside (ranks 0-1 split
    the three-image row, ranks 2-3 the one-image row, each then a text row). The tower's gradient,
    computed by each image's owner only, is summed over both dimensions by FSDP2: equal to one
    process running every micro-batch (float64, 1e-9)."""
    path = checkpoints["qwen2_5_vl"]
    got = launch(_fsdp_worker, 4, path, deadline=500)
    assert got["executor"] == ContextParallel.__name__
    # per rank: its own images of its row, and a blank image wherever it owns none (the text row included)
    assert got["counts"] == [1 + 1, 2 + 1, 1 + 1, 1 + 1], got["counts"]
    model, module = _module(path, "sft", "none", None)
    out, want, _ = _step(module, model, _micro_batches("three", True) + _micro_batches("one", True), "sft")
    loss = out["loss"]
    assert abs(got["loss"] - loss) <= 1e-9 * abs(loss), (got["loss"], loss)
    assert got["grads"].keys() == want.keys()
    assert sum(float(g.norm()) for k, g in want.items() if "visual" in k) > 0
    err = max_rel_grad_diff(got["grads"], want, grad_floor(F64), negligible_grad(F64))
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"
