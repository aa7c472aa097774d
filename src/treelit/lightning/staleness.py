"""Rollout staleness: how many policy versions behind the trainer a rollout file was sampled.

A sampler stamps each record with ``policy_version``: the version of the weights it
sampled with (the N of ``publish.dir/step-N``). The trainer's version is the last version
it published (:class:`~treelit.lightning.publish.PublishPolicy`; without publishing, its
optimizer step count). A record's staleness is ``trainer version - policy_version``; a
file's is its oldest record's. With ``data.max_staleness=S`` a file more than S versions
behind is skipped (``data.on_stale=skip``: counted, logged, renamed ``<name>.stale`` once
the step that skipped it has trained, and never read again, also after a resume) or
refused (``raise``: an error naming the file and the versions). A record without a
version counts as version 0, with one warning per run. Each trained file's staleness is
reported as ``rollout/staleness_max`` and ``rollout/staleness_mean`` (over its records),
with the running count ``rollout/files_skipped_stale``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from treelit.data.records import DataError, ReadLimits, Record, iter_file
from treelit.lightning.publish import PublishPolicy
from treelit.lightning.token_staleness import TokenStaleness, check_policy, oldest_version

__all__ = ["StalenessGate", "record_versions", "trainer_policy_version"]

log = logging.getLogger(__name__)

STALE = ".stale"


def trainer_policy_version(trainer: Any) -> int:
    """The last published version (a :class:`PublishPolicy` callback's), else the step count."""
    if trainer is None:
        return 0
    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, PublishPolicy) and cb.version is not None:
            return int(cb.version)
    return int(trainer.global_step)


def record_versions(path: Path, limits: Optional[ReadLimits] = None) -> List[Optional[int]]:
    """Each readable record's ``policy_version`` (None: not given; a record with per-token
    versions: its oldest, :func:`~treelit.lightning.token_staleness.oldest_version`), read within ``limits`` (the
    ``data.max_*`` options). Unreadable records are left to the tree builder, which reports or
    skips them (``data.on_error``)."""
    out: List[Optional[int]] = []
    for item in iter_file(path, limits=limits):
        if not isinstance(item, Record) or not isinstance(item.data, dict):
            continue
        v = item.data.get("policy_version")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise DataError(f"{item.source}: policy_version: must be a non-negative integer (the version the sampler "
                            f"used), got {v!r}")
        oldest = oldest_version(item.data)  # per-token versions (raw branches, chat assistant turns)
        out.append(v if oldest is None else oldest)
    return out


class StalenessGate:
    """Args: ``max_staleness`` (None: every file is trained, staleness still reported),
    ``on_stale`` (``skip`` or ``raise``) and ``policy`` (``data.staleness_policy``: ``skip_file``,
    or ``drop_tokens`` | ``drop_branch``, which never skip a file: see
    :mod:`treelit.lightning.token_staleness`)."""

    def __init__(self, max_staleness: Optional[int] = None, on_stale: str = "skip",
                 policy: str = "skip_file") -> None:
        self.policy = check_policy(policy)
        self.tokens: Optional[TokenStaleness] = None
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"data.max_staleness must be a non-negative number of versions or null, got {max_staleness!r}")
        if on_stale not in ("skip", "raise"):
            raise ValueError(f"data.on_stale must be 'skip' or 'raise', got {on_stale!r}")
        self.max_staleness, self.on_stale = max_staleness, on_stale
        self.skipped: Dict[int, List[str]] = {}  # step index -> files skipped while loading it
        self.renamed: set = set()
        self.warned_unversioned = False
        self.metrics: Dict[str, float] = {"rollout/files_skipped_stale": 0.0}

    def names(self) -> set:
        return {n for names in self.skipped.values() for n in names}

    def admit(self, path: Path, index: int, version: int, limits: Optional[ReadLimits] = None) -> bool:
        """Whether the file ``path`` (read within ``limits``) may train step ``index`` (trainer at
        ``version``); a stale file is recorded as skipped (False) or refused (:class:`DataError`)."""
        versions = record_versions(path, limits)
        if any(v is None for v in versions) and not self.warned_unversioned:
            self.warned_unversioned = True
            log.warning("%s: records without policy_version count as version 0 (stamp each record with the version "
                        "of the weights it was sampled with, see publish.dir/latest.json)", path)
        versions = [0 if v is None else v for v in versions] or [version]
        ahead = max(versions) - version
        if ahead > 0:
            log.warning("%s: records claim policy_version %d, newer than the trainer's %d (a restarted trainer?): "
                        "counted as staleness 0", path, max(versions), version)
        stale = [max(0, version - v) for v in versions]
        if self.policy == "skip_file" and self.max_staleness is not None and max(stale) > self.max_staleness:
            msg = (f"{path}: sampled with policy_version {min(versions)}, {max(stale)} versions behind the trainer's "
                   f"{version} (data.max_staleness={self.max_staleness})")
            if self.on_stale == "raise":
                raise DataError(msg + "; data.on_stale=skip skips such files")
            self.skipped.setdefault(index, []).append(path.name)
            self.metrics["rollout/files_skipped_stale"] += 1
            log.warning("%s: skipped (%d stale files so far)", msg, int(self.metrics["rollout/files_skipped_stale"]))
            return False
        self.metrics.update({"rollout/staleness_max": float(max(stale)),
                             "rollout/staleness_mean": float(sum(stale)) / len(stale)})
        return True

    def reader(self, version: int) -> TokenStaleness:
        """The per-record step of the admitted file read at trainer ``version``: counts each
        token's staleness and drops what ``policy`` drops (see :meth:`counted`)."""
        self.tokens = TokenStaleness(self.max_staleness, self.policy, version)
        return self.tokens

    def counted(self) -> None:
        """The metrics of the file :meth:`reader` read (``staleness/...``)."""
        if self.tokens is not None:
            self.metrics.update(self.tokens.metrics())

    def mark(self, directory: Path, upto: int) -> None:
        """Rename the files skipped while loading steps before ``upto`` to ``<name>.stale`` (rank 0,
        after those steps trained: every rank has read them by then)."""
        for i, names in sorted(self.skipped.items()):
            for name in names:
                if i < upto and name not in self.renamed:
                    if os.path.lexists(directory / name):
                        os.replace(directory / name, directory / (name + STALE))
                    self.renamed.add(name)

    def state(self, consumed: int) -> Dict[str, Any]:
        return {"skipped": {str(i): list(n) for i, n in self.skipped.items() if i < consumed},
                "files_skipped_stale": sum(len(n) for i, n in self.skipped.items() if i < consumed)}

    def load(self, state: Optional[Dict[str, Any]]) -> None:
        state = state or {}
        self.skipped = {int(i): list(n) for i, n in (state.get("skipped") or {}).items()}
        self.renamed = set()
        self.metrics = {"rollout/files_skipped_stale": float(state.get("files_skipped_stale", 0))}
