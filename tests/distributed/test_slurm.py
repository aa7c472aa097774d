"""``srun treelit-train`` simulated on one machine: two processes started by hand with the
environment ``srun`` gives the tasks of a 2-node job with one task per node
(``SLURM_NTASKS=2``, ``SLURM_NTASKS_PER_NODE=1``, ``SLURM_NNODES=2``, ``SLURM_PROCID`` /
``SLURM_NODEID`` 0 and 1, ``SLURM_LOCALID=0``, ``SLURM_JOB_ID``, ``SLURM_NODELIST`` the
loopback host), each running ``treelit-train trainer=fsdp2_cpu trainer.num_nodes=2
trainer.devices=1`` in one shared working directory without an ``output_dir``.

Lightning picks its ``SLURMEnvironment`` from that environment by itself (nothing here
sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` or ``MASTER_PORT``): ranks from the
``SLURM_*`` variables, the main address from ``SLURM_NODELIST``, the port from the job id
(its last four digits + 15000, so the test picks a job id whose port is free). The run
trains exactly as one process (float64), into one folder ``outputs/slurm-<job id>`` with
both ranks' checkpoint shards, one export and one MLflow run of that name; only global
rank 0 writes Hydra's ``.hydra/`` files and ``train.log`` (rank 1: ``train.rank1.log``).

Not simulated: a real scheduler (no ``slurmd``, no ``scontrol``, no requeue signal), node
names that resolve to different hosts (both "nodes" are this machine)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch

from cli import run, tail
from test_multinode import COMMON, HSDP, TWO_NODES, metric_history, node_logs, wait_all, weights

EXE = str(Path(sys.executable).with_name("treelit-train"))


def _free_job_id() -> str:
    """A job id whose port under Lightning's rule (last four digits + 15000) is free here."""
    for _ in range(200):
        suffix = random.randrange(1000, 10000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + suffix))
            except OSError:
                continue
        return f"7{suffix:04d}"
    raise RuntimeError("no free port in 16000-24999")


