"""Soak: one run killed again and again - SIGKILL and SIGTERM to its whole process group at
random moments: while the MLflow store is created, during the rest of start-up, in the
middle of a checkpoint file, during training - and continued with ``resume_from=auto`` after
each. Every SIGTERM ends the run with code 75 and one line; the folder never holds a
final-named checkpoint without its manifest or a ``-v1`` name; after the last kill the run
finishes with weights and optimizer state bit-identical to a run never interrupted, and its
MLflow run has every step exactly once.

    SOAK_KILLS=40 SOAK_SEED=1 python -m pytest -q -n0 -s tests/faults/test_soak.py -m slow

(``-s`` prints one line per kill and the totals.) Signals go out once treelit's handler is
installed (``SigCgt`` in /proc): the tenth of a second in which Python itself starts, before
any treelit code runs, is the one moment a SIGTERM still ends a run with the default action.
The run is slowed by a test callback (``injectors.Pace``: each step 0.2 s longer, each
checkpoint file written in two halves 0.15 s apart) so that random moments fall in every
phase."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from fault_runs import EXE, TINY, env, inject, write_trees
from treelit.cli.train import read_resume_checkpoint
from treelit.utils.integrity import MANIFEST_SUFFIX

STEPS = 60
KILLS = int(os.environ.get("SOAK_KILLS", "32"))
SEED = int(os.environ.get("SOAK_SEED", "0"))


def _args(data: Path, out: Path, db: Path, logger: bool = True):
    tiny = [a for a in TINY if a != "logger=none"] if logger else list(TINY)
    extra = [f"logger.mlflow.tracking_uri=sqlite:///{db}"] if logger else []
    return [*tiny, *extra, f"data.train_path={data}", f"output_dir={out}", f"trainer.max_steps={STEPS}",
            "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=1", "resume_from=auto",
            *inject("pace", "Pace", step_s=0.2, write_s=0.15)]


def _state(ckpt: Path) -> dict:
    c = torch.load(ckpt, map_location="cpu", weights_only=True)
    flat = {f"w.{k}": v for k, v in c["state_dict"].items()}
    for i, opt in enumerate(c["optimizer_states"]):
        for p, st in opt["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    flat[f"opt{i}.{p}.{k}"] = v
    return flat


def _done_steps(d: Path) -> int:
    try:
        return int(torch.load(d / "last.ckpt", map_location="cpu", weights_only=True)["global_step"])
    except Exception:
        return -1


def _check_folder(d: Path) -> None:
    if not d.is_dir():
        return
    names = [p.name for p in d.iterdir()]
    assert not [n for n in names if "-v1" in n], names
    for n in names:
        if n.endswith(".ckpt") and not (d / (n + MANIFEST_SUFFIX)).exists():
            # a kill between the two renames leaves the manifest first; a checkpoint with none is a defect
            raise AssertionError(f"{n} without its manifest: {sorted(names)}")


class _Run:
    """One ``treelit-train`` process in its own session; output to files in ``cwd``."""

    def __init__(self, args, cwd: Path, n: int) -> None:
        self.out, self.err = cwd / f"a{n}.out", cwd / f"a{n}.err"
        with self.out.open("w") as fo, self.err.open("w") as fe:
            self.proc = subprocess.Popen([EXE, *args], cwd=cwd, stdout=fo, stderr=fe, env=env(),
                                         start_new_session=True)
        self.started = time.monotonic()

    def wait_for(self, cond, timeout: float = 180.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if cond():
                return True
            time.sleep(0.005)
        return False

    def catches_sigterm(self) -> bool:
        """treelit's handler is installed (``SigCgt`` of /proc/PID/status): before it, Python's own
        start (about 0.1 s), a SIGTERM ends the process with the default action."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
        except OSError:
            pass
        return False

    def printed(self, text: str) -> bool:
        return text in self.out.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"still running after {timeout}s: {self.err.read_text()[-3000:]}") from None


