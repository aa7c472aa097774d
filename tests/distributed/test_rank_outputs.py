"""Which process writes what into the output folder that every process of a run shares:
Hydra's ``.hydra/`` files and ``train.log`` are global rank 0's; process R > 0 of a
multi-process run (torchrun, srun, Lightning's launcher) logs to ``train.rank<R>.log``.
The two-node launch in ``test_multinode.py`` checks the folder it leaves."""

from __future__ import annotations

import pytest

from treelit.cli.config import CONF_DIR, rank_log_file, rank_zero_only, register_resolvers

RANK_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


@pytest.fixture
def rank(monkeypatch):
    def set_rank(var: str = "", value: str = "") -> None:
        for v in RANK_VARS:
            monkeypatch.delenv(v, raising=False)
        if var:
            monkeypatch.setenv(var, value)

    return set_rank


def _hydra_config(job_name: str):
    from hydra import compose, initialize_config_dir

    register_resolvers()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=out", f"hydra.job.name={job_name}"], return_hydra_config=True)
    cfg.hydra.runtime.output_dir = "/runs/out"
    return cfg


@pytest.mark.parametrize("var,value,subdir,log", [
    ("", "", ".hydra", "/runs/out/train.log"),  # one process
    ("RANK", "0", ".hydra", "/runs/out/train.log"),  # torchrun's global rank 0
    ("RANK", "3", None, "/runs/out/train.rank3.log"),  # torchrun, another node
    ("SLURM_PROCID", "5", None, "/runs/out/train.rank5.log"),  # srun
    ("SLURM_PROCID", "0", ".hydra", "/runs/out/train.log"),
], ids=["alone", "torchrun-0", "torchrun-3", "srun-5", "srun-0"])
def test_only_global_rank_zero_writes_hydra_files_and_train_log(rank, var, value, subdir, log):
    rank(var, value)
    cfg = _hydra_config("train")
    assert cfg.hydra.output_subdir == subdir
    assert cfg.hydra.job_logging.handlers.file.filename == log


def test_lightning_launcher_processes_log_to_their_rank_file(rank):
    """Lightning's launcher restarts the script as ``hydra.job.name=train_ddp_process_<R>
    hydra.output_subdir=null`` with ``LOCAL_RANK=R``: the same file name as under torchrun."""
    rank("LOCAL_RANK", "1")
    assert rank_log_file("train_ddp_process_1") == "train.rank1.log"
    cfg = _hydra_config("train_ddp_process_1")
    assert cfg.hydra.job_logging.handlers.file.filename == "/runs/out/train.rank1.log"
    rank("LOCAL_RANK", "0")
    assert rank_log_file("train") == "train.log" and rank_zero_only(".hydra") == ".hydra"


def test_lightning_launcher_on_a_later_machine_is_never_rank_zero(monkeypatch):
    """Lightning's own launcher started by hand on machine N > 0 (NODE_RANK, no RANK): its
    processes must not write rank 0's files nor take the folder lock, and name themselves
    by machine and local rank (their global rank is not known before Lightning launches)."""
    from treelit.cli.config import process_rank, rank_label

    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    assert process_rank() != 0 and rank_label() == "node1.rank0"
    assert rank_zero_only(".hydra") is None
    assert rank_log_file("train") == "train.node1.rank0.log"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_log_file("train_ddp_process_1") == "train.node1.rank1.log"
    monkeypatch.setenv("NODE_RANK", "0")  # the first machine: local rank = global rank
    assert process_rank() == 1 and rank_label() == "rank1"
    monkeypatch.delenv("LOCAL_RANK")
    assert process_rank() == 0 and rank_log_file("train") == "train.log"
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("RANK", "3")  # torchrun: the global rank wins
    assert process_rank() == 3 and rank_label() == "rank3"
