"""Names that come from files someone else wrote stay inside their directory.

A checkpoint's ``model.safetensors.index.json`` names its shard files, a rollout
checkpoint names the files it renamed, a watched directory lists what a rollout engine
wrote, a data glob lists what is under a folder. Each of those names is joined to its
directory here and refused unless the result lies inside it, so a handed file cannot
make treelit read or rename ``../elsewhere``.

Two strengths. :func:`confined` with ``resolve=False`` is lexical: the name must be
relative and have no ``..`` component; symbolic links inside the directory are the
directory owner's business and are followed (a Hugging Face cache snapshot is a folder
of links into ``blobs/``). With ``resolve=True`` the real path (links resolved) must lie
inside the real directory as well - for directories written by another program.

:func:`glob_files` expands data paths without entering symbolically linked directories
(a self-link or two mutual links would otherwise make ``**`` loop) and lists each real
file once.
"""

from __future__ import annotations

import fnmatch
import glob as _glob
import os
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Type, Union

__all__ = ["bundled_data", "confined", "glob_files", "walk_files", "not_a_checkpoint", "resolve_data_path"]

PathLike = Union[str, "os.PathLike[str]"]


def _inside(root: str, path: str) -> bool:
    return path != root and os.path.commonpath([root, path]) == root


def confined(base: PathLike, name: PathLike, what: str, *, resolve: bool = False,
             error: Type[Exception] = ValueError) -> Path:
    """``base / name``, or ``error`` naming ``what`` (the file the name was read from) when
    ``name`` is empty, absolute, has a ``..`` component or (``resolve``) leads outside
    ``base`` through a symbolic link."""
    text = os.fspath(name) if isinstance(name, (str, os.PathLike)) else None
    shown = repr(text if isinstance(text, str) else name)
    if not isinstance(text, str) or not text or os.path.isabs(text) or ".." in Path(text).parts:
        raise error(f"{what}: {shown} is not a name inside {base} (names must stay inside their directory)")
    root = os.path.abspath(os.fspath(base))
    joined = os.path.normpath(os.path.join(root, text))
    if not _inside(root, joined):
        raise error(f"{what}: {shown} is not a name inside {base} (names must stay inside their directory)")
    if resolve and not _inside(os.path.realpath(root), os.path.realpath(joined)):
        raise error(f"{what}: {shown} leads outside {base} through a symbolic link")
    return Path(os.path.join(os.fspath(base), text))


def _walk(root: str, keep: Callable[[str], bool]) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and keep(os.path.relpath(path, root)):
                yield path


def walk_files(root: PathLike, keep: Callable[[str], bool] = lambda rel: True) -> List[str]:
    """The files under ``root`` (paths ``root/...``, sorted, each real file once) whose path
    relative to ``root`` passes ``keep``. Symbolically linked directories are not entered;
    linked files are listed."""
    return _once(sorted(_walk(os.fspath(root), keep)))


def _match(parts: Sequence[str], pattern: Sequence[str]) -> bool:
    """``parts`` (path components) against ``pattern`` components, ``**`` matching zero or
    more components; as :mod:`glob` does, a wildcard does not match a leading dot."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(parts[i:], rest) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))
    if not parts:
        return False
    if parts[0].startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _match(parts[1:], rest)


def _once(paths: List[str]) -> List[str]:
    seen, out = set(), []
    for p in paths:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)
    return out


def glob_files(pattern: str) -> List[str]:
    """The paths ``pattern`` matches, sorted, each real file once. A pattern with ``**`` is
    matched against a walk that does not enter symbolically linked directories (the
    :mod:`glob` module follows them, and loops on a link to a parent)."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return _once(sorted(_glob.glob(pattern)))
    magic = next(i for i, p in enumerate(parts) if _glob.has_magic(p))
    root, rest = os.sep.join(parts[:magic]), parts[magic:]
    if not root:  # a relative pattern from the working directory, or one under /
        root = os.sep if pattern.startswith(os.sep) else os.curdir
    found = _walk(root, lambda rel: _match(rel.split(os.sep), rest))
    if root == os.curdir:
        found = (os.path.relpath(f, root) for f in found)
    return _once(sorted(found))


def not_a_checkpoint(path: PathLike) -> str:
    """Why the file at ``path`` cannot be a checkpoint written by ``torch.save`` (a zip archive,
    or a pickle for files from before torch 1.6), from its first bytes; "" when it may be one or
    cannot be read (the loader then names the problem)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return ""
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return ""
    shown = head.hex(" ") if head else "nothing (an empty file)"
    return f"a Lightning checkpoint is a zip archive written by torch.save, and this file starts with {shown}"


def bundled_data(name: str) -> Optional[str]:
    """The path of the data file ``name`` shipped inside the package (``treelit/data/bundled``,
    e.g. ``synthetic_agentic.jsonl.gz``, ``tau_bench_airline/gpt-4o-airline.json.gz``), or None."""
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        return None
    path = resources.files("treelit") / "data" / "bundled" / name
    return str(path) if path.is_file() else None


def resolve_data_path(path: str) -> str:
    """``path`` as given when it exists (or is a glob), else the bundled data file of that name
    when there is one (``data.train_path=synthetic_agentic.jsonl.gz``, as ``treelit stats`` takes it)."""
    if os.path.exists(os.path.expanduser(path)) or any(c in path for c in "*?["):
        return path
    return bundled_data(path) or path
