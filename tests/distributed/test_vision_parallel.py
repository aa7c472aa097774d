"""Images on several CPU processes (gloo): DDP, FSDP2 (the vision tower sharded per block like
the decoder) and HSDP give one unpartitioned process's loss and every parameter gradient, the
tower's included (float64, <= 1e-9), with a rank whose rows show no image (under FSDP2 it runs
a blank image through the sharded tower, so that its collectives match the others')."""

from __future__ import annotations

import pytest

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


@pytest.mark.slow
def test_ddp_and_fsdp2_with_images_equal_one_process(checkpoint):
    names = ["fsdp2", "ddp", "ddp-partitioned-grpo", "fsdp2-grpo", "fsdp2-lora-tower-frozen", "ddp-lora-tower-trained"]
    results = launch(vision_steps, 2, [dict(CASES[n], path=checkpoint) for n in names], deadline=900)
    for name, res in zip(names, results):
        check(res, name, tower="frozen" not in name, sharded=not name.startswith("ddp"))


@pytest.mark.parametrize("kind", ["separate", pytest.param("shared", marks=pytest.mark.slow)])
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
