"""A checkpoint and its manifest land together; a kill never leaves a checkpoint without one.

A single-file checkpoint is written as ``X.partial`` and its manifest as
``X.manifest.json.partial`` (:class:`~treelit.lightning.callbacks.TreeCheckpoint`); the commit
(:func:`commit`) then renames the **manifest first**, syncs the folder, and renames the
checkpoint second (so the manifest's rename reaches the disk first). A kill between
the two leaves the manifest under its final name and the complete ``X.partial`` beside it:
for a new name nothing final lacks its manifest, and an overwritten ``last.ckpt`` is, for a
moment, the previous file beside the new manifest. The next start finishes that commit
(:func:`tidy`): an ``X.partial`` that matches ``X.manifest.json`` byte for byte is renamed to
``X``; every other ``.partial`` left in the folder (a write that was cut, a manifest whose
checkpoint never came) is removed, and so are the temporary ``.X.tmp-<pid>`` files of a manifest
write that was cut; a manifest whose file is gone goes with it. (Earlier
versions renamed the file first: a checkpoint in place whose ``.manifest.json.partial``
matches it gets that manifest renamed into place.) A sharded
checkpoint is a folder with its manifest inside and is renamed in one step.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import List, Union

from treelit.utils.integrity import ALGORITHM, MANIFEST_SUFFIX, file_digest, fsync_path, remove_path, write_manifest

__all__ = ["commit", "write_and_commit_manifest", "tidy", "PARTIAL"]

log = logging.getLogger(__name__)

PARTIAL = ".partial"


def write_and_commit_manifest(partial: str, filepath: str) -> None:
    """The manifest of a checkpoint written as ``partial``, then :func:`commit` (rank 0)."""
    if os.path.isdir(partial):
        write_manifest(partial)  # inside the folder: renamed with it
    else:
        write_manifest(partial, name=os.path.basename(filepath), where=f"{filepath}{MANIFEST_SUFFIX}{PARTIAL}")
    commit(partial, filepath)


def commit(partial: str, filepath: str) -> None:
    """Renames only: the new checkpoint (and its manifest) replace the previous one of that
    name; a single file's manifest is renamed into place before the file itself."""
    manifest = f"{filepath}{MANIFEST_SUFFIX}"
    if os.path.isdir(partial):  # a sharded checkpoint directory: its manifest is inside
        old = f"{os.path.dirname(filepath)}/.{os.path.basename(filepath)}.old-{os.getpid()}"
        if os.path.isdir(filepath):
            os.replace(filepath, old)
        elif os.path.exists(filepath):
            os.unlink(filepath)
        os.replace(partial, filepath)
        remove_path(old)
        remove_path(manifest)  # a single-file checkpoint's, if one had this name before
    else:
        if os.path.isdir(filepath):
            remove_path(filepath)
        if os.path.exists(f"{manifest}{PARTIAL}"):
            os.replace(f"{manifest}{PARTIAL}", manifest)
            fsync_path(os.path.dirname(os.path.abspath(filepath)))  # the manifest's rename is on disk before the file's
        else:
            remove_path(manifest)  # never beside a file it does not describe
        os.replace(partial, filepath)
    fsync_path(os.path.dirname(os.path.abspath(filepath)))


def _matches(manifest: Path, f: Path, name: str) -> bool:
    """Whether file ``f`` is what ``manifest`` records for ``name`` (size and SHA-256)."""
    try:
        expected = json.loads(manifest.read_text())["files"][name]
        got = file_digest(f)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return int(expected.get("bytes", -1)) == got["bytes"] and expected.get(ALGORITHM) == got[ALGORITHM]


def _into_place(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final``; another process of this run may have done it first."""
    try:
        os.replace(partial, final)
    except FileNotFoundError:
        pass


def _finish(partial: Path, final: Path) -> bool:
    """Whether ``partial`` is the file ``final``'s manifest describes (then it is renamed; by
    another process of the run, if that one was first)."""
    manifest = final.with_name(final.name + MANIFEST_SUFFIX)
    if partial.is_dir() or not manifest.is_file() or not _matches(manifest, partial, final.name):
        return False
    _into_place(partial, final)
    return True


def _finish_manifest(partial: Path, final: Path) -> bool:
    """Whether ``partial`` is the manifest of a checkpoint in place that has none (an earlier
    version renamed the file first): then it is renamed into place."""
    target = final.with_name(final.name[: -len(MANIFEST_SUFFIX)])
    if final.exists() or not target.is_file() or not _matches(partial, target, target.name):
        return False
    _into_place(partial, final)
    return True


def tidy(directory: Union[str, Path]) -> List[str]:
    """Finish a commit a kill interrupted and remove what other kills left in ``directory``
    (before anything reads the folder; every process of a run may call it at once, as the
    processes torchrun or SLURM start do: each then sees the same folder when it chooses the
    checkpoint to resume from). Returns one line per thing done."""
    d = Path(directory)
    if not d.is_dir():
        return []
    done: List[str] = []
    names = sorted(p.name for p in d.iterdir())
    for name in names:
        p = d / name
        if not name.endswith(PARTIAL) or not p.exists():
            continue
        final = d / name[: -len(PARTIAL)]
        if not final.name.endswith(MANIFEST_SUFFIX) and _finish(p, final):
            done.append(f"finished the commit of {final} (its manifest was in place, the file was not renamed yet)")
            continue
        if final.name.endswith(MANIFEST_SUFFIX) and _finish_manifest(p, final):
            done.append(f"finished the commit of {final} (its checkpoint was in place, the manifest not yet: an "
                        "earlier treelit renamed the file first)")
            continue
        remove_path(p)
        done.append(f"removed {p}, left by an interrupted write")
    for p in sorted(d.glob("*" + MANIFEST_SUFFIX)):
        target = p.with_name(p.name[: -len(MANIFEST_SUFFIX)])
        if not target.exists():
            remove_path(p)
            done.append(f"removed {p}: its checkpoint was never committed")
    for p in sorted(d.glob(".*.old-*")):
        remove_path(p)
        done.append(f"removed {p}, left by an interrupted commit")
    for p in sorted(d.glob(".*.tmp-*")):  # integrity.write_text_atomic's temporary files (manifests)
        remove_path(p)
        done.append(f"removed {p}, left by an interrupted write")
    if done:
        fsync_path(d)
    return done
