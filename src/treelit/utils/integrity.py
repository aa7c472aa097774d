"""Files a run writes: complete or absent, checked before they are read back.

**Writes.** A checkpoint, a published policy version or an export is written under a
temporary name beside its final one, each file is fsync'ed, and only then is it renamed
into place (atomic within a filesystem). A write that fails - a full disk (``ENOSPC``), a
quota (``EDQUOT``), the process's file-size limit (``EFBIG``) - leaves the previous file
or folder of that name as it was; the caller removes the temporary one and reports
:class:`WriteFailed`: one line naming the path and the bytes the write needed.
:func:`disk_full` finds such a cause in whatever a library raised (torch wraps the
``OSError`` in a ``RuntimeError``, safetensors in its own error, torch's distributed
checkpoint in a ``CheckpointException`` gathered from every rank).

**Manifests.** Each file written is listed with its size and SHA-256 in a small JSON
manifest, written last (temporary file, fsync, rename): inside a folder it is
``treelit-manifest.json``, beside a single file ``<file>.manifest.json``.
:func:`verify` re-reads the files and compares: a truncated, extended, altered or missing
file is named in one line. SHA-256 is the standard one (``sha256sum`` checks a file by
hand) and, with the SHA instructions of current x86 and ARM processors, runs at about
1.5 GB/s per core - as fast as zlib's CRC-32 measured on the same machine - so a
stronger-than-needed check costs nothing extra. It detects damage (a failed copy, a bad
disk, a file edited by mistake), not tampering: whoever can rewrite a file can rewrite its
manifest too (:mod:`treelit.lightning.safe_checkpoint` is what stops a crafted checkpoint
from running code).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Type, Union

from treelit.utils.paths import confined

__all__ = ["MANIFEST", "MANIFEST_SUFFIX", "ALGORITHM", "WriteFailed", "disk_full", "fmt_bytes", "fsync_path",
           "file_digest", "write_manifest", "manifest_of", "remove_path", "verify", "write_text_atomic"]

MANIFEST = "treelit-manifest.json"  # inside a folder (sharded checkpoint, published version)
MANIFEST_SUFFIX = ".manifest.json"  # beside a single file: last.ckpt.manifest.json
ALGORITHM = "sha256"
FORMAT = "treelit-manifest"
CHUNK = 1 << 22

FULL = {errno.ENOSPC: "no space left on device", errno.EFBIG: "file too large (the file-size limit, ulimit -f)",
        errno.EDQUOT: "disk quota exceeded"}
# what libraries that do not keep the OSError say (Rust's io::Error, the C library's strerror)
_TEXT = {"(os error 28)": errno.ENOSPC, "No space left on device": errno.ENOSPC,
         "(os error 27)": errno.EFBIG, "File too large": errno.EFBIG,
         "(os error 122)": errno.EDQUOT, "Disk quota exceeded": errno.EDQUOT}

PathLike = Union[str, "os.PathLike[str]"]


class WriteFailed(OSError):
    """A write that could not complete for want of space: ``str(exc)`` is the one-line report
    (what, the path, why, the bytes it needed, what is left). An ``OSError`` with that line as
    its ``strerror``, so the command line prints it as it is."""

    def __init__(self, message: str, code: int = errno.ENOSPC, path: Optional[PathLike] = None,
                 needed: Optional[int] = None) -> None:
        super().__init__(code, message)
        self.path = None if path is None else str(path)
        self.needed = needed

    def __str__(self) -> str:
        return str(self.strerror)


def _chain(exc: Optional[BaseException]) -> Iterable[BaseException]:
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for wrapped in (getattr(e, "failures", None) or {}).values():  # torch's CheckpointException: {rank: (exc, tb)}
            todo.append(wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped))


def disk_full(exc: Optional[BaseException]) -> Optional[int]:
    """``ENOSPC``, ``EFBIG`` or ``EDQUOT`` when ``exc`` (or what it wraps) is a write that
    failed for want of space, else ``None``."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in FULL:
            return e.errno
    for e in _chain(exc):
        text = str(e)
        for needle, code in _TEXT.items():
            if needle in text:
                return code
    return None


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "an unknown number of bytes"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            size = f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
            return size if unit == "B" else f"{size} ({int(n):,} bytes)"
        x /= 1024
    return f"{int(n):,} bytes"  # pragma: no cover


