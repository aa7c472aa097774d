"""Names read from files someone else wrote stay inside their directory: a rollout
checkpoint naming ``../victim/important.txt``, an index file naming ``../x.safetensors``,
a symbolic link in the rollout directory; data globs do not loop on linked directories
and list each real file once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit.data.records import DataError
from treelit.lightning.rollouts import RolloutDirDataModule
from treelit.models.errors import CheckpointError
from treelit.utils.paths import confined, glob_files, walk_files


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "", ".", "a/..", 3, None])
def test_confined_refuses_names_that_leave_their_directory(tmp_path, name):
    with pytest.raises(ValueError, match="index.json: .* is not a name inside"):
        confined(tmp_path, name, "index.json")


def test_confined_keeps_names_inside_and_resolves_links_when_asked(tmp_path):
    assert confined(tmp_path, "a.safetensors", "x") == tmp_path / "a.safetensors"
    assert confined(tmp_path, "sub/a.safetensors", "x") == tmp_path / "sub" / "a.safetensors"
    outside = tmp_path / "outside"
    outside.mkdir()
    base = tmp_path / "base"
    base.mkdir()
    (base / "link").symlink_to(outside)
    assert confined(base, "link/f", "x") == base / "link" / "f"  # lexical: the directory owner's links
    with pytest.raises(DataError, match="'link/f' leads outside .* through a symbolic link"):
        confined(base, "link/f", "x", resolve=True, error=DataError)


# the rollout directory -------------------------------------------------------------------------


def test_a_rollout_checkpoint_naming_files_outside_the_directory_is_refused(tmp_path):
    """The issue's case: ``files: ["../victimdir/important.txt"]`` in the data module's state
    renamed that file to ``important.txt.consumed``."""
    victim = tmp_path / "victimdir" / "important.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    dm = RolloutDirDataModule(str(tmp_path / "rollouts"))
    dm.setup()
    for name in ["../victimdir/important.txt", str(victim), "sub/step-000.jsonl"]:
        with pytest.raises(DataError, match="resume_from: the checkpoint's rollout file name"):
            dm.load_state_dict({"consumed_steps": 1, "files": [name]})
        dm.teardown()  # renames the consumed files it knows of
    assert victim.read_text() == "keep me" and sorted(p.name for p in victim.parent.iterdir()) == ["important.txt"]
    # a plain name is taken and marked consumed as before
    (tmp_path / "rollouts" / "step-000.jsonl").write_text("{}\n")
    dm.load_state_dict({"consumed_steps": 1, "files": ["step-000.jsonl"]})
    dm.teardown()
    assert (tmp_path / "rollouts" / "step-000.jsonl.consumed").is_file()


@pytest.mark.parametrize("state", [{"files": "step-000.jsonl"}, {"files": [], "stale": {"skipped": ["../x"]}},
                                   {"files": [], "stale": {"skipped": {"0": "../x"}}}, {"files": [], "stale": [1]}])
def test_a_malformed_rollout_checkpoint_state_is_one_data_error(tmp_path, state):
    dm = RolloutDirDataModule(str(tmp_path / "rollouts"))
    dm.setup()
    with pytest.raises(DataError, match="rollout-directory state is malformed"):
        dm.load_state_dict({"consumed_steps": 1, **state})


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_the_rollout_directory_takes_regular_files_only(tmp_path, target):
    d = tmp_path / "rollouts"
    d.mkdir()
    real = (tmp_path if target == "outside" else d) / "secret.txt"
    real.write_text('{"id": "a", "branches": [{"input_ids": [1, 2]}]}\n')
    (d / "step-000.jsonl").symlink_to(real)
    dm = RolloutDirDataModule(str(d), timeout_s=1, poll_s=0.05)
    with pytest.raises(DataError, match=f"{d / 'step-000.jsonl'}: a symbolic link in the rollout directory"):
        dm._wait_next(0)
    (d / "step-000.jsonl").unlink()
    (d / "step-001.jsonl").write_text(real.read_text())
    assert dm._wait_next(0) == d / "step-001.jsonl"


def test_a_rollout_file_reached_through_a_linked_directory_is_refused(tmp_path):
    d, elsewhere = tmp_path / "rollouts", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    (elsewhere / "step-000.jsonl").write_text("{}\n")
    (d / "sub").symlink_to(elsewhere)
    dm = RolloutDirDataModule(str(d), pattern="*/*.jsonl", timeout_s=1, poll_s=0.05)
    with pytest.raises(DataError, match="'sub/step-000.jsonl' leads outside .* through a symbolic link"):
        dm._wait_next(0)


# index files of checkpoint directories ------------------------------------------------------------


def test_shard_names_in_an_index_file_stay_in_the_checkpoint_directory(tmp_path):
    """``../x.safetensors`` in ``model.safetensors.index.json`` is refused by both loaders,
    naming the index file, though the file it names is a valid shard."""
    d = treelit.save_hf_checkpoint(tiny_model("qwen2_tiny", torch.float32, max_seq_len=64), tmp_path / "ckpt")
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    os.replace(d / "model.safetensors", tmp_path / "x.safetensors")
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: "../x.safetensors" for k in keys}}))
    for load in (treelit.load_hf_checkpoint, treelit.load_hf_model):
        with pytest.raises(CheckpointError, match=f"{index}: shard: '../x.safetensors' is not a name inside"):
            load(d)
    # the same shard inside the directory loads
    os.replace(tmp_path / "x.safetensors", d / "x.safetensors")
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: "x.safetensors" for k in keys}}))
    assert treelit.load_hf_checkpoint(d).config.vocab_size > 0


# data globs -------------------------------------------------------------------------------------


def _tree(tmp_path: Path) -> Path:
    """``data/a.jsonl``, ``data/sub/b.jsonl``, ``data/self -> .`` (a self-link), ``data/m1/to2 ->
    ../m2`` and ``data/m2/to1 -> ../m1`` (two mutual links), ``data/alias.jsonl -> a.jsonl``."""
    data = tmp_path / "data"
    for rel in ["a.jsonl", "sub/b.jsonl", "m1/c.jsonl", "m2/d.jsonl"]:
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text('{"id": "x", "branches": [{"input_ids": [1, 2]}]}\n')
    (data / "self").symlink_to(".")
    (data / "m1" / "to2").symlink_to("../m2")
    (data / "m2" / "to1").symlink_to("../m1")
    (data / "alias.jsonl").symlink_to("a.jsonl")
    return data


REAL = ["a.jsonl", "m1/c.jsonl", "m2/d.jsonl", "sub/b.jsonl"]


@pytest.mark.timeout(60)
def test_globs_do_not_follow_linked_directories_and_list_each_file_once(tmp_path, monkeypatch):
    from treelit.data.sources import FileSource

    data = _tree(tmp_path)
    expected = [str(data / r) for r in REAL]
    assert glob_files(str(data / "**" / "*.jsonl")) == expected
    assert walk_files(data, lambda rel: rel.endswith(".jsonl")) == expected
    assert FileSource(str(data / "**" / "*.jsonl")).shards() == expected
    assert FileSource(str(data)).shards() == expected
    monkeypatch.chdir(tmp_path)  # a relative pattern gives relative paths, as glob does
    assert glob_files("data/**/*.jsonl") == [f"data/{r}" for r in REAL]
    assert glob_files("**/m*/*.jsonl") == ["data/m1/c.jsonl", "data/m2/d.jsonl"]
