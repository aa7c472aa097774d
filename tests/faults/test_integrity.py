"""Checkpoints and published policy versions carry a manifest (size and SHA-256 of each file):
a file cut short by a failed copy, altered after it was written, or missing is refused in one
line naming it, before torch or safetensors read it; one written before manifests existed
still loads. Single-file checkpoints come from a real run; sharded ones are torch's
distributed checkpoint (one process here; two ranks under FSDP2 in the slow test)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsize_launch import TINY, cli_env, one_error_line
from treelit.cli.config import compose
from treelit.cli.train import read_resume_checkpoint, run
from treelit.models.errors import CheckpointError
from treelit.utils.integrity import MANIFEST, MANIFEST_SUFFIX, verify, write_manifest


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step run's checkpoint folder (every step checkpointed)."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    run(compose([f"output_dir={out}", *TINY, "logger=none", "trainer.max_steps=1",
                 "callbacks.checkpoint.every_n_train_steps=1", "callbacks.hf_export=null"]))
    return out / "checkpoints"


@pytest.fixture
def ckpt(trained, tmp_path):
    """A private copy of the run's ``last.ckpt`` and its manifest."""
    for name in ("last.ckpt", "last.ckpt" + MANIFEST_SUFFIX):
        (tmp_path / name).write_bytes((trained / name).read_bytes())
    return tmp_path / "last.ckpt"


def test_a_checkpoint_records_each_file_it_writes(trained):
    manifest = json.loads((trained / ("last.ckpt" + MANIFEST_SUFFIX)).read_text())
    assert manifest["algorithm"] == "sha256" and list(manifest["files"]) == ["last.ckpt"]
    assert manifest["files"]["last.ckpt"]["bytes"] == (trained / "last.ckpt").stat().st_size
    assert verify(trained / "last.ckpt", "test") is not None
    assert read_resume_checkpoint(str(trained / "last.ckpt"))["global_step"] == 1
    assert not list(trained.glob("*partial*")) and not list(trained.glob(".*"))


def _truncate(f: Path, keep: float = 0.5) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])


def _alter(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit pattern in the middle: same size, different bytes
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("fault,expected", [
    (_truncate, "is truncated: "),
    (_alter, "was altered after it was written: its sha256 differs"),
    (lambda f: f.write_bytes(f.read_bytes() + b"\0" * 10), "is longer than written"),
], ids=["truncated", "altered", "extended"])
def test_a_damaged_checkpoint_file_is_named_before_torch_reads_it(ckpt, fault, expected):
    fault(ckpt)
    with pytest.raises(CheckpointError) as info:
        read_resume_checkpoint(str(ckpt))
    msg = str(info.value)
    assert msg.startswith(f"resume_from: {ckpt} ") and expected in msg and "\n" not in msg, msg


def test_the_command_line_reports_a_truncated_checkpoint_in_one_line(ckpt, tmp_path, cli_main, capsys):
    _truncate(ckpt, 0.9)
    status = cli_main(*TINY, "logger=none", "trainer.max_steps=2", f"resume_from={ckpt}",
                      f"output_dir={tmp_path / 'out'}")
    err = capsys.readouterr().err
    assert status == 1
    line = one_error_line(err)
    assert f"resume_from: {ckpt} is truncated: " in line, err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_checkpoint_without_a_manifest_still_loads_with_a_warning(ckpt, caplog):
    """Checkpoints written before treelit recorded manifests: read as before, said once."""
    (ckpt.parent / ("last.ckpt" + MANIFEST_SUFFIX)).unlink()
    with caplog.at_level(logging.WARNING):
        assert read_resume_checkpoint(str(ckpt))["global_step"] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(ckpt) in warned[0] and "no manifest" in warned[0], warned


def test_an_unreadable_or_foreign_manifest_is_named(ckpt):
    manifest = ckpt.parent / ("last.ckpt" + MANIFEST_SUFFIX)
    manifest.write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"resume_from: {manifest} is not a readable manifest"):
        read_resume_checkpoint(str(ckpt))
    write_manifest(ckpt)  # a good one again, then renamed onto another file
    other = ckpt.with_name("other.ckpt")
    ckpt.rename(other)
    manifest.rename(other.with_name("other.ckpt" + MANIFEST_SUFFIX))
    with pytest.raises(CheckpointError, match=r"describes 'last.ckpt', not 'other.ckpt'"):
        read_resume_checkpoint(str(other))


# sharded checkpoints ---------------------------------------------------------------------------


def _sharded(path: Path) -> Path:
    """torch's distributed checkpoint (one process) with Lightning's ``meta.pt`` and a manifest."""
    import torch.distributed.checkpoint as dcp

    from helpers import tiny_model

    model = tiny_model("qwen2_tiny", torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    with pytest.warns(UserWarning):  # no process group: torch says it assumes one process
        dcp.save({"state_dict": model.state_dict(), "optimizer_0": opt.state_dict()}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 7, "epoch": 0}, path / "meta.pt")
    write_manifest(path)
    return path


