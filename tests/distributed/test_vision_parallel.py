"""Images on several CPU processes (gloo): DDP, FSDP2 (the vision tower sharded per block like
the decoder) and HSDP give one unpartitioned process's loss and every parameter gradient, the
tower's included (float64, <= 1e-9), with a rank whose rows show no image (under FSDP2 it runs
a blank image through the sharded tower, so that its collectives match the others')."""

from __future__ import annotations

import pytest
import torch

from harness import launch
from vision_cases import vision_steps

pytest.importorskip("transformers")
pytest.importorskip("PIL")

TOL = 1e-9
TWO = [["img0", "img1"], ["txt0", "txt1", "txt2"]]  # rank 1: no image, one more micro-batch (rank 0 pads)
FOUR = [["img0", "txt3"], ["txt0", "txt1"], ["img1"], ["txt2"]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vision_oracle import vision_checkpoint

    return str(vision_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl"))


def check(res, what, tower=True, sharded=True):
    assert res["keys"] == res["ref_keys"] and not res["extra_nonzero"], (what, res["extra_nonzero"])
    assert all(res["tower_units"]) if sharded else not any(res["tower_units"]), what
    assert any("visual" in k for k in res["keys"]) == tower, what
    if tower:
        assert res["tower_norm"] > 0, what
    rel = abs(res["loss"] - res["ref_loss"]) / max(abs(res["ref_loss"]), 1e-30)
    assert rel <= TOL, f"{what}: loss {res['loss']} vs one process {res['ref_loss']}"
    assert res["grad_err"] <= TOL, f"{what}: gradient differs by {res['grad_err']:.2e}"


CASES = {
    "fsdp2-partitioned": dict(strategy="fsdp2", partition="redundancy_free", budget=24, shares=TWO),
    "fsdp2": dict(strategy="fsdp2", shares=TWO),
    "ddp": dict(strategy="ddp", shares=TWO),
    "ddp-partitioned-grpo": dict(strategy="ddp", partition="redundancy_free", budget=24, shares=TWO, objective="grpo"),
    "fsdp2-grpo": dict(strategy="fsdp2", shares=TWO, objective="grpo"),
    "fsdp2-lora-tower-trained": dict(strategy="fsdp2", partition="redundancy_free", budget=24, shares=TWO,
                                     lora="trained"),
    "fsdp2-lora-tower-frozen": dict(strategy="fsdp2", shares=TWO, lora="frozen", objective="grpo"),
    "ddp-lora-tower-trained": dict(strategy="ddp", partition="redundancy_free", budget=24, shares=TWO, lora="trained"),
}


def test_fsdp2_partitioned_with_a_rank_without_images_equals_one_process(checkpoint):
    """And, in the same launch, LoRA on the language model with the tower trained in full
    (``model.lora.modules_to_save: [visual]``: PEFT's copy of the tower, sharded per block)."""
    names = ["fsdp2-partitioned", "fsdp2-lora-tower-trained"]
    results = launch(vision_steps, 2, [dict(CASES[n], path=checkpoint) for n in names], deadline=600)
    for name, res in zip(names, results):
        check(res, name)
        assert res["partitions"][0] > 2, res["partitions"]  # the budget cut rank 0's rows
    assert all("lora_" in k or "modules_to_save" in k for k in results[1]["keys"])


def test_fsdp2_reference_kl_with_a_rank_without_images_equals_one_process(checkpoint):
    """GRPO with a KL penalty to a frozen copy of the initial model (``reference=initial``): the
    copy's tower is sharded like the policy's, so it too is encoded once per micro-batch by an
    encoder of its own, a rank without images running the blank image (else rank 0's reference
    passes all-gather the copy's tower and rank 1's do not: a collective mismatch)."""
    res, = launch(vision_steps, 2, [dict(CASES["fsdp2-grpo"], path=checkpoint, kl=True)], deadline=600)
    check(res, "fsdp2-grpo-reference-kl")
    assert res["ref_encoded"] == 5, res["ref_encoded"]  # rank 0: img0's 2 images, img1's 2, the padding row's blank


@pytest.mark.slow
def test_ddp_and_fsdp2_with_images_equal_one_process(checkpoint):
    names = ["fsdp2", "ddp", "ddp-partitioned-grpo", "fsdp2-grpo", "fsdp2-lora-tower-frozen", "ddp-lora-tower-trained"]
    results = launch(vision_steps, 2, [dict(CASES[n], path=checkpoint) for n in names], deadline=900)
    for name, res in zip(names, results):
        check(res, name, tower="frozen" not in name, sharded=not name.startswith("ddp"))


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) for k in ("separate", "shared")])
def test_fsdp2_ppo_with_a_critic_and_images_equals_one_process(checkpoint, tmp_path_factory, kind):
    """critic=separate: the critic's own vision model (its tower sharded per block too) sees the
    images through its own tower; PPO's values, whitened GAE and every gradient (policy, critic
    trunk, head) equal one unpartitioned process's."""
    from vision_oracle import vision_checkpoint

    critic_path = str(vision_checkpoint(tmp_path_factory.mktemp("critic"), "qwen2_5_vl", seed=1))
    spec = dict(strategy="fsdp2", partition="redundancy_free", budget=24, shares=TWO, objective="ppo", critic=kind,
                critic_path=critic_path, path=checkpoint)
    (res,) = launch(vision_steps, 2, [spec], deadline=600)
    check(res, f"fsdp2 critic={kind}")
    if kind == "separate":
        assert any(k.startswith("critic.trunk.") and "visual" in k for k in res["keys"]), res["keys"]