def fsync_path(path: PathLike) -> None:
    """fsync a file or a folder (its entries: renames into it)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: PathLike) -> None:
    """Remove a file or a folder if it is there (nothing raised)."""
    p = Path(path)
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    except OSError:
        pass


def file_digest(path: PathLike, sync: bool = False) -> Dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of a file (``sync``: fsync it too)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            h.update(block)
            n += len(block)
        if sync:
            os.fsync(f.fileno())
    return {"bytes": n, ALGORITHM: h.hexdigest()}


def write_text_atomic(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name, fsync and rename; nothing is left
    behind when it fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_path(tmp)
        raise
    fsync_path(path.parent)


def _files_under(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(files):
            yield Path(dirpath) / name


def manifest_of(target: PathLike) -> Path:
    """Where the manifest of a folder or a file goes."""
    t = Path(target)
    return t / MANIFEST if t.is_dir() else t.with_name(t.name + MANIFEST_SUFFIX)


def write_manifest(target: PathLike, name: Optional[str] = None, where: Optional[PathLike] = None) -> Path:
    """fsync every file of ``target`` (a folder, walked; or one file) and write its manifest,
    last: ``<folder>/treelit-manifest.json``, or for a file ``where`` (default
    ``<name>.manifest.json`` beside it). ``name``: the file name recorded for a single file
    (default: its own; a file written as ``x.partial`` and renamed to ``x`` afterwards records
    ``x``). Returns the manifest's path."""
    t = Path(target)
    files: Dict[str, Dict[str, Any]] = {}
    if t.is_dir():
        for f in _files_under(t):
            rel = f.relative_to(t).as_posix()
            if rel != MANIFEST:
                files[rel] = file_digest(f, sync=True)
        for dirpath, _, _ in os.walk(t):
            fsync_path(dirpath)
        where = t / MANIFEST
    else:
        files[name or t.name] = file_digest(t, sync=True)
        where = Path(where) if where is not None else t.with_name((name or t.name) + MANIFEST_SUFFIX)
    write_text_atomic(where, json.dumps({"format": FORMAT, "version": 1, "algorithm": ALGORITHM, "files": files},
                                        indent=1, sort_keys=True) + "\n")
    return where


def verify(target: PathLike, what: str, error: Type[Exception] = ValueError) -> Optional[Path]:
    """Check a folder or a file against its manifest; ``error`` naming the first file that is
    missing, truncated, longer than written or altered. Returns the manifest's path, or ``None``
    when there is none (written before treelit recorded manifests: nothing to check against)."""
    t = Path(target)
    where = manifest_of(t)
    if not where.is_file():
        return None
    try:
        manifest = json.loads(where.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError("not a treelit manifest")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise error(f"{what}: {where} is not a readable manifest ({type(exc).__name__}: {exc}); the files it "
                    "should describe cannot be checked") from None
    base = t if t.is_dir() else t.parent
    for rel, expected in sorted(files.items()):
        if not t.is_dir() and rel != t.name:
            raise error(f"{what}: {where} describes {rel!r}, not {t.name!r}: it belongs to another file")
        f = confined(base, rel, f"{what}: {where}", error=error)
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise error(f"{what}: {f} is missing (its manifest {where.name} lists it)") from None
        want = int(expected["bytes"])
        if size != want:
            how = "truncated" if size < want else "longer than written"
            raise error(f"{what}: {f} is {how}: {size:,} bytes, its manifest says {want:,} (a failed or "
                        "partial copy?)")
        got = file_digest(f)[ALGORITHM]
        if got != expected.get(ALGORITHM):
            raise error(f"{what}: {f} was altered after it was written: its {ALGORITHM} differs from the one in "
                        f"{where.name} (same size, different bytes)")
    return where
