"""``treelit-train trainer=fsdp2_cpu trainer.strategy.context_parallel_degree=C``: each tree
row split over the C ranks of a group (FSDP2 shards the parameters over every rank), the
update equal to one process's in float64 (an attention model, a hybrid with recurrent layers, and a
mixture-of-experts model with its router load-balancing loss);
one run folder, one summary; bad options one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import treelit
from cli import run, tail
from test_multiprocess import COMMON, data  # noqa: F401  (the module fixture: six trees of different sizes)

F64 = ["model.dtype=float64"]


def train(data: Path, name: str, *extra, common=COMMON) -> Path:
    out = data / name
    log = data / f"{name}.log"
    rc = run([*common, *F64, f"data.train_path={data / 'trees.jsonl'}", f"output_dir={out}", *extra], data, log)
    assert rc == 0, tail(log)
    return out


def weights(out: Path):
    return treelit.load_hf_checkpoint(out / "hf_checkpoint", dtype=torch.float64).state_dict()


def close(got, want, what):
    """Every weight within 1e-9 of the one-process run's (relative to the tensor's largest entry)."""
    for k in want:
        d = (got[k].double() - want[k].double()).abs().max().item()
        assert d <= 1e-9 * max(want[k].abs().max().item(), 1e-12), (what, k, d)


@pytest.fixture(scope="module")
def single(data):  # noqa: F811
    return weights(train(data, "cp_single"))


def test_cp2_equals_one_process(data, single):  # noqa: F811
    """... and what context parallelism cost is in MLflow: the cost imbalance, and per rank the
    bytes received (rank 1 the path K/V, rank 0 their gradients) and the peak memory."""
    from test_multinode import metric_history

    db = data / "cp2_mlflow.db"
    mlflow = [c for c in COMMON if c != "logger=none"] + ["logger=mlflow", f"logger.mlflow.tracking_uri=sqlite:///{db}"]
    out = train(data, "cp2", "trainer=fsdp2_cpu", "trainer.strategy.context_parallel_degree=2", common=mlflow)
    close(weights(out), single, "C=2")
    summary = json.loads((out / "summary.json").read_text())
    one = json.loads((data / "cp_single" / "summary.json").read_text())
    assert summary["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-9)
    assert 0.0 <= summary["metrics"]["cp/imbalance"] < 1.0
    logged = {k: metric_history(db, k) for k in ("cp/imbalance", "cp/received_bytes/rank0", "cp/received_bytes/rank1",
                                                 "cp/peak_bytes/rank0", "cp/peak_bytes/rank1", "cp/peak_bytes_max",
                                                 "cp/received_bytes_max")}
    for k, history in logged.items():
        assert len(history) == 2, (k, history)  # every step
    for step in logged["cp/imbalance"]:
        assert 0.0 <= logged["cp/imbalance"][step] < 1.0
        recv = [logged[f"cp/received_bytes/rank{r}"][step] for r in (0, 1)]
        peak = [logged[f"cp/peak_bytes/rank{r}"][step] for r in (0, 1)]
        assert min(recv) > 0 and logged["cp/received_bytes_max"][step] == max(recv), recv
        assert min(peak) > 0 and logged["cp/peak_bytes_max"][step] == max(peak), peak


@pytest.mark.slow
@pytest.mark.parametrize("devices,C,R", [(4, 2, 1), (4, 4, 1), (4, 2, 2)])
def test_cp_with_data_parallel_groups_equals_one_process(data, single, devices, C, R):  # noqa: F811
    """C ranks per tree row; with R = 2 under HSDP (2 replicas of 1 shard x 2 CP ranks)."""
    out = train(data, f"cp{C}_of_{devices}_r{R}", "trainer=fsdp2_cpu", f"trainer.devices={devices}",
                f"trainer.strategy.context_parallel_degree={C}", f"trainer.strategy.replicate_degree={R}")
    close(weights(out), single, f"C={C} of {devices}, R={R}")


@pytest.mark.parametrize("args,expected", [
    pytest.param(["trainer=fsdp2_cpu", "trainer.strategy.context_parallel_degree=3"],
                 "trainer.strategy.context_parallel_degree=3 does not divide the 2 processes",
                 marks=pytest.mark.slow),
    (["trainer=ddp_cpu", "trainer.strategy.context_parallel_degree=2"],
     "context parallelism runs on the FSDP2 strategies"),
], ids=["not-dividing", "ddp"])
def test_bad_cp_options_fail_with_one_line(data, args, expected):  # noqa: F811
    log = data / "bad.log"
    common = [c for c in COMMON if not c.startswith("model.config")] if any(a.startswith("model=") for a in args) \
        else COMMON
    rc = run([*common, f"data.train_path={data / 'trees.jsonl'}", f"output_dir={data / 'bad'}", *args], data, log)
    text = log.read_text()
    assert rc != 0 and expected in text, tail(log)


@pytest.mark.slow
def test_cp2_hybrid_equals_one_process(data):  # noqa: F811
    """Attention + Gated DeltaNet + Mamba2 (``model=hybrid_tiny``): recurrent states and convolution
    contexts cross the two ranks under FSDP2; the update equals one process's."""
    hybrid = [c for c in COMMON if not c.startswith("model.config")] + ["model=hybrid_tiny"]
    single = weights(train(data, "cp_hybrid_single", common=hybrid))
    out = train(data, "cp2_hybrid", "trainer=fsdp2_cpu", "trainer.strategy.context_parallel_degree=2", common=hybrid)
    close(weights(out), single, "hybrid C=2")


@pytest.mark.slow
def test_cp2_moe_router_loss_equals_one_process(data):  # noqa: F811
    """Qwen3-MoE with its router load-balancing loss on (``model=qwen3_moe_tiny``, coefficient 0.1):
    the routing counts summed over the group, the router normaliser counting the group's trees
    once; the update, the loss and the router metrics equal one process's."""
    moe = [c for c in COMMON if not c.startswith("model.config")] + [
        "model=qwen3_moe_tiny", "model.router_aux_loss_coef=0.1", "model.config.num_layers=2",
        "model.config.embed_dim=32"]
    single = weights(train(data, "cp_moe_single", common=moe))
    out = train(data, "cp2_moe", "trainer=fsdp2_cpu", "trainer.strategy.context_parallel_degree=2", common=moe)
    close(weights(out), single, "moe C=2")
    got = json.loads((out / "summary.json").read_text())["metrics"]
    one = json.loads((data / "cp_moe_single" / "summary.json").read_text())["metrics"]
    for key in ("loss", "router_aux_loss", "moe/load_max_over_mean"):
        assert got[key] == pytest.approx(one[key], rel=1e-9), (key, got[key], one[key])


@pytest.mark.slow
def test_cp_under_torchrun_two_nodes_equals_one_process(data, single, tmp_path):  # noqa: F811
    """Two simulated machines (``torchrun --nnodes 2``, one process each) form one group of C = 2:
    one run folder, one summary, the one-process update."""
    from test_multinode import start_nodes, wait_all

    out = tmp_path / "cp_torchrun"
    args = [*COMMON, *F64, f"data.train_path={data / 'trees.jsonl'}", f"output_dir={out}", "trainer=fsdp2_cpu",
            "trainer.devices=1", "trainer.num_nodes=2", "trainer.strategy.context_parallel_degree=2"]
    procs = start_nodes(args, tmp_path, tmp_path)
    assert wait_all(procs, tmp_path, 400) == [0, 0], [p.read_text()[-2000:] for p in tmp_path.glob("node*.log")]
    close(weights(out), single, "torchrun C=2")
    assert json.loads((out / "summary.json").read_text())["global_step"] == 2
