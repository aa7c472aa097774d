"""One run per output directory: an exclusive lock file, ``<output_dir>/.treelit.lock``.

Without it two runs given the same ``output_dir`` both "succeed": one run's
``config.yaml`` says the other's seed, ``hf_checkpoint/`` holds whichever finished last
and ``train.log`` is interleaved. A run therefore takes an exclusive ``fcntl.flock`` on
the lock file before anything is written into the folder, and writes into it who holds
it (process id, host, start time). The kernel drops the lock when the process ends, however
it ends (``kill -9`` too), so a lock left by a dead process is simply taken over; the
file's text is only used to name the holder in the error of the run that is refused.
The lock is released and the file removed when the run ends.

In a multi-process run (``trainer=ddp_cpu``, ``fsdp2_cpu``, torchrun, srun) only global
rank 0 takes the lock (the rank is read from the launcher's ``RANK`` / ``SLURM_PROCID``);
the other processes, on this machine or others, share its folder (they agree on its name:
:mod:`treelit.utils.launchers`).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional

__all__ = ["LOCK_NAME", "DirLocked", "DirLock", "holder_text", "read_holder", "write_holder"]

LOCK_NAME = ".treelit.lock"


class DirLocked(Exception):
    """The directory is locked by another live process (the message names it)."""


def write_holder(fd: int) -> None:
    """Write this process's pid, host and start time into the open lock file ``fd``."""
    text = f"pid={os.getpid()} host={socket.gethostname()} started={time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)


def read_holder(path: Path) -> Dict[str, str]:
    """The ``key=value`` fields a holder wrote into ``path`` (empty if none or unreadable)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {}
    fields: Dict[str, str] = {}
    key = None
    for word in text.split():
        if "=" in word:
            key, value = word.split("=", 1)
            fields[key] = value
        elif key is not None:  # "started=2026-01-01 12:00:00 UTC": values with spaces
            fields[key] += " " + word
    return fields


def holder_text(info: Dict[str, str]) -> str:
    """``process 123 on host h, started 2026-01-01 12:00:00 UTC`` (what is known of it)."""
    if not info.get("pid"):
        return "another process"
    text = f"process {info['pid']}"
    if info.get("host") and info["host"] != socket.gethostname():
        text += f" on host {info['host']}"
    return text + (f", started {info['started']}" if info.get("started") else "")


class DirLock:
    """The exclusive lock of one directory (re-entrant within a process).

    ``acquire()`` raises :class:`DirLocked` naming the holder if another process holds
    it; a lock file left by a dead process is taken over (``took_over`` then describes
    its former holder)."""

    _held: Dict[str, "DirLock"] = {}

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.fd: Optional[int] = None
        self.depth = 0
        self.took_over: Optional[str] = None

    @classmethod
    def of(cls, directory: Path) -> "DirLock":
        key = os.path.realpath(directory)
        lock = cls._held.get(key)
        return lock if lock is not None else cls(Path(directory))

    def acquire(self) -> "DirLock":
        import fcntl  # POSIX only: the module imports (and fails only when locking) elsewhere

        if self.depth:
            self.depth += 1
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DirLocked(f"{self.directory} is in use by {holder_text(read_holder(self.path))} "
                                    f"(lock file {self.path})") from None
                raise
            try:  # the holder we waited for may have removed the file: lock the one that is there
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = read_holder(self.path)
        if previous.get("pid") and previous["pid"] != str(os.getpid()):
            self.took_over = holder_text(previous)
        write_holder(fd)
        self.fd, self.depth = fd, 1
        DirLock._held[os.path.realpath(self.directory)] = self
        return self

    def release(self, all: bool = False) -> None:
        """Release one hold (``all``: every hold of this process); the last one unlocks."""
        if not self.depth:
            return
        self.depth = 0 if all else self.depth - 1
        if self.depth:
            return
        DirLock._held.pop(os.path.realpath(self.directory), None)
        fd, self.fd = self.fd, None
        try:  # remove the file while still holding the lock: nobody holds a removed file
            os.unlink(self.path)
        except OSError:
            pass
        if fd is not None:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self.depth > 0


@contextmanager
def locked_dir(directory: Path) -> Iterator[DirLock]:
    """Hold ``directory``'s lock for the ``with`` block."""
    lock = DirLock.of(directory).acquire()
    try:
        yield lock
    finally:
        lock.release()
