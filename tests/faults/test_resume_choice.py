"""``resume_from=auto`` goes by the step a checkpoint holds and by whether it verifies, never
by file times; a checkpoint and its manifest land together, and the next start finishes or
removes what a kill between their renames left; a checkpoint without a manifest is checked
against its zip entries' CRC-32s; a resumed run reuses the file names (no ``-v1``) and
``last.ckpt`` holds the newest step.

The checkpoints come from one real 4-step run (a checkpoint after every step); the folders
are copies of it (``cp -r`` gives new file times), damaged the way kills and copies damage
them."""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from fault_runs import TINY, assert_same_weights, checkpointed_run, weights, write_trees
from treelit.cli.config import compose
from treelit.cli.resume import find_resume_checkpoint, point_last_at, read_resume_checkpoint, step_of
from treelit.cli.train import run
from treelit.lightning.checkpoint_files import commit, tidy
from treelit.models.errors import CheckpointError
from treelit.utils.integrity import MANIFEST_SUFFIX, verify, write_manifest

M = MANIFEST_SUFFIX


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_trees(tmp_path_factory.mktemp("choice") / "trees.jsonl")


@pytest.fixture(scope="module")
def source(data, tmp_path_factory):
    """A 4-step run, a checkpoint (and its manifest) after every step."""
    return checkpointed_run(tmp_path_factory.mktemp("choice_run") / "run", data)


@pytest.fixture
def copied(source, tmp_path):
    """``cp -r`` of the run's checkpoints with shuffled file times (last.ckpt the oldest file,
    step 1 the newest)."""
    d = tmp_path / "checkpoints"
    shutil.copytree(source / "checkpoints", d)
    names = sorted(p.name for p in d.iterdir())
    random.Random(0).shuffle(names)
    now = time.time()
    order = ["last.ckpt", "step-000004.ckpt", "step-000003.ckpt", "step-000002.ckpt", "step-000001.ckpt"]
    for i, name in enumerate(order + [n for n in names if n not in order]):
        os.utime(d / name, (now + i, now + i))
    return d


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _passed(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "treelit.train" and "passing over" in r.getMessage()]


def test_a_copied_folder_with_shuffled_times_resumes_from_the_highest_step(copied, caplog):
    """step 1's file is the newest, step 4's among the oldest: step 4 is taken, nothing passed over."""
    with caplog.at_level(logging.WARNING, logger="treelit.train"):
        info = find_resume_checkpoint(copied)
    assert info["global_step"] == 4 and Path(info["path"]).name == "step-000004.ckpt", info
    assert not _passed(caplog)


def test_a_corrupt_last_and_newest_are_passed_over_by_name_and_why(copied, caplog):
    """last.ckpt and step-000004.ckpt (both step 4) altered: step 3 is taken; each one passed
    over is named with its step and why."""
    _flip(copied / "last.ckpt")
    _flip(copied / "step-000004.ckpt")
    os.utime(copied / "last.ckpt")  # the newest file
    with caplog.at_level(logging.WARNING, logger="treelit.train"):
        info = find_resume_checkpoint(copied)
    assert info["global_step"] == 3 and Path(info["path"]).name == "step-000003.ckpt", info
    passed = _passed(caplog)
    assert len(passed) == 2, passed
    assert "step-000004.ckpt (step 4), which does not verify" in passed[0] and "was altered" in passed[0], passed
    assert "last.ckpt (step 4), which does not verify" in passed[1] and "was altered" in passed[1], passed


def test_a_damaged_checkpoint_without_its_manifest_fails_its_crc(copied, caplog):
    """step 4's manifest removed and one byte of it flipped: its zip entries' CRC-32s catch it
    (before, it was loaded unchecked: training went on from corrupted weights)."""
    for name in ("step-000004.ckpt", "last.ckpt"):
        (copied / (name + M)).unlink()
        _flip(copied / name)
    with caplog.at_level(logging.WARNING, logger="treelit.train"):
        info = find_resume_checkpoint(copied)
    assert info["global_step"] == 3, info
    passed = _passed(caplog)
    assert len(passed) == 2 and all("fails its CRC-32" in m for m in passed), passed
    with pytest.raises(CheckpointError, match=r"is damaged: its entry \S+ fails its CRC-32"):
        read_resume_checkpoint(str(copied / "step-000004.ckpt"))


def test_an_intact_checkpoint_without_its_manifest_loads_and_the_warning_says_why(copied, caplog):
    """Checked against its CRC-32s; the warning names the real reason: a manifest left as
    ``.partial`` (an earlier version was stopped between its two renames), or none beside it."""
    ck = copied / "step-000004.ckpt"
    (copied / ("step-000004.ckpt" + M)).rename(copied / ("step-000004.ckpt" + M + ".partial"))
    (copied / ("step-000003.ckpt" + M)).unlink()
    with caplog.at_level(logging.WARNING):
        assert read_resume_checkpoint(str(ck))["global_step"] == 4
        assert read_resume_checkpoint(str(copied / "step-000003.ckpt"))["global_step"] == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert f"{ck} has no manifest (its manifest step-000004.ckpt{M}.partial was never renamed into place" in warned[0]
    assert "none beside it: copied or moved without it" in warned[1]
    assert all("checked against the CRC-32s of its zip entries" in w for w in warned), warned
    assert not any("written before treelit recorded one" in w for w in warned)


