"""Running ``treelit-train`` in a subprocess with a deadline: the whole process group (every
rank Lightning launches) is killed when it passes, so a hang fails the test instead of
blocking it, and no rank outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

EXE = str(Path(sys.executable).with_name("treelit-train"))


def start(args: Sequence[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    f = open(log, "w")
    return subprocess.Popen([EXE, *args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run(args: Sequence[str], cwd: Path, log: Path, timeout: float = 400,
        until: Optional[Callable[[], bool]] = None) -> int:
    """Run to the end (the exit code), or - with ``until`` - kill every rank with SIGKILL as
    soon as ``until()`` is true (returns -9; fails if the run ended before)."""
    proc = start(args, cwd, log)
    end = time.monotonic() + timeout
    while proc.poll() is None:
        if until is not None and until():
            kill(proc)
            return -9
        if time.monotonic() > end:
            kill(proc)
            raise AssertionError(f"treelit-train still running after {timeout}s (killed): {log.read_text()[-3000:]}")
        time.sleep(0.1)
    if until is not None:
        raise AssertionError(f"the run ended (exit {proc.returncode}) before it could be killed: {log.read_text()[-3000:]}")
    return proc.returncode


def tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:]
