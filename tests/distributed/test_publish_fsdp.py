"""Policy publishing under FSDP2 on two CPU processes: every rank joins the per-tensor gathers,
rank 0 writes, and the published weights equal one process's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from harness import launch


def publish_sharded(rank: int, world: int, directory: str, family: str, dtype: str):
    import os

    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import tiny_model
    from treelit.lightning.publish import PolicyPublisher, read_latest
    from treelit.utils.distributed import is_sharded, shard_model

    model = tiny_model(family, torch.float32, seed=3)  # the same weights on every rank
    if rank == 0:
        PolicyPublisher(os.path.join(directory, "one"), dtype=dtype).publish(model, 0)  # one process, unsharded
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    shard_model(model, mesh)
    assert is_sharded(model)
    pub = PolicyPublisher(os.path.join(directory, "fsdp"), dtype=dtype)
    if rank == 0:
        pub.prepare()
    res = pub.publish(model, 1, rank=rank)
    if rank != 0:
        assert res.path is None and not os.path.exists(os.path.join(directory, "fsdp", "step-1", "x"))
        return None
    one = load_file(os.path.join(directory, "one", "step-0", "model.safetensors"))
    two = load_file(os.path.join(str(res.path), "model.safetensors"))
    return {"keys": (sorted(one), sorted(two)), "equal": all(torch.equal(one[k], two[k]) for k in one),
            "dtypes": sorted({str(v.dtype) for v in two.values()}), "latest": read_latest(os.path.join(directory, "fsdp")),
            "config_equal": open(os.path.join(directory, "one", "step-0", "config.json")).read()
            == open(os.path.join(str(res.path), "config.json")).read()}


@pytest.mark.parametrize("family,dtype", [("qwen2_tiny", "float32"),
                                          pytest.param("hybrid_tiny", "bfloat16", marks=pytest.mark.slow)])
def test_fsdp2_published_weights_equal_one_process(tmp_path, family, dtype):
    res = launch(publish_sharded, 2, str(tmp_path), family, dtype, deadline=240)
    one, two = res["keys"]
    assert one == two and len(one) > 0
    assert res["equal"], "the gathered weights differ from the unsharded model's"
    assert res["dtypes"] == [f"torch.{dtype}"] and res["config_equal"]
    assert res["latest"]["version"] == 1