def test_a_half_written_partial_is_removed_and_never_chosen(copied, caplog):
    """A kill mid-write: step 5's ``.partial`` cut short, its manifest never written; a
    ``.manifest.json.partial`` without its checkpoint; a manifest's temporary ``.X.tmp-<pid>``
    (integrity.write_text_atomic): all removed at the next start."""
    src = copied / "step-000004.ckpt"
    (copied / "step-000005.ckpt.partial").write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    (copied / f"step-000006.ckpt{M}.partial").write_text("{}")
    (copied / f".step-000006.ckpt{M}.partial.tmp-4242").write_text("{")  # a manifest write cut short
    os.utime(copied / "step-000005.ckpt.partial")
    done = tidy(copied)
    assert len(done) == 3 and all(line.startswith("removed ") for line in done), done
    assert not list(copied.glob("*.partial")) and not list(copied.glob(".*.tmp-*"))
    assert find_resume_checkpoint(copied)["global_step"] == 4


def test_a_kill_between_the_manifest_and_the_checkpoint_rename_is_finished_at_the_next_start(copied):
    """The commit renames the manifest first: a kill before the checkpoint's rename leaves a
    complete ``.partial`` and its manifest; the next start renames it into place. A checkpoint
    whose manifest alone was left as ``.partial`` (the earlier order) gets it renamed too."""
    ck = copied / "step-000004.ckpt"
    ck.rename(copied / "step-000004.ckpt.partial")  # manifest in place, the file not yet
    (copied / ("step-000003.ckpt" + M)).rename(copied / ("step-000003.ckpt" + M + ".partial"))
    done = tidy(copied)
    assert len(done) == 2 and all(line.startswith("finished the commit of ") for line in done), done
    assert verify(ck, "t") is not None and verify(copied / "step-000003.ckpt", "t") is not None
    assert find_resume_checkpoint(copied)["global_step"] == 4


def test_the_commit_renames_the_manifest_before_the_checkpoint(copied, monkeypatch):
    """Stop the commit after its first rename: no final-named checkpoint without its manifest."""
    new = copied / "step-000005.ckpt"
    shutil.copy(copied / "step-000004.ckpt", copied / "step-000005.ckpt.partial")
    write_manifest(copied / "step-000005.ckpt.partial", name=new.name, where=f"{new}{M}.partial")
    renames = []
    real = os.replace

    def one_rename(a, b):
        if renames:
            raise KeyboardInterrupt("killed between the renames")
        renames.append(b)
        real(a, b)

    monkeypatch.setattr(os, "replace", one_rename)
    with pytest.raises(KeyboardInterrupt):
        commit(str(copied / "step-000005.ckpt.partial"), str(new))
    monkeypatch.undo()
    assert renames == [f"{new}{M}"] and not new.exists()
    tidy(copied)
    assert verify(new, "t") is not None


def test_the_commit_syncs_the_folder_between_the_two_renames(tmp_path, monkeypatch):
    """The manifest's rename reaches the disk before the checkpoint's rename is made."""
    from treelit.lightning import checkpoint_files

    new = tmp_path / "step-000005.ckpt"
    (tmp_path / "step-000005.ckpt.partial").write_bytes(b"a checkpoint")
    write_manifest(tmp_path / "step-000005.ckpt.partial", name=new.name, where=f"{new}{M}.partial")
    events = []
    real_replace, real_sync = os.replace, checkpoint_files.fsync_path
    monkeypatch.setattr(os, "replace",
                        lambda a, b: (events.append(("rename", os.path.basename(b))), real_replace(a, b)))
    monkeypatch.setattr(checkpoint_files, "fsync_path", lambda p: (events.append(("sync", str(p))), real_sync(p)))
    commit(str(tmp_path / "step-000005.ckpt.partial"), str(new))
    monkeypatch.undo()
    assert events == [("rename", new.name + M), ("sync", str(tmp_path)), ("rename", new.name),
                      ("sync", str(tmp_path))], events


def test_last_ckpt_is_pointed_at_the_step_resumed_from(copied):
    """A copied folder whose last.ckpt holds step 1: resuming from step 4 makes it step 4."""
    shutil.copy(copied / "step-000001.ckpt", copied / "last.ckpt")
    write_manifest(copied / "last.ckpt")
    info = find_resume_checkpoint(copied)
    assert info["global_step"] == 4 and Path(info["path"]).name == "step-000004.ckpt"
    point_last_at(info)
    assert step_of(copied / "last.ckpt") == 4 and verify(copied / "last.ckpt", "t") is not None


def test_a_run_resumed_in_a_copied_folder_reuses_the_names(source, data, tmp_path):
    """A copy of the run folder, steps 3 and 4 gone and last.ckpt at step 1: the resumed run
    (from step 2) writes step-000003/4.ckpt and last.ckpt again, no ``-v1`` file, last.ckpt at
    step 4; the weights equal the uninterrupted run's."""
    out = tmp_path / "copy"
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("hf_checkpoint", "summary.json", "*.lock"))
    d = out / "checkpoints"
    for name in ("step-000003.ckpt", "step-000004.ckpt"):
        (d / name).unlink()
        (d / (name + M)).unlink()
    shutil.copy(d / "step-000001.ckpt", d / "last.ckpt")
    write_manifest(d / "last.ckpt")
    os.utime(d / "last.ckpt")
    run(compose([*TINY, f"data.train_path={data}", f"output_dir={out}", "trainer.max_steps=4",
                 "callbacks.checkpoint.every_n_train_steps=1", "resume_from=auto"]))
    names = sorted(p.name for p in d.iterdir() if not p.name.endswith(M))
    assert names == ["last.ckpt", "step-000001.ckpt", "step-000002.ckpt", "step-000003.ckpt", "step-000004.ckpt"], names
    assert step_of(d / "last.ckpt") == 4
    assert_same_weights(weights(out), weights(source))
