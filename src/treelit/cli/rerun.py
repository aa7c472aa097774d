"""A new run in the folders of an earlier online-RL run: refused before the model loads.

``treelit-train`` with ``publish.dir`` (and ``data=rollouts``) shares two folders with its
sampler (:mod:`treelit.utils.rl_folders`). A run that continues the earlier one
(``resume_from``) takes them over: its publisher goes on from the step it resumes and its
data module from the files the checkpoint lists. A run that starts fresh would mix its
versions and files with the old ones (the trainer waiting 600 s for files the sampler
believes written, ``latest.json`` naming a version keep-pruning deleted), so it stops in one
line that names the folders and the two ways out.
"""

from __future__ import annotations

from typing import Any, Optional

from treelit.cli.errors import ConfigError
from treelit.utils.rl_folders import earlier_run

__all__ = ["check_earlier_run"]


def check_earlier_run(cfg: Any, resume: Optional[dict]) -> None:
    """Raise :class:`ConfigError` when a fresh run (``resume`` None) finds an earlier run's
    policy versions in ``publish.dir`` or its consumed rollouts in ``data.directory``."""
    if resume:
        return
    publish_dir = (cfg.get("publish") or {}).get("dir")
    data = cfg.get("data") or {}
    rollout_dir = data.get("directory") if str(data.get("_target_", "")).endswith("RolloutDirDataModule") else None
    found = earlier_run(publish_dir, rollout_dir)
    if not found:
        return
    new = "rl_dir=NEW" if cfg.get("rl_dir") is not None else "publish.dir=NEW" + (
        " data.directory=NEW" if rollout_dir else "")
    raise ConfigError(f"{'; '.join(found)}: an earlier run's. Continue that run with resume_from=<its checkpoint> "
                      f"(resume_from=auto output_dir=<its output_dir>), or start a new one in new or empty folders "
                      f"({new}, or empty these folders)")
