"""One run per output folder, waits that say what they wait for, checkpoints that do not vanish
silently.

- A second run given the ``output_dir`` of a running one fails at once with one line naming
  the holder, and leaves the first run's files alone; once the holder is dead (``kill -9``) or
  only its lock file is left, the next run takes the folder over.
- ``resume_from`` with ``output_dir`` = the run's own folder continues it there.
- Waiting on the MLflow store lock says every ``report_every`` s which file and which process.
- A checkpoint directory deleted mid-run is reported when the next checkpoint is written.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app_helpers import STALL
from cli_helpers import TINY, cli_env, finish, start
from treelit.utils.dir_lock import LOCK_NAME, DirLock, DirLocked, locked_dir


def _hold(directory: str, ready, release) -> None:
    with locked_dir(Path(directory)):
        ready.set()
        release.wait(60)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_dir_lock_names_its_holder_and_is_reentrant_in_one_process(tmp_path):
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / "out"), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(DirLocked, match=rf"in use by process {holder.pid}, started \d{{4}}-\d\d-\d\d "):
            DirLock.of(tmp_path / "out").acquire()
    finally:
        release.set()
        holder.join(60)
    assert not (tmp_path / "out" / LOCK_NAME).exists()  # removed by its holder
    with locked_dir(tmp_path / "out") as a, locked_dir(tmp_path / "out") as b:
        assert a is b and a.depth == 2
    assert not a.held and not (tmp_path / "out" / LOCK_NAME).exists()


def test_a_filesystem_without_locks_gets_a_warning_not_an_error(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from treelit.cli.preflight import lock_output_dir

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert lock_output_dir(tmp_path / "out") is None and lock_output_dir(tmp_path / "out") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: output_dir '{tmp_path / 'out'}': its filesystem cannot lock files (No locks available): "
                   "nothing stops another run from using this folder at the same time"]


def test_a_second_run_on_a_busy_output_dir_fails_at_once_and_a_killed_holder_is_taken_over(tmp_path, cli_main, capsys):
    """Run A (seed 0) stalls inside step 2; run B (seed 7, in this process) on A's folder exits 1
    with one line naming A's pid and start time, and every file of A's folder is unchanged. After A is
    killed with SIGKILL (no chance to release anything) run C trains in that folder."""
    out = tmp_path / "out"
    (tmp_path / "stall.py").write_text(STALL)
    marker = tmp_path / "stalled"
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    a = start(*TINY, "logger=none", "trainer.max_steps=5", "seed=0", f"output_dir={out}",
              "+callbacks.stall._target_=stall.Stall", "+callbacks.stall.at_step=1", f"+callbacks.stall.marker={marker}",
              cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert a.poll() is None, finish(a).stderr[-3000:]
            assert time.monotonic() < deadline, "run A never reached step 2"
            time.sleep(0.2)
        before = _snapshot(out)
        assert "seed: 0" in before["config.yaml"].decode()
        capsys.readouterr()
        assert cli_main(*TINY, "logger=none", "trainer.max_steps=1", "seed=7", f"output_dir={out}") == 1  # run B
        b = capsys.readouterr()
        lines = b.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: output_dir"), b.err
        assert f"in use by process {a.pid}, started " in lines[0] and str(out / LOCK_NAME) in lines[0]
        assert not b.out.strip() and "Traceback" not in b.err
        assert _snapshot(out) == before  # A's config (seed 0), log and lock untouched
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(60)
    capsys.readouterr()
    assert cli_main(*TINY, "logger=none", "trainer.max_steps=1", "seed=3", f"output_dir={out}") == 0
    assert f"took over the lock left by process {a.pid}" in capsys.readouterr().out
    assert "seed: 3" in (out / "config.yaml").read_text()
    assert not (out / LOCK_NAME).exists()


def test_a_lock_file_left_by_a_dead_process_is_taken_over(tmp_path, cli_main):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"pid={dead.pid} host=elsewhere started=2026-01-01 00:00:00 UTC\n")
    assert cli_main(*TINY, "logger=none", "callbacks.checkpoint=null", "trainer.max_steps=1", f"output_dir={out}") == 0
    log = (out / "train.log").read_text()
    assert f"took over the lock left by process {dead.pid} on host elsewhere, started 2026-01-01" in log
    assert json.loads((out / "summary.json").read_text())["global_step"] == 1
    assert not (out / LOCK_NAME).exists()


def test_resume_into_the_same_folder_continues_the_run_there(tmp_path, cli_main, recwarn):
    out = tmp_path / "run"
    common = [*TINY, "logger=none", "callbacks.checkpoint.every_n_train_steps=1", f"output_dir={out}"]
    assert cli_main(*common, "trainer.max_steps=2") == 0
    recwarn.clear()
    assert cli_main(*common, "trainer.max_steps=4", f"resume_from={out / 'checkpoints' / 'last.ckpt'}") == 0
    assert not [w for w in recwarn if "exists and is not empty" in str(w.message)]  # expected there: no warning
    s = json.loads((out / "summary.json").read_text())
    assert s["global_step"] == 4 and s["resumed_from"]["step"] == 2
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["last.ckpt", "step-000001.ckpt", "step-000002.ckpt", "step-000003.ckpt", "step-000004.ckpt"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(ckpts + [f"{c}.manifest.json" for c in ckpts])
    assert "max_steps: 4" in (out / "config.yaml").read_text()
    log = (out / "train.log").read_text()
    assert log.count("done: ") == 2  # both runs' lines, the second appended
    assert not (out / LOCK_NAME).exists()


def _hold_store(uri: str, ready, release) -> None:
    from treelit.utils.mlflow_store import store_lock

    with store_lock(uri):
        ready.set()
        release.wait(60)


def test_waiting_for_the_mlflow_store_lock_says_what_it_waits_for(tmp_path, caplog):
    from treelit.utils.mlflow_store import store_lock

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_store, args=(uri, ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with caplog.at_level("WARNING", logger="treelit.utils.mlflow_store"):
            with pytest.raises(TimeoutError, match=rf"mlflow.db.lock: still locked by process {holder.pid}"):
                with store_lock(uri, timeout=1.0, report_every=0.3):
                    pass
    finally:
        release.set()
        holder.join(60)
    waits = [r.getMessage() for r in caplog.records if "waiting for the store lock" in r.getMessage()]
    assert 2 <= len(waits) <= 4, waits
    assert f"{tmp_path / 'mlflow.db.lock'}, held by process {holder.pid}, started " in waits[0]
    with store_lock(uri, timeout=5):  # free again
        pass


DELETE_CHECKPOINTS = '''
import shutil
import lightning.pytorch as pl

class DeleteCheckpoints(pl.Callback):
    def __init__(self, dirpath, at_step):
        self.dirpath, self.at_step = dirpath, int(at_step)
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.at_step:
            shutil.rmtree(self.dirpath)
'''


def test_a_checkpoint_directory_deleted_mid_run_is_reported(tmp_path, cli_main, monkeypatch):
    """The checkpoint directory is removed at the end of step 2, before that step's checkpoint
    is written (Lightning runs checkpoint callbacks last): writing it warns once, naming the
    directory and the lost files (step 1's and the previous last.ckpt)."""
    (tmp_path / "delete_ckpts.py").write_text(DELETE_CHECKPOINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    ckpts = out / "checkpoints"
    assert cli_main(*TINY, "logger=none", "trainer.max_steps=3", "callbacks.checkpoint.every_n_train_steps=1",
                    f"output_dir={out}", "+callbacks.delete._target_=delete_ckpts.DeleteCheckpoints",
                    f"+callbacks.delete.dirpath={ckpts}", "+callbacks.delete.at_step=2") == 0
    log = (out / "train.log").read_text()
    lines = [line for line in log.splitlines() if "was deleted during the run" in line]
    assert len(lines) == 1, log
    assert "[WARNING]" in lines[0] and f"checkpoint directory {ckpts} was deleted" in lines[0]
    assert "(step-000001.ckpt, last.ckpt) are lost" in lines[0] and "writing step-000002.ckpt" in lines[0]
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt", "step-000002.ckpt", "step-000003.ckpt"]
