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
    res = launch(publish_sharded, 2, str(tmp_path), family, dtype, deadline=480)
    one, two = res["keys"]
    assert one == two and len(one) > 0
    assert res["equal"], "the gathered weights differ from the unsharded model's"
    assert res["dtypes"] == [f"torch.{dtype}"] and res["config_equal"]
    assert res["latest"]["version"] == 1


@pytest.mark.slow  # two processes through treelit-train (~2 min on 2 shared cores)
def test_treelit_train_under_fsdp2_publishes_the_trained_weights(tmp_path):
    """``publish.dir`` with ``trainer=fsdp2_cpu``: every rank joins each publish's gathers, rank
    0 writes, and the last version holds the same weights as the run's final export."""
    import json

    import treelit
    from cli import run, tail

    rec = {"id": "t", "branches": [{"input_ids": list(range(1, 12 + b)) + [40 + b] * 5} for b in range(4)]}
    (tmp_path / "trees.jsonl").write_text("\n".join(json.dumps({**rec, "id": f"t{i}"}) for i in range(4)) + "\n")
    args = ["data=jsonl", f"data.train_path={tmp_path / 'trees.jsonl'}", "data.micro_batch_tokens=200",
            "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=4", "logger=none", "callbacks.checkpoint=null",
            "callbacks.progress=null", "trainer.enable_progress_bar=false", "model.config.num_layers=2",
            "model.config.embed_dim=32", "model.config.intermediate_dim=64", "trainer=fsdp2_cpu",
            f"publish.dir={tmp_path / 'policy'}", "publish.every_n_steps=2", "publish.dtype=float32",
            f"output_dir={tmp_path / 'out'}"]
    log = tmp_path / "train.log"
    assert run(args, tmp_path, log) == 0, tail(log)
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == ["latest.json", "step-0", "step-2", "step-4"]
    published = treelit.load_hf_checkpoint(tmp_path / "policy" / "step-4", dtype=torch.float32).state_dict()
    final = treelit.load_hf_checkpoint(tmp_path / "out" / "hf_checkpoint", dtype=torch.float32).state_dict()
    assert published.keys() == final.keys()
    for k in final:
        assert torch.equal(published[k], final[k]), k
    first = treelit.load_hf_checkpoint(tmp_path / "policy" / "step-0", dtype=torch.float32).state_dict()
    assert any(not torch.equal(first[k], final[k]) for k in final), "version 0 is not the initial weights"