@pytest.mark.parametrize("name,fault,expected", [
    ("__0_0.distcp", _truncate, "is truncated"),
    ("__0_0.distcp", _alter, "was altered after it was written"),
    (".metadata", _alter, "was altered after it was written"),
    ("meta.pt", Path.unlink, "is missing (its manifest treelit-manifest.json lists it)"),
], ids=["shard-truncated", "shard-altered", "metadata-altered", "meta-missing"])
def test_a_damaged_sharded_checkpoint_names_the_file(tmp_path, name, fault, expected):
    ckpt = _sharded(tmp_path / "last.ckpt")
    assert read_resume_checkpoint(str(ckpt))["global_step"] == 7
    fault(ckpt / name)
    with pytest.raises(CheckpointError) as info:
        read_resume_checkpoint(str(ckpt))
    assert str(info.value).startswith(f"resume_from: {ckpt / name} {expected}"), str(info.value)


def test_a_manifest_cannot_point_outside_its_folder(tmp_path):
    ckpt = _sharded(tmp_path / "last.ckpt")
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"]["../outside"] = {"bytes": 1, "sha256": "0"}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"'\.\./outside' is not a name inside"):
        read_resume_checkpoint(str(ckpt))


@pytest.mark.slow  # two FSDP2 processes: about 40 s on 2 cores
@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp2_resume_from_a_truncated_shard_of_either_rank_is_one_line(tmp_path_factory, rank, fsdp2_checkpoint):
    """A real two-rank checkpoint; the shard of rank 0 or of rank 1 cut short: ``treelit-train
    trainer=fsdp2_cpu resume_from=...`` exits 1 with one line naming that shard, before the
    second process is started."""
    work = tmp_path_factory.mktemp(f"fsdp2_trunc{rank}")
    ckpt = work / "last.ckpt"
    ckpt.mkdir()
    for f in fsdp2_checkpoint.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    shard = ckpt / f"__{rank}_0.distcp"
    _truncate(shard, 0.75)
    res = subprocess.run([sys.executable, "-m", "treelit.cli.train", *TINY, "logger=none", "trainer=fsdp2_cpu",
                          "trainer.max_steps=3", f"resume_from={ckpt}", f"output_dir={work / 'out'}"],
                         cwd=work, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    assert f"resume_from: {shard} is truncated: " in one_error_line(res.stderr), res.stderr


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory):
    work = tmp_path_factory.mktemp("fsdp2_ckpt")
    res = subprocess.run([sys.executable, "-m", "treelit.cli.train", *TINY, "logger=none", "trainer=fsdp2_cpu",
                          "trainer.max_steps=1", "callbacks.checkpoint.every_n_train_steps=1", "callbacks.hf_export=null",
                          f"output_dir={work / 'out'}"],
                         cwd=work, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = work / "out" / "checkpoints" / "last.ckpt"
    names = set(json.loads((ckpt / MANIFEST).read_text())["files"])
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= names, names
    return ckpt


def test_write_manifest_syncs_and_is_written_last(tmp_path):
    """The manifest lists every file but itself, and is replaced whole (no temporary left)."""
    d = tmp_path / "v"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(os.urandom(1000))
    (d / "sub" / "b.json").write_text("{}")
    write_manifest(d)
    files = json.loads((d / MANIFEST).read_text())["files"]
    assert sorted(files) == ["a.bin", "sub/b.json"]
    assert sorted(p.name for p in d.iterdir()) == ["a.bin", "sub", MANIFEST]
    assert verify(d, "test") == d / MANIFEST


# published policy versions ----------------------------------------------------------------------


@pytest.fixture
def published(tmp_path):
    """Versions 0 and 1 of a small model, published as a trainer publishes them."""
    from helpers import tiny_model
    from treelit.lightning.publish import PolicyPublisher

    pub = PolicyPublisher(tmp_path / "policy", dtype="float32")
    pub.prepare()
    model = tiny_model("qwen2_tiny", torch.float32)
    for version in (0, 1):
        pub.publish(model, version)
    return tmp_path / "policy"


def test_a_published_version_records_each_file_and_loads(published):
    from treelit.cli.rollout import Sampler
    from treelit.lightning.publish import read_latest

    for v in (0, 1):
        files = json.loads((published / f"step-{v}" / MANIFEST).read_text())["files"]
        assert {"config.json", "model.safetensors", "generation_config.json", "treelit_publish.json"} <= set(files)
        assert set(files) == {p.name for p in (published / f"step-{v}").iterdir()} - {MANIFEST}
    sampler = Sampler(str(published))
    sampler.load(read_latest(published))
    assert sampler.version == 1


@pytest.mark.parametrize("fault,expected", [(_truncate, "is truncated"), (_alter, "was altered after it was written")],
                         ids=["truncated", "altered"])
def test_treelit_rollout_refuses_a_damaged_version_in_one_line(published, tmp_path, capsys, fault, expected):
    """The sampler checks the version ``latest.json`` names before reading it: one ``error:``
    line naming the file (exit 1), nothing from inside safetensors or transformers."""
    from treelit.cli.rollout import main

    weights = published / "step-1" / "model.safetensors"
    fault(weights)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "p", "input_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["--publish-dir", str(published), "--prompts", str(tmp_path / "prompts.jsonl"), "--out",
              str(tmp_path / "rollouts"), "--reward", "even_tokens", "--steps", "1", "--timeout-s", "5"])
    assert info.value.code == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == line.splitlines()[0] and line.startswith(f"error: published version 1: {weights} {expected}"), line
