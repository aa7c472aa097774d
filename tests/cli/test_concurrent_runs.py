"""Runs started at the same moment on one fresh MLflow database.

Before the store lock, two ``treelit-train`` runs started together on a fresh
``./mlflow.db`` crashed one of them in about half the tries (alembic migration race:
"Online migration expected to match one row", "duplicate column name: step",
"table _alembic_tmp_... already exists", "no such column: spans.dimension_attributes");
four at once crashed three or four of them. These tests are that reproduction.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from cli_helpers import TINY, finish, runs, start


def _open_and_log(uri: str, i: int, barrier, results) -> None:
    try:
        from treelit.lightning.mlflow_logger import TreeMLFlowLogger

        barrier.wait(timeout=120)  # every process is ready: open the store together
        lg = TreeMLFlowLogger(experiment_name="race", run_name=f"r{i}", tracking_uri=uri)
        lg.log_hyperparams({"i": i})
        lg.log_metrics({"x": float(i)}, step=0)
        lg.finalize("success")
        results.put((i, "ok"))
    except BaseException as exc:  # reported to the test
        results.put((i, f"{type(exc).__name__}: {exc}"))


def test_four_processes_open_one_fresh_store_at_the_same_moment(tmp_path):
    """Store level, started behind a barrier: create + migrate the database, create the
    experiment, create a run, log - four times at once, all succeed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # fork: the children share this process's imports (spawned ones would spend seconds importing)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_open_and_log, args=(uri, i, barrier, results)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    outcome = dict(results.get(timeout=10) for _ in procs)
    assert outcome == {i: "ok" for i in range(4)}, outcome
    _, rs = runs(uri, "race")
    assert sorted(r.info.run_name for r in rs) == ["r0", "r1", "r2", "r3"]
    assert {r.info.status for r in rs} == {"FINISHED"}
    assert sorted(r.data.params["i"] for r in rs) == ["0", "1", "2", "3"]


def _simultaneous(tmp_path, n: int):
    procs = [start(*TINY, "trainer.max_steps=2", f"seed={i}", cwd=tmp_path) for i in range(n)]
    done = [finish(p) for p in procs]
    for i, d in enumerate(done):
        assert d.returncode == 0, f"run {i} failed:\n{d.stdout[-2000:]}\n{d.stderr[-4000:]}"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _, rs = runs(uri)
    assert len(rs) == n and {r.info.status for r in rs} == {"FINISHED"}
    names = {r.info.run_name for r in rs}
    assert len(names) == n, names  # unique run names
    # unique default output folders, each with its own config (its own seed), checkpoints unsuffixed
    outs = sorted((tmp_path / "outputs").iterdir())
    assert len(outs) == n and {o.name for o in outs} == names
    seeds = sorted(int(next(line for line in (o / "config.yaml").read_text().splitlines()
                            if line.startswith("seed:")).split()[1]) for o in outs)
    assert seeds == list(range(n))
    for o in outs:
        assert sorted(p.name for p in (o / "checkpoints").iterdir()) == ["last.ckpt", "last.ckpt.manifest.json"]
        assert (o / "hf_checkpoint" / "model.safetensors").is_file()
    # each run's logged config is its own
    for r in rs:
        out = r.data.tags["treelit.output_dir"]
        assert r.data.params["seed"] == next(line for line in open(f"{out}/config.yaml")
                                             if line.startswith("seed:")).split()[1]
    # artifacts beside the database, not in the working directory's default
    assert all((tmp_path / "mlruns" / r.info.run_id / "artifacts" / "config.yaml").is_file() for r in rs)


def test_two_runs_started_together_on_a_fresh_database(tmp_path):
    _simultaneous(tmp_path, 2)


@pytest.mark.slow
def test_four_runs_started_together_on_a_fresh_database(tmp_path):
    _simultaneous(tmp_path, 4)
