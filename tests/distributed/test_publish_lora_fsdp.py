"""Publishing a LoRA policy under FSDP2 on two CPU processes: ``publish.lora=adapter`` gathers the
trained tensors only (one gather per adapter tensor, none for the frozen base) and
``publish.lora=merged`` the whole model; both equal one process's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from harness import launch

CONFIG = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, num_hidden_layers=2, tie_word_embeddings=False)


def publish_sharded(rank: int, world: int, directory: str, base: str):
    import os

    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from treelit.lightning.publish import PolicyPublisher
    from treelit.models.hf_adapter import make_hf_model
    from treelit.utils.distributed import is_sharded, shard_model

    torch.manual_seed(3)  # the same adapters on every rank
    model = make_hf_model(base, dtype="float32", lora=dict(rank=4, alpha=8, init=False))
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    if rank == 0:
        for mode in ("adapter", "merged"):  # one process, unsharded
            PolicyPublisher(os.path.join(directory, "one", mode), lora=mode, dtype="float32").publish(model, 0)
    shard_model(model, init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",)))
    assert is_sharded(model)
    gathers, full = [], DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **k: (gathers.append(1), full(self, *a, **k))[1]
    try:
        paths, counts = {}, {}
        for mode in ("adapter", "merged"):
            before = len(gathers)
            res = PolicyPublisher(os.path.join(directory, "fsdp", mode), lora=mode, dtype="float32").publish(
                model, 1, rank=rank)
            paths[mode], counts[mode] = res.path, len(gathers) - before
    finally:
        DTensor.full_tensor = full
    if rank != 0:
        return None
    out = {"trained": trained, "gathers": counts, "entries": len(model.state_dict())}
    for mode, name in (("adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        one = load_file(os.path.join(directory, "one", mode, "step-0", name))
        two = load_file(os.path.join(str(paths[mode]), name))
        out[mode] = (sorted(one) == sorted(two) and len(one) > 0, all(torch.equal(one[k], two[k]) for k in one))
    out["adapter_files"] = sorted(os.listdir(str(paths["adapter"])))
    return out


@pytest.mark.slow  # two processes importing transformers and PEFT: ~50 s on 2 shared cores
def test_fsdp2_lora_publishes_gather_the_adapters_only_and_equal_one_process(tmp_path):
    from hf_oracle import random_hf_checkpoint

    random_hf_checkpoint(tmp_path / "base", "qwen2", std=0.1, **CONFIG)
    res = launch(publish_sharded, 2, str(tmp_path), str(tmp_path / "base"), deadline=300)
    assert res["adapter"] == (True, True), "the gathered adapter differs from the unsharded model's"
    assert res["merged"] == (True, True), "the gathered merged weights differ from the unsharded model's"
    assert res["gathers"]["adapter"] == res["trained"], res  # the frozen base is never gathered
    assert res["gathers"]["merged"] == res["entries"], res
    assert res["adapter_files"] == ["adapter_config.json", "adapter_model.safetensors", "treelit-manifest.json",
                                    "treelit_publish.json"]
