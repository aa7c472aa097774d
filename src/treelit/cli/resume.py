"""Where ``treelit-train`` resumes from, read before anything is built.

``resume_from=PATH`` names a checkpoint; ``resume_from=auto`` takes the checkpoint of the
run's folder with the highest step that verifies (the step it holds, not its file time: a
copied folder has new times), naming each one of a higher step that it passes over and why.
Before either, the folder is tidied (:func:`treelit.lightning.checkpoint_files.tidy`): a
commit a kill interrupted is finished, partial files are removed. Checkpoints are read as
tensors and plain data only (:mod:`treelit.lightning.safe_checkpoint`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig

from treelit.cli.console import process_rank

__all__ = ["read_resume_checkpoint", "find_resume_checkpoint", "resume", "point_last_at", "step_of"]

log = logging.getLogger("treelit.train")  # its lines are the run's own


def read_resume_checkpoint(path: str) -> Dict[str, Any]:
    """What ``resume_from`` needs to know before Lightning restores the checkpoint: its step
    and the MLflow run it belongs to. A file that is not a readable Lightning checkpoint is a
    :class:`~treelit.models.hf.CheckpointError` naming it (the tensors are memory-mapped,
    not read). Nothing in it is run: it is read as tensors and plain data only, and a file
    naming anything else is refused (see :mod:`treelit.lightning.safe_checkpoint`)."""
    from treelit.lightning.mlflow_logger import CHECKPOINT_KEY
    from treelit.lightning.safe_checkpoint import check_sharded_metadata, load_checkpoint
    from treelit.models.errors import CheckpointError

    p = Path(path)
    info: Dict[str, Any] = {"path": str(p), "global_step": None, "mlflow": None}
    if p.is_dir():  # a sharded checkpoint: torch's pickled .metadata, and meta.pt when there is one
        check_sharded_metadata(p)
        p = p / "meta.pt"
        if not p.is_file():
            return info
    ckpt = load_checkpoint(p)
    if not isinstance(ckpt, dict) or "global_step" not in ckpt:
        raise CheckpointError(f"resume_from: {p} is not a Lightning checkpoint (it has no global_step)")
    info["global_step"] = int(ckpt["global_step"])
    info["mlflow"] = ckpt.get(CHECKPOINT_KEY)
    return info


def step_of(p: Path) -> Optional[int]:
    """The ``global_step`` a checkpoint says it holds, read without checking it (None: unreadable).
    Only tensors and plain data are read, memory-mapped."""
    import torch  # cli: --help pays for Hydra only

    f = p / "meta.pt" if p.is_dir() else p
    try:
        ckpt = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        return int(ckpt["global_step"])
    except Exception:
        return None


def find_resume_checkpoint(directory: Path) -> Optional[Dict[str, Any]]:
    """``resume_from=auto``: the checkpoint of ``directory`` with the highest step that
    verifies (what :func:`read_resume_checkpoint` returns for it), or None when there is none.
    The step is the one the checkpoint holds (file times are not looked at: a copied folder
    has new ones); each checkpoint of a higher step that does not verify (cut short, altered,
    a zip entry failing its CRC-32, a sharded folder without ``meta.pt``) is passed over with
    a warning naming it and why, and so is one whose step cannot be read. Partial files
    (``*.partial``) are never candidates."""
    from treelit.models.errors import CheckpointError

    if not directory.is_dir():
        return None
    found = [(p, step_of(p)) for p in directory.iterdir() if p.name.endswith(".ckpt")]
    # highest step first (one whose step does not read could be any: tried, and named, first); at one
    # step a step-named file before last.ckpt (the same state)
    for p, step in sorted(found, key=lambda t: (float("inf") if t[1] is None else t[1], t[0].name != "last.ckpt",
                                                t[0].name), reverse=True):
        try:
            info = read_resume_checkpoint(str(p))
            if info["global_step"] is not None:
                return info
            why = "a sharded checkpoint without meta.pt"
        except (CheckpointError, OSError, ValueError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        held = f"step {step}" if step is not None else "its step unreadable"
        log.warning("resume_from=auto: passing over %s (%s), which does not verify: %s", p, held, why)
    return None


def checkpoint_dir(cfg: DictConfig, out: Path) -> Path:
    return Path(str(((cfg.get("callbacks") or {}).get("checkpoint") or {}).get("dirpath") or out / "checkpoints"))


def tidy_checkpoints(cfg: DictConfig, out: Path) -> None:
    """Finish a checkpoint commit a kill interrupted, remove partial files: every process (the
    ones torchrun or SLURM start together then choose from the same files), rank 0 says so."""
    from treelit.lightning.checkpoint_files import tidy

    for line in tidy(checkpoint_dir(cfg, out)):
        if process_rank() == 0:
            log.info("checkpoints: %s", line)


def point_last_at(info: Dict[str, Any]) -> None:
    """``last.ckpt`` beside the checkpoint ``resume_from=auto`` chose becomes that checkpoint
    when it holds an older step or does not verify (a hard link, its manifest beside it), so
    ``resume_from=.../last.ckpt`` never goes back to an older step."""
    from treelit.lightning.checkpoint_files import write_and_commit_manifest
    from treelit.utils.integrity import remove_path

    chosen = Path(info["path"])
    last = chosen.with_name("last.ckpt")
    if chosen.name == "last.ckpt" or chosen.is_dir() or process_rank() != 0 or not last.exists():
        return
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return  # processes started together read the folder now; the run's first checkpoint rewrites it
    step = step_of(last)
    if step is not None and step >= int(info["global_step"]):
        try:
            read_resume_checkpoint(str(last))
            return
        except Exception:
            pass
    partial = last.with_name("last.ckpt.partial")
    remove_path(partial)
    try:
        os.link(chosen, partial)
    except OSError:
        shutil.copyfile(chosen, partial)
    write_and_commit_manifest(str(partial), str(last))
    log.info("resume_from=auto: %s now holds step %d (it held %s)", last, info["global_step"],
             f"step {step}" if step is not None else "no readable step")


def resume(cfg: DictConfig, out: Path) -> Optional[Dict[str, Any]]:
    """The checkpoint ``resume_from`` names; ``auto``: the run folder's checkpoint of the
    highest step that verifies (the checkpoint callback's ``dirpath``, else
    ``<output_dir>/checkpoints``), or a fresh start, said in one line either way."""
    tidy_checkpoints(cfg, out)
    wanted = cfg.get("resume_from")
    if not wanted:
        return None
    if str(wanted) != "auto":
        return read_resume_checkpoint(str(wanted))
    where = checkpoint_dir(cfg, out)
    info = find_resume_checkpoint(where)
    if info is None:
        log.info("resume_from=auto: no complete checkpoint in %s: starting fresh", where)
    else:
        log.info("resume_from=auto: resuming from %s (step %d)", info["path"], info["global_step"])
        point_last_at(info)
    return info
