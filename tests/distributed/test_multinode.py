"""Two machines simulated on one: two ``torchrun --nnodes 2 --node-rank R --nproc-per-node 1``
launches on loopback (gloo, static rendezvous) run ``treelit-train trainer=fsdp2_cpu
trainer.num_nodes=2 trainer.devices=1`` in one shared working directory without an
``output_dir``. They train exactly as one process (float64), into one run folder (the
name global rank 0 made up, read by rank 1 from torchrun's store) with one sharded
checkpoint holding both ranks' shards, one export and one MLflow run. A node killed with
SIGKILL (or hung: SIGSTOP) makes the other launch exit non-zero with one line naming the
step. Only global rank 0 writes Hydra's ``.hydra/`` files and ``train.log`` there (rank 1:
``train.rank1.log``). Every launch has a deadline (a hang fails, never blocks)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import pytest
import torch

import treelit
from cli import run, tail

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

COMMON = [
    "data=jsonl", "data.shuffle=false", "data.micro_batch_tokens=200", "data.micro_batches_per_step=4",
    "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=2", "callbacks.progress=null",
    "trainer.enable_progress_bar=false", "model.dtype=float64", "model.config.num_layers=2",
    "model.config.embed_dim=32", "model.config.intermediate_dim=64", "partition=redundancy_free",
    "partition.budget_tokens=90",
]
TWO_NODES = ["trainer=fsdp2_cpu", "trainer.num_nodes=2", "trainer.devices=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes")
    prefix = list(range(1, 30))
    with (d / "trees.jsonl").open("w") as f:
        for t in range(6):  # trees of very different sizes: the nodes get different shares and partitions
            branches = [{"input_ids": prefix[: 10 + 3 * t] + [(7 * b + t) % 300 + 50] * (10 + 5 * b)} for b in range(3 + t)]
            f.write(json.dumps({"id": f"t{t}", "branches": branches}) + "\n")
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(args: Sequence[str], cwd: Path, logs: Path, nodes: int = 2, per_node: int = 1) -> List[subprocess.Popen]:
    """One ``torchrun`` per simulated node, each in its own process group (so a node can be killed whole)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("TREELIT_RUN_NAME", "HYDRA_FULL_ERROR"):  # errors as users see them: one line, no traceback
        env.pop(var, None)
    port = _free_port()
    procs = []
    for r in range(nodes):
        cmd = [TORCHRUN, "--nnodes", str(nodes), "--node-rank", str(r), "--nproc-per-node", str(per_node), "--master-addr",
               "127.0.0.1", "--master-port", str(port), "--no-python", str(Path(sys.executable).with_name("treelit-train")),
               *args]
        log = open(logs / f"node{r}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
    return procs


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found


def signal_node(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to a whole simulated node: every worker its torchrun agent started, and the agent."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL a whole simulated node (stopped or not)."""
    signal_node(proc, signal.SIGKILL)
    proc.wait()


def wait_all(procs: List[subprocess.Popen], logs: Path, timeout: float) -> List[int]:
    end = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > end:
                raise AssertionError(f"torchrun still running after {timeout}s (killed): " + node_logs(logs))
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
    return [p.returncode for p in procs]


def wait_for_step_1(procs: List[subprocess.Popen], work: Path, name: str, timeout: float = 400) -> None:
    """Until the run in ``work`` has written ``name`` into its step-1 checkpoint, every node still alive."""
    end = time.monotonic() + timeout
    while not list(work.glob(f"outputs/*/checkpoints/step-000001.ckpt/{name}")):
        assert all(p.poll() is None for p in procs), "a node ended before it was killed: " + node_logs(work)
        assert time.monotonic() < end, "no step-1 checkpoint: " + node_logs(work)
        time.sleep(0.2)


def node_logs(logs: Path) -> str:
    return "\n".join(f"--- {f.name}\n{tail(f)}" for f in sorted(logs.glob("node*.log")))


def metric_history(db: Path, key: str):
    """``{step: value}`` of metric ``key`` of the one MLflow run in sqlite store ``db``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}


def weights(out: Path):
    return treelit.load_hf_checkpoint(out / "hf_checkpoint", dtype=None).state_dict()  # as saved: float64


def test_run_name_of_each_launcher(monkeypatch):
    """No process: the names each launcher's environment gives, and rank 0's name through a
    torchrun-like store (a TCPStore held here, as torchrun's agent holds it)."""
    from datetime import timedelta

    import torch.distributed as dist

    from treelit.utils.launchers import launcher, launcher_run_name, shared_run_name

    fresh = iter(f"name{i}" for i in range(100)).__next__
    assert launcher_run_name(fresh, {}) == "name0" and launcher({}) is None
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
    assert launcher_run_name(fresh, slurm) == "slurm-4242"
    assert launcher_run_name(fresh, {**slurm, "SLURM_RESTART_COUNT": "2"}) == "slurm-4242-r2"
    assert launcher_run_name(fresh, {**slurm, "SLURM_NTASKS": "1"}) == "name1"  # one task: a run of its own
    tr = {"TORCHELASTIC_RUN_ID": "job7", "WORLD_SIZE": "2", "RANK": "1"}
    assert launcher_run_name(fresh, tr) == "torchrun-job7"
    assert launcher_run_name(fresh, {**tr, "TREELIT_RUN_NAME": "mine"}) == "mine"
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20))
    store_env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    chosen = launcher_run_name(fresh, {**store_env, "RANK": "0"})
    assert chosen == "name2"
    assert [launcher_run_name(fresh, {**store_env, "RANK": str(r)}) for r in (1, 2, 3)] == [chosen] * 3
    del server
    monkeypatch.delenv("TREELIT_RUN_NAME", raising=False)
    with shared_run_name("abc"):
        assert os.environ["TREELIT_RUN_NAME"] == "abc"
    assert "TREELIT_RUN_NAME" not in os.environ


# grpo: the bundled synthetic rollout groups, two PPO epochs, old log-probs recomputed (a collective pass)
GRPO = ["experiment=rl_synthetic", "data.max_trees=8", "data.shuffle=false", "data.micro_batch_tokens=400",
        "callbacks.reward_margin=null", "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=2",
        "callbacks.progress=null", "trainer.enable_progress_bar=false", "model.dtype=float64",
        "model.config.num_layers=2", "model.config.embed_dim=32", "model.config.intermediate_dim=64"]


CASES = {
    # sft: partitions (a fixed budget) that differ between the nodes' shares
    "sft": lambda data: [*COMMON, f"data.train_path={data / 'trees.jsonl'}"],
    "grpo": lambda data: list(GRPO),
    # a sequence-level objective, partitioned (a no-gradient log-prob pass, then the surrogate's passes)
    "gspo": lambda data: [*GRPO, "objective=gspo", "objective.clip_low=0.2", "objective.clip_high=0.2",
                          "partition=redundancy_free", "partition.budget_tokens=60"],
    # partitioned by the memory planner: a memory limit per rank, the budget the smallest over all ranks
    "planner": lambda data: [*GRPO, "partition=redundancy_free", "callbacks=planner",
                             "callbacks.memory_planner.memory_limit_bytes=[6000000,5000000]"],
}


def _args(objective: str, data: Path) -> List[str]:
    return CASES[objective](data)


HSDP = ["trainer=fsdp2_cpu", "trainer.num_nodes=2", "trainer.devices=2", "trainer.strategy.replicate_degree=2"]


@pytest.mark.slow  # about 3 minutes each on 2 cores
@pytest.mark.parametrize("objective,per_node", [("sft", 1), ("grpo", 1), ("gspo", 1), ("planner", 1), ("sft", 2)],
                         ids=["sft", "grpo", "gspo-partitioned", "grpo-planner-partitioned", "sft-hsdp-2x2"])
def test_two_nodes_train_as_one_process_into_one_run(data, objective, per_node):
    """``sft-hsdp-2x2``: two processes per node, HSDP with one replica per node. Each rank
    trains on its own share of every step's trees: rank 0's share (the ``tree_tokens`` it
    logs) is a part of the one process's, and the weights still match."""
    one, log = data / f"single_{objective}_{per_node}", data / f"single_{objective}_{per_node}.log"
    rc = run([*_args(objective, data), f"logger.mlflow.tracking_uri=sqlite:///{one}.db", f"output_dir={one}"], data, log)
    assert rc == 0, tail(log)
    single = weights(one)
    work = data / f"two_nodes_{objective}_{per_node}"
    work.mkdir()
    procs = start_nodes([*_args(objective, data), *(TWO_NODES if per_node == 1 else HSDP)], work, work,
                        per_node=per_node)
    assert wait_all(procs, work, 500) == [0, 0], node_logs(work)
    runs = sorted((work / "outputs").iterdir())
    assert len(runs) == 1, f"one run folder for both nodes, got {[r.name for r in runs]}"
    out = runs[0]
    got = weights(out)
    assert got.keys() == single.keys()
    for k in single:
        torch.testing.assert_close(got[k], single[k], rtol=1e-9, atol=1e-12, msg=k)
    assert all(v.dtype == torch.float64 for v in got.values())
    summary = json.loads((out / "summary.json").read_text())
    alone = json.loads((one / "summary.json").read_text())["metrics"]
    assert summary["metrics"]["loss"] == pytest.approx(alone["loss"], rel=1e-9)
    # different trees per rank: the tree tokens rank 0 trained on, step by step, are at most the one
    # process's and fewer in all (the other ranks trained on the rest: the weights match)
    mine, all_trees = metric_history(work / "mlflow.db", "tree_tokens"), metric_history(Path(f"{one}.db"), "tree_tokens")
    assert mine.keys() == all_trees.keys() and mine, (mine, all_trees)
    assert all(mine[s] <= all_trees[s] for s in mine) and sum(mine.values()) < sum(all_trees.values()), (mine, all_trees)
    if objective in ("sft", "gspo", "planner") and per_node == 1:  # partitioned: several passes per micro-batch
        passes, rows = metric_history(work / "mlflow.db", "partitions"), metric_history(work / "mlflow.db", "micro_batches")
        assert sum(passes.values()) > sum(rows.values()), (passes, rows)
    shards = sorted(p.name for p in (out / "checkpoints" / "last.ckpt").glob("*.distcp"))
    assert len(shards) == 2 * per_node, f"the sharded checkpoint holds both ranks' shards: {shards}"
    assert summary["mlflow"]["run_name"] == out.name, summary["mlflow"]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in found] == [(out.name, "FINISHED")]