@pytest.mark.slow
def test_soak_random_kills_then_resume(tmp_path):
    rng = random.Random(SEED)
    data = write_trees(tmp_path / "trees.jsonl")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ref = tmp_path / "reference"
    r = _Run(_args(data, ref, tmp_path / "unused.db", logger=False), cwd, 0)
    assert r.finish() == 0, r.err.read_text()[-3000:]

    out, db = tmp_path / "run", tmp_path / "mlflow.db"
    ckdir = out / "checkpoints"
    args = _args(data, out, db)
    log = []
    n = 0
    store_kills = 4  # the first kills land while the store is being created
    while len([e for e in log if e["sent"]]) < KILLS:
        n += 1
        done = _done_steps(ckdir)
        if done >= STEPS - 1:
            break  # the last steps are left to finish: a kill after the last step would end nothing
        run = _Run(args, cwd, n)
        sig = signal.SIGKILL if rng.random() < 0.75 else signal.SIGTERM
        if store_kills > 0 and not db.exists():
            mode = "store"
            store_kills -= 1
        else:
            mode = rng.choice(["start-up", "write", "write", "step", "step"])
        if mode == "store":
            run.wait_for(run.catches_sigterm)
            hit = run.wait_for(lambda: any(p.name.startswith(".mlflow.db.creating-") for p in tmp_path.iterdir()))
            time.sleep(rng.uniform(0.0, 1.2))
        elif mode == "start-up":
            hit = run.wait_for(run.catches_sigterm)
            time.sleep(rng.uniform(0.0, 6.0))
        elif mode == "write":  # a partial file written by this run (what a kill left is removed first)
            hit = run.wait_for(lambda: run.printed("resume_from=auto:")) and run.wait_for(
                lambda: ckdir.is_dir() and any(p.name.endswith(".ckpt.partial") for p in ckdir.iterdir()))
            time.sleep(rng.uniform(0.0, 0.15))
        else:
            start = len(list(ckdir.glob("step-*.ckpt"))) if ckdir.is_dir() else 0
            hit = run.wait_for(lambda: ckdir.is_dir() and len(list(ckdir.glob("step-*.ckpt"))) > start)
            time.sleep(rng.uniform(0.0, 0.6))
        sent = run.proc.poll() is None
        if sent:
            run.signal(sig)
        rc = run.finish()
        err = run.err.read_text(errors="replace")
        entry = {"n": n, "mode": mode, "signal": signal.Signals(sig).name, "hit": hit, "sent": sent, "rc": rc,
                 "steps_before": done, "steps_after": _done_steps(ckdir)}
        log.append(entry)
        print(json.dumps(entry), flush=True)
        if not sent:
            assert rc == 0, err[-3000:]  # it ended before the signal: it must have ended well
            continue
        if sig == signal.SIGKILL:
            assert rc in (-9, 0), err[-3000:]
        else:
            lines = err.strip().splitlines()
            assert rc == 75 and len(lines) == 1 and lines[0].startswith("error: preempted by SIGTERM"), \
                (rc, err[-3000:])
        _check_folder(ckdir)

    run = _Run(args, cwd, n + 1)
    rc = run.finish()
    assert rc == 0, run.err.read_text()[-3000:]
    _check_folder(ckdir)
    a, b = _state(ckdir / "last.ckpt"), _state(ref / "checkpoints" / "last.ckpt")
    assert a.keys() == b.keys()
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, differ
    link = read_resume_checkpoint(str(ckdir / "last.ckpt"))["mlflow"]
    client = MlflowClient(link["tracking_uri"])
    keys = [k for k in client.get_run(link["run_id"]).data.metrics if not k.startswith("data/")]
    wrong = {k: steps for k in keys
             if (steps := sorted(m.step for m in client.get_metric_history(link["run_id"], k))) != list(range(STEPS))}
    assert "loss" in keys and not wrong, wrong
    sent = [e for e in log if e["sent"]]
    by = {}
    for e in sent:
        by[f"{e['signal']} {e['mode']}"] = by.get(f"{e['signal']} {e['mode']}", 0) + 1
    print(f"soak: {len(sent)} kills survived ({sum(e['signal'] == 'SIGKILL' for e in sent)} SIGKILL, "
          f"{sum(e['signal'] == 'SIGTERM' for e in sent)} SIGTERM): {json.dumps(by, sort_keys=True)}; "
          f"{len(log) + 1} runs; final weights and optimizer state bit-identical, {len(keys)} metrics each at steps "
          f"0..{STEPS - 1} exactly once", flush=True)
    assert len(sent) >= min(KILLS, 30)
