"""LoRA under FSDP2 on two CPU processes (gloo): the frozen base is sharded with the adapters,
only the adapters train, and the update equals one process's; a sharded checkpoint holds the
adapters and their optimizer state only, and a resume from it reaches the uninterrupted run's
weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cli import run, tail
from test_multiprocess import COMMON, data  # noqa: F401  (the module fixture: six trees of different sizes)

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.init=false", "export.merge=true",
        "optimizer=adamw", "optimizer.lr=0.01"]
BASE = [c for c in COMMON if not c.startswith("optimizer")]


def train(data, name, *extra, base=BASE):
    out = data / name
    log = data / f"{name}.log"
    rc = run([*base, *LORA, f"data.train_path={data / 'trees.jsonl'}", f"output_dir={out}", *extra], data, log)
    assert rc == 0, tail(log)
    return out


def adapters(out):
    return load_file(str(out / "hf_checkpoint" / "adapter_model.safetensors"))


def merged(out):
    return load_file(str(out / "hf_checkpoint_merged" / "model.safetensors"))


def test_fsdp2_lora_equals_one_process(data):  # noqa: F811
    one = train(data, "lora_single")
    two = train(data, "lora_fsdp2", "trainer=fsdp2_cpu")
    a, b = adapters(one), adapters(two)
    assert a.keys() == b.keys() and all(".lora_" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    ma, mb = merged(one), merged(two)
    for k in ma:
        torch.testing.assert_close(mb[k], ma[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_fsdp2_lora_checkpoint_holds_the_adapters_and_resumes_exactly(data):  # noqa: F811
    steps = ["trainer.max_steps=4"]
    with_ck = [c for c in BASE if c != "callbacks.checkpoint=null"] + ["callbacks.checkpoint.every_n_train_steps=1"]
    full = train(data, "lora_full", "trainer=fsdp2_cpu", *steps)
    train(data, "lora_cut", "trainer=fsdp2_cpu", "trainer.max_steps=2", base=with_ck)
    shard = data / "lora_cut" / "checkpoints" / "step-000002.ckpt"
    assert shard.is_dir(), sorted((data / "lora_cut" / "checkpoints").iterdir())
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(shard)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("state_dict.")}
    assert model_keys and all(".lora_" in k for k in model_keys), sorted(model_keys)[:5]
    resumed = train(data, "lora_resumed", "trainer=fsdp2_cpu", *steps, f"resume_from={shard}")
    a, b = adapters(full), adapters(resumed)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
