"""Two CPU processes (gloo) through ``treelit-train``: DDP and FSDP2 updates equal
single-process training on the same global batch, with several backward passes per update
(micro-batches, partitions) and ranks that run different numbers of partitions; a run
killed with SIGKILL mid-training under FSDP2 resumes from its sharded checkpoint to the
weights of an uninterrupted run. Every run has a deadline (a hang fails, never blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import treelit
from cli import run, tail


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    prefix = list(range(1, 30))
    with (d / "trees.jsonl").open("w") as f:
        for t in range(6):  # trees of very different sizes: ranks get different shares
            branches = [{"input_ids": prefix[: 10 + 3 * t] + [(7 * b + t) % 300 + 50] * (10 + 5 * b)} for b in range(3 + t)]
            f.write(json.dumps({"id": f"t{t}", "branches": branches}) + "\n")
    return d


COMMON = [
    "data=jsonl", "data.shuffle=false", "data.micro_batch_tokens=200", "data.micro_batches_per_step=4",
    "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=2", "logger=none", "callbacks.checkpoint=null",
    "callbacks.progress=null", "trainer.enable_progress_bar=false", "model.config.num_layers=2",
    "model.config.embed_dim=32", "model.config.intermediate_dim=64",
]


def train(data: Path, name: str, *extra, common=COMMON) -> Path:
    out = data / name
    log = data / f"{name}.log"
    rc = run([*common, f"data.train_path={data / 'trees.jsonl'}", f"output_dir={out}", *extra], data, log)
    assert rc == 0, tail(log)
    return out


def weights(out: Path):
    return treelit.load_hf_checkpoint(out / "hf_checkpoint").state_dict()


@pytest.fixture(scope="module")
def single(data):
    return weights(train(data, "single"))


@pytest.mark.parametrize("trainer", [pytest.param("ddp_cpu", marks=pytest.mark.slow), "fsdp2_cpu"])
def test_two_processes_equal_one(data, single, trainer):
    got = weights(train(data, trainer, f"trainer={trainer}"))
    for k in single:
        torch.testing.assert_close(got[k], single[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("trainer", ["ddp_cpu", "fsdp2_cpu"])
def test_partitions_differing_between_ranks(data, single, trainer):
    """A 90-token budget cuts the larger trees into several partitions and leaves the small
    ones whole, so the two ranks run different numbers of backward passes (under FSDP2 the
    rank with fewer runs empty ones, every pass gathering and reducing per block). The logged
    loss is the step's, summed over the ranks' shares."""
    out = train(data, f"{trainer}_part", f"trainer={trainer}", "partition=redundancy_free", "partition.budget_tokens=90")
    got = weights(out)
    for k in single:
        torch.testing.assert_close(got[k], single[k], rtol=1e-5, atol=1e-6, msg=k)
    logged = json.loads((out / "summary.json").read_text())["metrics"]["loss"]
    one = json.loads((data / "single" / "summary.json").read_text())["metrics"]["loss"]
    assert logged == pytest.approx(one, rel=1e-5)


RESUME = [c for c in COMMON if not c.startswith(("optimizer", "callbacks.checkpoint", "trainer.max_steps"))] + [
    "optimizer=adamw", "optimizer.lr=0.01", "trainer=fsdp2_cpu", "partition=redundancy_free",
    "partition.budget_tokens=90", "callbacks.checkpoint.every_n_train_steps=1",
]


def test_fsdp2_killed_mid_training_resumes_to_the_uninterrupted_weights(data):
    """AdamW (sharded optimizer state), partitions: kill -9 every rank once the step-1 sharded
    checkpoint is complete (``meta.pt`` is written last), resume from it: the final weights
    equal, bit for bit, those of a run that was never interrupted."""
    full = weights(train(data, "uninterrupted", "trainer.max_steps=3", common=RESUME))
    killed = data / "killed"
    ckpt = killed / "checkpoints" / "step-000001.ckpt"
    rc = run([*RESUME, f"data.train_path={data / 'trees.jsonl'}", f"output_dir={killed}", "trainer.max_steps=50"],
             data, data / "killed.log", until=lambda: (ckpt / "meta.pt").is_file())
    assert rc == -9
    assert not (killed / "hf_checkpoint").exists(), "the run was killed before its end"
    resumed = weights(train(data, "resumed", "trainer.max_steps=3", f"resume_from={ckpt}", common=RESUME))
    for k in full:
        assert torch.equal(resumed[k], full[k]), k
