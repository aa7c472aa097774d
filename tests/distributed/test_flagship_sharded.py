"""The flagship (tests/flagship_case.py: a Qwen3.5-MoE-shaped multimodal hybrid with images,
routing replay, LoRA with the tower trained, and a shared critic, PPO with GAE on GRPO-shaped groups) on several CPU
processes (gloo): FSDP2 per block (the decoder's blocks and the vision tower's, the value head
with them), each rank a share of the groups, one update's loss and every trained gradient equal
one process's in float64 <= 1e-9. One process equals transformers branch by branch
(tests/models/test_flagship.py), so the sharded run does too.

Context parallelism (each group's row split over C = 2 ranks, FSDP2 over all four): each distinct
image is encoded by one rank of its group, its rows reach both, and the tower's gradient is
summed back to it (treelit.partition.cp_images). That case (four processes, whole rows) is the
default suite's; partitioned rows, FSDP2 alone on two processes and ``treelit-train`` are slow.
"""

from __future__ import annotations

import pytest
import torch

from flagship_case import flagship_module, groups, run_step, trained_grads, trees
from float64_mode import KeepFloat64
from harness import launch
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from vision_oracle import vision_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("peft")

F64 = torch.float64
FULL = (4, 3)  # (groups, completions per group)


def _share(rank: int, replicas: int, size):
    """This data-parallel replica's groups (round robin; the ranks of a context-parallel group
    hold the same ones)."""
    return [t.to_batch() for i, t in enumerate(trees(groups(*size))) if i % replicas == rank]


def sharded_step(rank: int, world: int, path: str, cp: int, partition: str, budget, size=FULL):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from treelit.utils.distributed import Collectives

    module = flagship_module(path, partition, budget)
    if cp > 1:  # groups of C consecutive ranks split each row, as trainer.strategy.context_parallel_degree does
        group, _ = dist.new_subgroups(group_size=cp)
        module._cp_group = group
    module._device_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    module.configure_model()
    micro = _share(rank // cp, world // cp, size)
    with KeepFloat64():
        out = run_step(module, micro)
        grads = trained_grads(module)
    comm = Collectives()
    loss = comm.sum(out["loss"])  # (each rank holds its share: its trees', its part of a split row)
    images = comm.gather_lists([int(sum(mb.images.num_images for mb in micro if mb.images is not None))])
    return {"loss": loss, "grads": grads, "images": [r[0] for r in images]} if rank == 0 else None


def one_process(path, partition, budget, size=FULL):
    module = flagship_module(path, partition, budget)
    micro = _share(0, 1, size)
    with KeepFloat64():
        out = run_step(module, micro)
        return out["loss"], trained_grads(module)


@pytest.fixture(scope="module")
def flagship(tmp_path_factory):
    return str(vision_checkpoint(tmp_path_factory.mktemp("flagship"), "qwen3_5_moe"))


def check(res, ref):
    loss, grads = ref
    assert abs(res["loss"] - loss) <= 1e-9 * abs(loss), (res["loss"], loss)
    assert res["grads"].keys() == grads.keys() and len(grads) > 2
    assert any(".lora_" in k for k in grads) and "critic.head.weight" in grads
    assert any("visual.modules_to_save" in k for k in grads)  # the tower's gradient, summed over the ranks
    assert max_rel_grad_diff(res["grads"], grads, grad_floor(F64), negligible_grad(F64)) <= 1e-9


@pytest.mark.parametrize("world,cp,partition", [
    # default suite: FSDP2 with context parallelism C=2 on four processes (22 s at load 3 on 2 cores,
    # 87 s at load 9: process start-up and imports dominate)
    pytest.param(4, 2, "none", id="fsdp2-cp2-4proc"),
    pytest.param(4, 2, "redundancy_free", id="fsdp2-cp2-partitioned-4proc", marks=pytest.mark.slow),
    pytest.param(2, 1, "none", id="fsdp2-2proc", marks=pytest.mark.slow),
    pytest.param(2, 1, "redundancy_free", id="fsdp2-partitioned-2proc", marks=pytest.mark.slow),
])
def test_flagship_sharded_equals_one_process(flagship, world, cp, partition):
    budget = max(len(b) for c in groups(*FULL) for b in c[0]) + 1 if partition != "none" else None
    res = launch(sharded_step, world, flagship, cp, partition, budget, deadline=600)
    assert all(n > 0 for n in res["images"]), res["images"]  # every rank's rows show images
    check(res, one_process(flagship, partition, budget))


@pytest.mark.slow
def test_treelit_train_flagship_with_context_parallelism_equals_one_process(tmp_path):
    """The recipe's run as a user starts it: ``treelit-train experiment=flagship`` on the example's
    checkpoint and image groups, one process and ``trainer=fsdp2_cpu`` on four processes with
    context parallelism C = 2 (float64, two optimizer steps of two PPO epochs each): the exported
    adapters and the tower's trained copy agree (1e-9), and so do the loss and the critic's metrics."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from cli import run, tail

    root = Path(__file__).resolve().parents[2]
    made = subprocess.run([sys.executable, str(root / "examples" / "tiny_flagship.py"), str(tmp_path / "tiny")],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    common = ["experiment=flagship", f"model.hf_checkpoint={tmp_path / 'tiny' / 'checkpoint'}",
              f"data.train_path={tmp_path / 'tiny' / 'data' / 'groups.jsonl'}", "model.dtype=float64",
              "data.shuffle=false", "trainer.max_steps=2", "logger=none", "callbacks.checkpoint=null",
              "callbacks.progress=null", "trainer.enable_progress_bar=false"]
    out = {}
    for name, extra in (("one", []), ("cp", ["trainer=fsdp2_cpu", "trainer.devices=4",
                                             "trainer.strategy.context_parallel_degree=2"])):
        out[name], log = tmp_path / name, tmp_path / f"{name}.log"
        rc = run([*common, f"output_dir={out[name]}", *extra], tmp_path, log, timeout=600)
        assert rc == 0, tail(log)
    a, b = (load_file(str(out[n] / "hf_checkpoint" / "adapter_model.safetensors")) for n in ("one", "cp"))
    assert a.keys() == b.keys() and any("lora_" in k for k in a) and any("visual" in k for k in a)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # trained (PEFT's B starts at 0)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-9, atol=1e-12, msg=k)
    ma, mb = (json.loads((out[n] / "summary.json").read_text())["metrics"] for n in ("one", "cp"))
    for key in ("loss", "critic/value_loss", "critic/values_mean", "critic/returns_mean"):
        assert abs(ma[key] - mb[key]) <= 1e-9 * max(1.0, abs(ma[key])), (key, ma[key], mb[key])
