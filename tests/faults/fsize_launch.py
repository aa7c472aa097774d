"""``treelit-train`` / ``treelit-rollout`` under a file-size limit set at a chosen moment.

``RLIMIT_FSIZE`` makes the kernel refuse any write past the limit with ``EFBIG`` (SIGXFSZ is
ignored here, so the write fails instead of the process being killed): a real failed write,
from inside torch, safetensors or shutil, as a full disk gives. Only *when* it starts is
chosen, by wrapping one treelit function:

``FSIZE_LIMIT``  the limit in bytes (soft limit; files already larger stay readable)
``FSIZE_AT``     ``start``         from the first line of the run
                 ``checkpoint:N``  before the N-th checkpoint write (0: the first)
                 ``export``        before the final export
                 ``artifacts``     after the export is on disk, before its MLflow copies
                 ``publish:N``     before the N-th policy publish (0: version 0)
``FSIZE_RANK``   the rank whose process gets the limit (default 0; Lightning's launcher gives
                 the processes it starts ``LOCAL_RANK``)
``FSIZE_ONCE``   ``1``: lift the limit again when that one call returns (or raises): only its
                 writes meet it

Run as ``python fsize_launch.py train|rollout ARGS...``. Lightning's launcher starts the other
ranks with this same file and arguments, so each process decides for itself.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve()

# a one-layer model on 8 trees, no progress bar (runs share 2 cores)
TINY = ["model.config.num_layers=1", "model.config.embed_dim=32", "model.config.intermediate_dim=64",
        "data.max_trees=8", "callbacks.progress=null", "trainer.enable_progress_bar=false"]


def cli_env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def run_limited(command: str, args: Sequence[str], cwd: Path, at: Optional[str] = None, limit: int = 0,
                rank: int = 0, once: bool = False, timeout: float = 400) -> subprocess.CompletedProcess:
    """``treelit-train`` (``command="train"``) or ``treelit-rollout`` with the file-size limit
    ``limit`` set at ``at`` (None: no limit) in the process of ``rank`` (``once``: for that one
    call only)."""
    env = cli_env(**({"FSIZE_AT": at, "FSIZE_LIMIT": str(limit), "FSIZE_RANK": str(rank),
                      "FSIZE_ONCE": "1" if once else "0"} if at else {}))
    proc = subprocess.Popen([sys.executable, str(HERE), command, *args], cwd=str(cwd), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # every rank Lightning started: a hang fails, never blocks
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout}s (killed): {err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_error_line(stderr: str) -> str:
    """The whole of stderr must be one ``error: ...`` line (no traceback, no rank's echo): it."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-4000:]
    return lines[0]


def leftovers(root: Path) -> List[Path]:
    """Temporary files or folders of an interrupted write anywhere under ``root``."""
    return sorted(p for p in Path(root).rglob("*") if ".partial" in p.name or ".tmp-" in p.name
                  or ".old-" in p.name or ".trash-" in p.name)


_UNLIMITED = resource.getrlimit(resource.RLIMIT_FSIZE)


def _limit() -> None:
    n = int(os.environ["FSIZE_LIMIT"])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, _UNLIMITED[1]))


def _lift() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, _UNLIMITED)


def _before(owner, name: str, index: int = 0) -> None:
    """Set the limit before call number ``index`` of ``owner.name`` (``FSIZE_ONCE=1``: for that
    call only)."""
    original = getattr(owner, name)
    calls = [0]
    once = os.environ.get("FSIZE_ONCE") == "1"

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        this = calls[0]
        calls[0] += 1
        if this != index:
            return original(*args, **kwargs)
        _limit()
        try:
            return original(*args, **kwargs)
        finally:
            if once:
                _lift()

    setattr(owner, name, wrapper)


def _after(owner, name: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        _limit()
        return out

    setattr(owner, name, wrapper)


def install() -> None:
    at = os.environ.get("FSIZE_AT", "")
    if not at or int(os.environ.get("LOCAL_RANK", "0")) != int(os.environ.get("FSIZE_RANK", "0")):
        return
    what, _, n = at.partition(":")
    if what == "start":
        _limit()
    elif what == "checkpoint":
        from treelit.lightning.callbacks import TreeCheckpoint

        _before(TreeCheckpoint, "_save_checkpoint", int(n or 0))
    elif what == "export":
        from treelit.lightning.callbacks import HFExport

        _before(HFExport, "_export")
    elif what == "artifacts":
        from treelit.lightning.callbacks import HFExport

        _after(HFExport, "_export")
    elif what == "publish":
        from treelit.lightning.publish import PolicyPublisher

        _before(PolicyPublisher, "publish", int(n or 0))
    else:
        raise SystemExit(f"FSIZE_AT={at!r}: not a point this launcher knows")


if __name__ == "__main__":
    install()
    command = sys.argv.pop(1) if len(sys.argv) > 1 and sys.argv[1] in ("train", "rollout") else "train"
    if command == "rollout":
        from treelit.cli.rollout import main
    else:
        from treelit.cli.train import main
    main()