def slurm_env(job_id: str, proc_id: int, nodes: int, per_node: int, nodelist: str = "localhost") -> Dict[str, str]:
    """The variables ``srun`` sets for task ``proc_id`` of a job of ``nodes`` x ``per_node`` tasks
    (blocks of consecutive tasks per node, SLURM's default distribution)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "GROUP_", "ROLE_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                         "MASTER_PORT", "TREELIT_RUN_NAME", "HYDRA_FULL_ERROR")}
    node = proc_id // per_node
    env.update(OMP_NUM_THREADS="1", SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME="treelit-sft",
               SLURM_STEP_ID="0", SLURM_NTASKS=str(nodes * per_node), SLURM_NPROCS=str(nodes * per_node),
               SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist, SLURM_PROCID=str(proc_id),
               SLURM_LOCALID=str(proc_id % per_node), SLURM_NODEID=str(node), SLURMD_NODENAME=f"node{node}")
    return env


def start_tasks(args: Sequence[str], cwd: Path, job_id: str, nodes: int = 2, per_node: int = 1) -> List[subprocess.Popen]:
    """One ``treelit-train`` per task, as ``srun`` starts them; output in ``cwd/node<N>.task<R>.log``."""
    procs = []
    for r in range(nodes * per_node):
        log = open(cwd / f"node{r // per_node}.task{r}.log", "w")
        procs.append(subprocess.Popen([EXE, *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                      env=slurm_env(job_id, r, nodes, per_node), start_new_session=True))
    return procs


def test_slurm_env_is_lightnings_slurm_environment(monkeypatch):
    """No process: Lightning reads the simulated tasks' environment as srun's (it would pick
    ``SLURMEnvironment``, with these ranks, address and port) and treelit names the run after the job."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    from treelit.cli.config import process_rank
    from treelit.utils.launchers import launcher, launcher_run_name

    for r, per_node in [(0, 1), (1, 1), (0, 2), (1, 2), (2, 2), (3, 2)]:
        env = slurm_env("71234", r, 2, per_node)
        for k in list(os.environ):
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert SLURMEnvironment.detect() and not TorchElasticEnvironment.detect()
        slurm = SLURMEnvironment()
        slurm.validate_settings(num_devices=per_node, num_nodes=2)
        with pytest.raises(ValueError, match=f"ntasks-per-node={per_node}"):
            slurm.validate_settings(num_devices=3, num_nodes=2)
        assert (slurm.world_size(), slurm.global_rank(), slurm.local_rank(), slurm.node_rank()) == (
            2 * per_node, r, r % per_node, r // per_node)
        assert (slurm.main_address, slurm.main_port) == ("localhost", 15000 + 1234)
        assert process_rank() == r and launcher() == "slurm"
        assert launcher_run_name(lambda: "fresh") == "slurm-71234"


@pytest.mark.slow  # about 1 (2 x 1) and 2 (2 x 2) minutes on 2 cores: the one-process reference, then the tasks
@pytest.mark.parametrize("per_node", [1, 2], ids=["fsdp2-2x1", "hsdp-2x2"])
def test_srun_two_nodes_train_as_one_process_into_the_jobs_run(tmp_path, per_node):
    """``hsdp-2x2``: the README's sbatch shape, two tasks per node (``SLURM_LOCALID`` 0 and 1,
    global ranks 0-3) and HSDP with one replica per node."""
    data = tmp_path / "trees.jsonl"
    prefix = list(range(1, 30))
    with data.open("w") as f:
        for t in range(6):  # trees of very different sizes: the tasks get different shares and partitions
            branches = [{"input_ids": prefix[: 10 + 3 * t] + [(7 * b + t) % 300 + 50] * (10 + 5 * b)} for b in range(3 + t)]
            f.write(json.dumps({"id": f"t{t}", "branches": branches}) + "\n")
    args = [*COMMON, f"data.train_path={data}"]
    one = tmp_path / "single"
    rc = run([*args, f"logger.mlflow.tracking_uri=sqlite:///{one}.db", f"output_dir={one}"], tmp_path, tmp_path / "single.log")
    assert rc == 0, tail(tmp_path / "single.log")

    work = tmp_path / "job"
    work.mkdir()
    job_id = _free_job_id()
    procs = start_tasks([*args, *(TWO_NODES if per_node == 1 else HSDP)], work, job_id, per_node=per_node)
    assert wait_all(procs, work, 600) == [0] * 2 * per_node, node_logs(work)
    runs = sorted(p.name for p in (work / "outputs").iterdir())
    assert runs == [f"slurm-{job_id}"], f"one run folder named after the job, got {runs}"
    out = work / "outputs" / runs[0]

    single, got = weights(one), weights(out)
    assert got.keys() == single.keys()
    for k in single:
        torch.testing.assert_close(got[k], single[k], rtol=1e-9, atol=1e-12, msg=k)
    assert all(v.dtype == torch.float64 for v in got.values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["loss"] == pytest.approx(json.loads((one / "summary.json").read_text())["metrics"]["loss"],
                                                       rel=1e-9)
    # two ranks trained: rank 0 logged a part of each step's trees, and both ranks' shards were saved
    mine, all_trees = metric_history(work / "mlflow.db", "tree_tokens"), metric_history(Path(f"{one}.db"), "tree_tokens")
    assert mine.keys() == all_trees.keys() and mine, (mine, all_trees)
    assert sum(mine.values()) < sum(all_trees.values()), (mine, all_trees)
    shards = sorted(p.name for p in (out / "checkpoints" / "last.ckpt").glob("*.distcp"))
    assert len(shards) == 2 * per_node, f"the sharded checkpoint holds every rank's shards: {shards}"

    logs = ["train.log", *(f"train.rank{r}.log" for r in range(1, 2 * per_node))]
    files = {p.name for p in out.iterdir()}
    assert {".hydra", "config.yaml", "summary.json", "hf_checkpoint", *logs} <= files, files
    assert not any(f.endswith(".log") and f not in logs for f in files), files
    assert sorted(p.name for p in (out / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    for log in logs:  # each rank logs its data line once, into its own file
        lines = (out / log).read_text().splitlines()
        assert sum("[treelit.train][INFO] - data: " in ln for ln in lines) == 1, (log, lines[:20])

    assert summary["mlflow"]["run_name"] == out.name, summary["mlflow"]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in found] == [(out.name, "FINISHED")]


def test_launch_mismatch_names_the_options():
    """No process: ``trainer.devices`` / ``num_nodes`` against the tasks srun (or torchrun) started."""
    from treelit.utils.launchers import launch_mismatch

    job = slurm_env("71234", 0, 2, 2)
    assert launch_mismatch(2, 2, job) is None
    assert "but SLURM started 4 tasks (SLURM_NTASKS)" in launch_mismatch(1, 2, job)
    assert "SLURM starts 2 tasks per node (--ntasks-per-node)" in launch_mismatch(1, 4, job)
    assert "the SLURM job has 2 nodes (--nodes)" in launch_mismatch(4, 1, {**job, "SLURM_NTASKS_PER_NODE": "4"})
    assert "without --ntasks-per-node" in launch_mismatch(2, 2, {k: v for k, v in job.items() if k != "SLURM_NTASKS_PER_NODE"})
    assert launch_mismatch(1, 2, {**job, "SLURM_JOB_NAME": "interactive"}) is None  # Lightning ignores SLURM then
    assert launch_mismatch("auto", 2, job) is None
    batch = {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}  # sbatch's script itself, no srun
    assert launch_mismatch(1, 1, batch) is None and "but SLURM started 1 task (" in launch_mismatch(2, 1, batch)
    torchrun = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4", **job}  # srun torchrun: torchrun's numbers count
    assert launch_mismatch(2, 2, torchrun) is None and launch_mismatch(1, 4, torchrun) is None
    assert "but torchrun started 4 (WORLD_SIZE)" in launch_mismatch(1, 2, torchrun)
    assert launch_mismatch(2, 1, {}) is None  # no external launcher: Lightning starts the processes


def test_srun_tasks_that_do_not_match_trainer_devices_are_one_error_line(tmp_path):
    """Two tasks of a 2 x 1 job told ``trainer.devices=2``: each exits 1 with one ``error:`` line
    naming the options before reading the data (Lightning itself would fail later, in the
    device mesh, with a traceback)."""
    (tmp_path / "trees.jsonl").write_text(json.dumps({"id": "t", "branches": [{"input_ids": [1, 2, 3]}]}) + "\n")
    args = [*COMMON, f"data.train_path={tmp_path / 'trees.jsonl'}", "trainer=fsdp2_cpu", "trainer.num_nodes=2",
            "trainer.devices=2", "logger=none"]
    assert wait_all(start_tasks(args, tmp_path, _free_job_id()), tmp_path, 300) == [1, 1], node_logs(tmp_path)
    for rank, log in enumerate(sorted(tmp_path.glob("node*.log"))):  # rank R > 0 prefixes its lines "[rank R] "
        text = log.read_text()
        assert "Traceback" not in text and "data: " not in text, (log.name, text)
        prefix = f"[rank {rank}] " if rank else ""
        assert [ln[len(prefix):] for ln in text.splitlines() if ln.startswith(prefix + "error: ")] == ["error: trainer.devices=2 x trainer.num_nodes=2 = 4 processes, but SLURM started "
                                     "2 tasks (SLURM_NTASKS): set trainer.devices to --ntasks-per-node and "
                                     "trainer.num_nodes to --nodes, and start the tasks with srun"], (log.name, text)