@pytest.mark.slow
def test_hsdp_2x2_with_images_equals_one_process(checkpoint):
    spec = dict(strategy="hsdp", partition="redundancy_free", budget=24, shares=FOUR, path=checkpoint)
    (res,) = launch(vision_steps, 4, [spec], deadline=900)
    check(res, "hsdp")


@pytest.mark.slow  # about 2 minutes on 2 cores
def test_treelit_train_with_images_on_two_processes_equals_one(tmp_path):
    """The command: the docs' screenshot recipe (a tiny Qwen3.5 vision checkpoint, GUI-agent records)
    trained two steps with SGD on one process and on two (DDP; FSDP2 partitioned) ends at the same
    weights. Not to 1e-9: the one process packs the four trees in one row and each of the two ranks
    two, and transformers computes some of the tower's and norms' steps in float32 whatever the model's
    dtype, so the groupings differ by float32 rounding (the exact checks above keep the rows alike)."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from cli import run, tail

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(root / "examples" / "tiny_vision_agent.py"), str(tmp_path / "tv")], check=True,
                   capture_output=True, timeout=300)
    ck = tmp_path / "tv" / "checkpoint"
    common = ["model=hf_auto", f"model.hf_checkpoint={ck}", "model.vision=true", "model.dtype=float64", "tree_builder=chat",
              f"tree_builder.tokenizer_path={ck}", f"tree_builder.processor_path={ck}", "data=jsonl",
              f"data.train_path={tmp_path / 'tv' / 'data' / 'agent.jsonl'}", "data.shuffle=false", "trainer.max_steps=2",
              "logger=none", "callbacks.checkpoint=null", "optimizer=sgd"]
    weights = {}
    for name, extra in {"one": [], "ddp": ["trainer=ddp_cpu", "trainer.devices=2"],
                        "fsdp2": ["trainer=fsdp2_cpu", "trainer.devices=2", "partition=redundancy_free"]}.items():
        log = tmp_path / f"{name}.log"
        assert run([*common, *extra, f"output_dir={tmp_path / name}"], tmp_path, log) == 0, tail(log)
        weights[name] = {k: v for f in sorted((tmp_path / name / "hf_checkpoint").glob("*.safetensors"))
                         for k, v in load_file(str(f)).items()}
    start = {k: v for f in sorted(ck.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert any(not torch.equal(weights["one"][k], start[k]) for k in start if "visual" in k)  # the tower trained
    for name in ("ddp", "fsdp2"):
        assert weights[name].keys() == weights["one"].keys()
        for k, v in weights["one"].items():
            torch.testing.assert_close(weights[name][k], v, rtol=1e-7, atol=1e-8, msg=f"{name}: {k}")
