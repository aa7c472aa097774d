"""The local MLflow store shared by concurrent runs, and the liveness of the runs in it.

Why a lock: MLflow creates and migrates a fresh sqlite store (``sqlite:///mlflow.db``)
with alembic the first time a client opens it. Two processes opening the same fresh
file at the same moment both run the migrations and one of them crashes ("Online
migration expected to match one row", "duplicate column name", "table
_alembic_tmp_... already exists"). Creating the experiment has the same race (both
see no experiment, both create it). Every step that can create something in the
store - opening it, getting or creating the experiment, creating or reopening a run -
therefore runs under an exclusive ``fcntl`` lock on ``<database>.lock`` beside the
database. Logging metrics needs no lock (sqlite serialises writers itself).

Why liveness tags: a run whose process is killed (SIGKILL, power loss) never gets to
mark itself finished and would stay ``RUNNING`` forever. Each run carries the tags
``treelit.machine`` (host, boot id and pid namespace: where a pid means the same
process) and ``treelit.pid`` / ``treelit.pid_start`` (the process and its start time,
so a reused pid is not mistaken for the run). Whenever a treelit run opens the store
it marks the ``RUNNING`` runs of dead processes on this machine ``KILLED``; a run
resumed from a checkpoint reopens its own run instead (see
:class:`treelit.lightning.mlflow_logger.TreeMLFlowLogger`).

Artifacts of a local sqlite store go to ``mlruns/`` beside the database file (not
to the working directory), so the database and its artifacts stay together.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from treelit.utils.dir_lock import holder_text, read_holder, write_holder

__all__ = [
    "sqlite_path",
    "resolve_tracking_uri",
    "store_lock",
    "default_artifact_location",
    "process_tags",
    "process_alive",
    "mark_dead_runs_killed",
    "ui_command",
]

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
TAG_MACHINE = "treelit.machine"
TAG_PID = "treelit.pid"
TAG_PID_START = "treelit.pid_start"
TAG_END = "treelit.end"


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a ``sqlite:///`` tracking URI (relative to the working
    directory for ``sqlite:///x.db``, absolute for ``sqlite:////abs/x.db``); ``None``
    for other stores and in-memory databases."""
    prefix = "sqlite:///"
    if not uri or not uri.startswith(prefix):
        return None
    rest = uri[len(prefix):].split("?", 1)[0]
    if not rest or rest == ":memory:":
        return None
    return Path(rest)


def resolve_tracking_uri(uri: str) -> str:
    """``uri`` with a sqlite path made absolute (the same database from any directory);
    its query string, if any, is kept."""
    path = sqlite_path(uri)
    if path is None:
        return uri
    query = uri.split("?", 1)[1] if "?" in uri else None
    return f"sqlite:///{path.resolve()}" + (f"?{query}" if query is not None else "")


def ui_command(uri: str) -> str:
    """The command that opens the MLflow UI on ``uri``'s store."""
    if sqlite_path(uri) is not None:
        return f"mlflow ui --backend-store-uri {resolve_tracking_uri(uri)}"
    return f"open {uri} in a browser" if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri}"


@contextmanager
def store_lock(uri: str, timeout: float = 600.0, report_every: float = 10.0) -> Iterator[None]:
    """Exclusive lock of a local sqlite store (``<database>.lock``); a no-op for other
    stores (a tracking server serialises its own migrations). Waits up to ``timeout`` s,
    saying every ``report_every`` s what it waits for (the lock file and its holder); the
    holder writes its pid, host and start time into the lock file."""
    path = sqlite_path(uri)
    try:
        import fcntl  # POSIX only: elsewhere the store is used unlocked
    except ImportError:  # pragma: no cover - not POSIX: no lock (the race stays possible)
        fcntl = None
    if path is None or fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_file = path.with_name(path.name + ".lock")
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_report = start + report_every
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start > timeout:
                    raise TimeoutError(f"{lock_file}: still locked by {holder_text(read_holder(lock_file))} "
                                       f"after {timeout:.0f} s") from None
                if now >= next_report:
                    log.warning("MLflow: waiting for the store lock %s, held by %s (%.0f s so far, giving up "
                                "after %.0f s)", lock_file, holder_text(read_holder(lock_file)), now - start, timeout)
                    next_report += report_every
                time.sleep(0.05)
        try:
            write_holder(fd)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def default_artifact_location(uri: str) -> Optional[str]:
    """``mlruns/`` beside a sqlite database (absolute); ``None`` (the store's default) otherwise."""
    path = sqlite_path(uri)
    if path is None:
        return None
    return str((path.parent / "mlruns").resolve())


# liveness ------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> List[str]:
    """Fields of ``/proc/<pid>/stat`` after the command name (state is [0], start time [19])."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split() if ")" in stat else []


def machine_id() -> str:
    """Where a pid names the same process: host name, kernel boot id, pid namespace."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}|{_read('/proc/sys/kernel/random/boot_id')}|{pidns}"


def process_tags(pid: Optional[int] = None) -> Dict[str, str]:
    """The liveness tags of process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else int(pid)
    fields = _stat_fields(pid)
    return {TAG_MACHINE: machine_id(), TAG_PID: str(pid), TAG_PID_START: fields[19] if len(fields) > 19 else ""}


def process_alive(pid: int, start: str = "") -> bool:
    """Whether process ``pid`` runs (not a zombie) and, when ``start`` is given, is the same
    process that had that start time."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    fields = _stat_fields(pid)
    if fields:
        if fields[0] in ("Z", "X"):
            return False
        if start and len(fields) > 19 and fields[19] != start:
            return False  # the pid was reused
    return True


def mark_dead_runs_killed(client, experiment_id: str, keep: Optional[str] = None) -> List[str]:
    """Mark ``KILLED`` the ``RUNNING`` runs of ``experiment_id`` started on this machine by
    processes that no longer exist (except run ``keep``). Returns their run ids."""
    here = machine_id()
    done: List[str] = []
    runs = client.search_runs(
        [experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000
    )
    for run in runs:
        tags = run.data.tags
        if run.info.run_id == keep or tags.get(TAG_MACHINE) != here or not tags.get(TAG_PID, "").isdigit():
            continue
        if process_alive(int(tags[TAG_PID]), tags.get(TAG_PID_START, "")):
            continue
        client.set_tag(run.info.run_id, TAG_END, "its process ended without closing the run (killed); "
                       f"marked by process {os.getpid()}")
        client.set_terminated(run.info.run_id, "KILLED")
        done.append(run.info.run_id)
    return done