@pytest.mark.parametrize("how", ["SIGKILL", pytest.param("SIGSTOP", marks=pytest.mark.slow)], ids=["killed", "hung"])
def test_a_killed_node_stops_the_other_naming_the_step(data, how):
    """Node 1 is killed with SIGKILL (``killed``), or stopped with SIGSTOP (``hung``: alive,
    its connections open, answering nothing), once the step-1 checkpoint exists; node 0's
    launch exits non-zero with one ``error:`` line naming the step - at once when node 1 is
    dead, after ``trainer.strategy.timeout_s`` when it hangs (about 2 minutes)."""
    work = data / f"{how}_node"
    work.mkdir()
    timeout_s = 60 if how == "SIGKILL" else 40
    args = [*COMMON, *TWO_NODES, f"data.train_path={data / 'trees.jsonl'}", "logger=none", "trainer.max_steps=200",
            "callbacks.checkpoint.every_n_train_steps=1", f"trainer.strategy.timeout_s={timeout_s}"]
    procs = start_nodes(args, work, work)
    try:
        wait_for_step_1(procs, work, ".metadata")
        signal_node(procs[1], getattr(signal, how))
        killed = time.monotonic()
        rc = wait_all(procs[:1], work, timeout_s + 60)[0]
        stopped_in = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
    text = tail(work / "node0.log", 20000)
    assert rc != 0, text
    assert stopped_in < timeout_s + 30, f"node 0 stopped {stopped_in:.0f}s after node 1 {how}: {text}"
    if how == "SIGSTOP":  # nothing tells node 0 that node 1 stopped: its collective times out
        assert stopped_in > timeout_s - 5, f"node 0 stopped {stopped_in:.0f}s after node 1 hung: {text}"
    errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and re.match(r"error: step \d+(, | \(data step \d+\), )rank 0 of 2: a collective failed",
                                         errors[0]), f"one error line naming the step: {text}"
    assert "[rank0]: Traceback" not in text, f"treelit printed a traceback: {text}"
    # the shared run folder: Hydra's files and train.log are global rank 0's, rank 1 logs to train.rank1.log
    (out,) = (work / "outputs").iterdir()
    files = {p.name for p in out.iterdir()}
    assert {".hydra", "config.yaml", "train.log", "train.rank1.log"} <= files, files
    assert not any(f.endswith(".log") and f not in ("train.log", "train.rank1.log") for f in files), files
    assert sorted(p.name for p in (out / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    for log in ("train.log", "train.rank1.log"):  # each rank logs its data line once, into its own file
        lines = (out / log).read_text().splitlines()
        assert sum("[treelit.train][INFO] - data: " in ln for ln in lines) == 1, (log, lines[:20])


@pytest.mark.slow  # about 3 minutes (one process per node) on 2 cores
@pytest.mark.parametrize("per_node", [1, 2], ids=["fsdp2", "hsdp-2x2"])
def test_two_nodes_resume_after_kill_to_the_uninterrupted_weights(data, per_node):
    """AdamW (sharded state), partitions, checkpoint every step: node 1 killed with SIGKILL
    once the step-1 checkpoint is complete (``meta.pt`` last), node 0 stops; both relaunched
    with ``resume_from`` reach the weights of a two-node run that was never interrupted."""
    base = [c for c in COMMON if not c.startswith(("optimizer", "trainer.max_steps"))] + [
        "optimizer=adamw", "optimizer.lr=0.01", "callbacks.checkpoint.every_n_train_steps=1", "logger=none",
        f"data.train_path={data / 'trees.jsonl'}", *(TWO_NODES if per_node == 1 else HSDP)]

    def launch(name: str, *extra: str) -> Path:
        work = data / f"{name}_{per_node}"
        work.mkdir()
        assert wait_all(start_nodes([*base, *extra], work, work, per_node=per_node), work, 500) == [0, 0], node_logs(work)
        (out,) = (work / "outputs").iterdir()
        return out

    full = weights(launch("uninterrupted", "trainer.max_steps=3"))
    work = data / f"killed_run_{per_node}"
    work.mkdir()
    procs = start_nodes([*base, "trainer.max_steps=50", "trainer.strategy.timeout_s=60"], work, work, per_node=per_node)
    try:
        wait_for_step_1(procs, work, "meta.pt")
        kill(procs[1])
        assert wait_all(procs[:1], work, 120)[0] != 0
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
    (ckpt,) = work.glob("outputs/*/checkpoints/step-000001.ckpt")
    resumed = weights(launch("resumed", "trainer.max_steps=3", f"resume_from={ckpt}"))
    for k in full:
        assert torch.equal(resumed[k], full[k]), k

