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

Why a store is built under another name: MLflow creates a fresh store in place, a dozen
alembic migrations one after the other, none of them undone when the process dies. A kill
(or Ctrl-C) in the middle left a file that every later open refused ("duplicate column
name", "table ... already exists"), MLflow's own client included. :func:`ensure_store`
(called under the lock) builds a missing store as ``.<name>.creating-<pid>`` beside it and
renames it into place once MLflow has finished with it: an interrupted creation leaves no
store (the next run removes the leftover and builds again), never half a store. A store
that an earlier version left half-made - its schema revision missing or older than MLflow's
head, nothing in it but MLflow's default experiment and workspace - is renamed aside
(``<name>.half-made-<time>``) and rebuilt the same way, with a warning that says so. Nothing
is ever deleted: a store that holds anything (runs, experiments, registered models, traces)
or whose revision this MLflow does not know (a newer MLflow's) is left as it is.

Artifacts of a local sqlite store go to ``mlruns/`` beside the database file (not
to the working directory), so the database and its artifacts stay together.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from treelit.utils.dir_lock import holder_text, read_holder, write_holder
from treelit.utils.integrity import fsync_path

__all__ = [
    "sqlite_path",
    "resolve_tracking_uri",
    "store_lock",
    "ensure_store",
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


_DEFAULT_ROWS = {"experiments": "experiment_id = 0", "workspaces": "name = 'default'"}  # MLflow's own rows


def _store_state(path: Path) -> Tuple[Optional[str], bool]:
    """``(None, False)`` when ``path`` is a complete MLflow store (its schema at MLflow's head
    revision); else what is wrong with it, and whether it is a half-made one that may be
    rebuilt: its schema revision missing or an ancestor of the head (not one from a newer
    MLflow) and every table but ``alembic_version`` empty, MLflow's default experiment and
    workspace aside."""
    from alembic.script import ScriptDirectory  # MLflow's migrations: only with a local store
    from mlflow.store.db.utils import _get_alembic_config, _get_latest_schema_revision  # heavy: as above

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            version = (con.execute("SELECT version_num FROM alembic_version").fetchone() or [None])[0] \
                if "alembic_version" in tables else None
            held = []
            for t in sorted(tables):
                if t == "alembic_version" or t.startswith("sqlite_"):
                    continue
                q = f'SELECT count(*) FROM "{t}"' + (f" WHERE NOT ({_DEFAULT_ROWS[t]})" if t in _DEFAULT_ROWS else "")
                n = con.execute(q).fetchone()[0]
                if n:
                    held.append(f"{n} {t}")
        finally:
            con.close()
    except sqlite3.Error as exc:
        return f"not readable as a store ({exc})", False
    head = _get_latest_schema_revision()
    if version == head:
        return None, False
    older = version is None
    if not older:
        try:
            older = ScriptDirectory.from_config(_get_alembic_config(db_url="")).get_revision(version) is not None
        except Exception:  # noqa: BLE001 - alembic raises its own errors for an unknown revision
            older = False
    why = f"schema version {version or 'none'}, MLflow's is {head}"
    if not older:
        why += " (not one this MLflow knows: a newer MLflow's?)"
    why += f"; it holds {', '.join(held)}" if held else "; it holds nothing"
    return why, older and not held


def _sqlite_files(path: Path) -> List[Path]:
    return [path, path.with_name(path.name + "-journal"), path.with_name(path.name + "-wal"),
            path.with_name(path.name + "-shm")]


def _remove_sqlite(path: Path) -> None:
    for f in _sqlite_files(path):
        try:
            f.unlink()
        except FileNotFoundError:
            pass


def _move_aside(path: Path) -> Path:
    """Rename a store (and its journal files) to ``<name>.half-made-<time>`` beside it; the new name."""
    aside = path.with_name(f"{path.name}.half-made-{time.strftime('%Y%m%dT%H%M%S')}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.half-made-{time.strftime('%Y%m%dT%H%M%S')}-{n}")
    for f, g in zip(_sqlite_files(path), _sqlite_files(aside)):
        if f.exists():
            os.replace(f, g)
    fsync_path(path.parent)
    return aside


def ensure_store(uri: str) -> None:
    """A local sqlite store at ``uri`` that is complete before MLflow opens it (call under
    :func:`store_lock`; a no-op for other stores). A missing (or empty) one is built under a
    temporary name and renamed into place; leftovers of an interrupted build are removed; a
    half-made one (an older schema revision, nothing in it but MLflow's defaults) is renamed
    aside and rebuilt, with a warning. Anything else is left for MLflow to report."""
    path = sqlite_path(uri)
    if path is None:
        return
    path = path.resolve()
    for left in path.parent.glob(f".{path.name}.creating-*"):  # a build that was interrupted: under our lock, dead
        _remove_sqlite(left)
    if path.is_file() and path.stat().st_size > 0:
        why, rebuild = _store_state(path)
        if why is None or not rebuild:
            return  # complete, or it holds something (or is newer, or unreadable): MLflow reports what it finds
        aside = _move_aside(path)
        log.warning("MLflow: %s was left half-made by an interrupted creation (%s): moved to %s and rebuilt",
                    path, why, aside)
    _build(path, uri)


def _unsynced(connection, record) -> None:
    connection.execute("PRAGMA synchronous=OFF")
    connection.execute("PRAGMA journal_mode=MEMORY")


def _build(path: Path, uri: str) -> None:
    import sqlalchemy  # heavy: only when a store is built
    from mlflow.store.db.utils import create_sqlalchemy_engine_with_retry  # heavy: as above
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # heavy: as above

    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}")
    _remove_sqlite(tmp)
    tmp_uri = f"sqlite:///{tmp}"
    try:
        # a file no one else opens, synced once when complete: no per-statement journal or sync
        # (4x faster: MLflow's migrations are a few hundred statements)
        engine = create_sqlalchemy_engine_with_retry(tmp_uri)
        sqlalchemy.event.listen(engine, "connect", _unsynced)
        SqlAlchemyStore._engine_map[tmp_uri] = engine
        try:
            SqlAlchemyStore(tmp_uri, default_artifact_location(uri))
        finally:
            SqlAlchemyStore._engine_map.pop(tmp_uri, None)
            engine.dispose()
        fsync_path(tmp)
        _remove_sqlite(path)  # an old store's rollback journal must not meet the new file
        os.replace(tmp, path)
    except BaseException:
        _remove_sqlite(tmp)
        raise
    fsync_path(path.parent)


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
