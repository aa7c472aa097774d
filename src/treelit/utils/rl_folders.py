"""What an earlier online-RL run left in the folders a new run would share with it.

Online RL keeps its state in two folders besides the checkpoints: the published policy
versions (``publish.dir``: ``step-<N>/`` and ``latest.json``) and the rollout files the
trainer has trained on (``data.directory``: ``<name>.consumed``, and ``<name>.stale`` for
files skipped as too stale). A new run started in the same folders meets that state: the
sampler finds the old files and believes its work done, the trainer publishes version 0
below the old versions, waits for files that never come, and keep-pruning deletes the new
version 0 that ``latest.json`` names. So a run that does not continue the earlier one
(``resume_from``) refuses to start when it finds them (:func:`earlier_run`), and
``treelit-rollout`` says what it found (:func:`rollout_files`). Standard library only: the
check runs before anything heavy is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

__all__ = ["LATEST", "DONE_SUFFIXES", "published_versions", "done_rollouts", "earlier_run", "rollout_files",
           "span"]

LATEST = "latest.json"
DONE_SUFFIXES = (".consumed", ".stale")  # trained on / skipped as too stale (treelit.lightning.rollouts)


def published_versions(directory) -> List[int]:
    """The ``step-<N>`` version folders in a publish directory, in order."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in d.glob("step-*") if p.name[5:].isdigit() and p.is_dir())


def done_rollouts(directory) -> List[str]:
    """The rollout files a trainer marked consumed or stale in ``directory``, by name."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.name.endswith(DONE_SUFFIXES) and not p.name.startswith("."))


def span(values: List[int]) -> str:
    """``3`` / ``1-3`` / ``0, 2, 5`` for a sorted list of integers."""
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(str(v) for v in values)


def _latest_version(directory: Path) -> Optional[object]:
    try:
        return json.loads((directory / LATEST).read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return "unreadable"


def earlier_run(publish_dir=None, rollout_dir=None) -> List[str]:
    """What an earlier run left in ``publish_dir`` (policy versions, ``latest.json``) and
    ``rollout_dir`` (consumed or stale rollout files), one phrase per folder; empty: nothing."""
    found = []
    if publish_dir:
        d = Path(publish_dir)
        versions = published_versions(d)
        latest = (d / LATEST).exists()
        if versions or latest:
            what = f"policy versions {span(versions)}" if versions else "no version folder"
            pointer = f", {LATEST} naming version {_latest_version(d)}" if latest else ""
            found.append(f"publish.dir {d} holds {what}{pointer}")
    if rollout_dir:
        done = done_rollouts(rollout_dir)
        if done:
            first = done[0] if len(done) == 1 else f"{done[0]} .. {done[-1]}"
            found.append(f"data.directory {Path(rollout_dir)} holds {len(done)} rollout file(s) a trainer already "
                         f"took ({first})")
    return found


def rollout_files(directory) -> str:
    """What the step files of a rollout directory are, for ``treelit-rollout``'s first line:
    ``steps 0-2 (3 consumed by a trainer, 0 waiting)``; "" when there are none."""
    d = Path(directory)
    steps, done, waiting = set(), 0, 0
    for p in d.glob("step-*.jsonl*") if d.is_dir() else ():
        head = p.name[5:].split(".")[0]
        if not head.isdigit():
            continue
        steps.add(int(head))
        if p.name.endswith(DONE_SUFFIXES):
            done += 1
        elif p.name.endswith(".jsonl"):
            waiting += 1
    if not steps:
        return ""
    return f"steps {span(sorted(steps))} ({done} taken by a trainer, {waiting} waiting)"
