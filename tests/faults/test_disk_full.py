"""A disk that fills while a run writes: checkpoints, the final export, policy publishes and
MLflow artifact copies, each at several points of its write, on one process and on rank 0 or
rank 1 of two FSDP2 processes. The fault is real: the kernel refuses writes past the process's
file-size limit (``RLIMIT_FSIZE``, ``EFBIG``), set at the chosen moment (``fsize_launch.py``).

Every case asserts: the previous checkpoint or version is complete and loads (its manifest
checks out), no partial file is left, one line names the path and the bytes the write needed;
a checkpoint or export failure stops the run (the whole of stderr is that one ``error:`` line,
exit 1); a publish with ``publish.required=false`` goes on and is counted, with ``true`` it
stops."""

from __future__ import annotations

import json
import logging
import re
import resource
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import treelit
from fsize_launch import TINY, cli_env, leftovers, one_error_line, run_limited
from treelit.cli.train import read_resume_checkpoint
from treelit.lightning.safe_checkpoint import verify_checkpoint
from treelit.utils.integrity import MANIFEST, verify

COMMON = [*TINY, "logger=none", "trainer.max_steps=3", "callbacks.checkpoint.every_n_train_steps=1"]
NEEDED = re.compile(r"it needs (?:about )?[\d.]+ \w+ \(([\d,]+) bytes\)")
KiB = 1024


def needed(line: str) -> int:
    m = NEEDED.search(line)
    assert m, line
    return int(m.group(1).replace(",", ""))


def train(work: Path, name: str, *extra: str, at=None, limit=0, rank=0, once=False, common=COMMON):
    out = work / name
    res = run_limited("train", [*common, f"output_dir={out}", *extra], work, at, limit, rank, once)
    return out, res


def step_of(ckpt: Path) -> int:
    assert verify_checkpoint(ckpt), f"{ckpt} has no manifest"
    return read_resume_checkpoint(str(ckpt))["global_step"]


# checkpoints, one process ---------------------------------------------------------------------

# (which checkpoint write gets the limit, the limit, the file that fails, at step, what is left)
# per step the callback writes step-<N>.ckpt, then last.ckpt: write 0 is step 1's, 2 is step 2's
CHECKPOINT_POINTS = {
    # the first checkpoint, cut at its first bytes: nothing to keep
    "first-write-first-bytes": (0, 16 * KiB, "step-000001.ckpt", 1, {}),
    # step 2's checkpoint cut in the middle: step 1's two files stay
    "later-write-middle": (2, 160_000, "step-000002.ckpt", 2, {"step-000001.ckpt": 1, "last.ckpt": 1}),
    # last.ckpt overwritten at step 2, cut in its last bytes: the old last.ckpt (step 1) stays whole
    "overwrite-last-bytes": (3, 327_000, "last.ckpt", 2,
                             {"step-000001.ckpt": 1, "step-000002.ckpt": 2, "last.ckpt": 1}),
}


@pytest.mark.parametrize("point", [pytest.param("first-write-first-bytes", marks=pytest.mark.slow),
                                   "later-write-middle",
                                   pytest.param("overwrite-last-bytes", marks=pytest.mark.slow)])
def test_a_checkpoint_write_that_fails_stops_the_run_and_keeps_the_previous(tmp_path, point):
    index, limit, name, step, kept = CHECKPOINT_POINTS[point]
    out, res = train(tmp_path, "run", at=f"checkpoint:{index}", limit=limit)
    assert res.returncode == 1, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    ckpts = out / "checkpoints"
    assert line.startswith(f"error: checkpoint {ckpts / name} not written at step {step}: file too large"), line
    size = needed(line)
    assert size > limit, (size, limit)  # the limit did fall inside this write
    if point == "overwrite-last-bytes":
        assert size - limit < 0.02 * size, (size, limit)  # ... in its last bytes
    assert leftovers(out) == []
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == sorted(kept)
    for f, s in kept.items():
        assert step_of(ckpts / f) == s, f
    if kept:
        assert "is complete: resume_from=" in line or "is as it was: resume_from=" in line, line
        assert abs(size - (ckpts / "last.ckpt").stat().st_size) < 0.01 * size  # a checkpoint's size, exactly counted
    else:
        assert line.endswith("this run has no earlier checkpoint"), line
    assert not (out / "hf_checkpoint").exists() and not (out / "summary.json").exists()


@pytest.mark.slow  # three runs, about 40 s
def test_resuming_from_the_kept_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Nothing is lost: after the step-2 checkpoint failed, ``resume_from`` the step-1
    ``last.ckpt`` reaches the weights of a run that never met the fault, bit for bit."""
    full, res = train(tmp_path, "uninterrupted")
    assert res.returncode == 0, res.stderr[-3000:]
    cut, res = train(tmp_path, "cut", at="checkpoint:2", limit=160_000)
    assert res.returncode == 1, res.stderr[-3000:]
    resumed, res = train(tmp_path, "resumed", f"resume_from={cut / 'checkpoints' / 'last.ckpt'}")
    assert res.returncode == 0, res.stderr[-3000:]
    a = treelit.load_hf_checkpoint(full / "hf_checkpoint").state_dict()
    b = treelit.load_hf_checkpoint(resumed / "hf_checkpoint").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# the export -----------------------------------------------------------------------------------


def test_an_export_that_fails_stops_the_run_and_leaves_no_partial_folder(tmp_path):
    out, res = train(tmp_path, "run", at="export", limit=50 * KiB)
    assert res.returncode == 1, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert line.startswith(f"error: export {out / 'hf_checkpoint'} not written: file too large"), line
    assert needed(line) > 50 * KiB and line.endswith(f"nothing was left at {out / 'hf_checkpoint'}"), line
    assert not (out / "hf_checkpoint").exists() and leftovers(out) == []
    assert step_of(out / "checkpoints" / "last.ckpt") == 3  # written before the export: complete


@pytest.mark.slow  # two runs
def test_a_failed_export_leaves_the_earlier_export_of_the_folder_as_it_was(tmp_path):
    """A run resumed in its own folder writes its export over the earlier one only once it is
    complete: cut short, the earlier export is untouched (byte for byte) and still loads."""
    out, res = train(tmp_path, "run", common=[c for c in COMMON if "max_steps" not in c] + ["trainer.max_steps=2"])
    assert res.returncode == 0, res.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in (out / "hf_checkpoint").iterdir()}
    res = run_limited("train", [*COMMON, f"output_dir={out}", f"resume_from={out / 'checkpoints' / 'last.ckpt'}"],
                      tmp_path, "export", 50 * KiB)
    assert res.returncode == 1, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert f"the earlier {out / 'hf_checkpoint'} is as it was" in line, line
    assert {p.name: p.read_bytes() for p in (out / "hf_checkpoint").iterdir()} == before
    treelit.load_hf_checkpoint(out / "hf_checkpoint")
    assert leftovers(out) == [] and step_of(out / "checkpoints" / "last.ckpt") == 3


# policy publishing ------------------------------------------------------------------------------

PUBLISH = ["publish.dtype=float32", "publish.keep=5", "publish.tokenizer=null"]


def test_a_publish_that_fails_is_counted_and_training_goes_on(tmp_path):
    """``publish.required=false``: version 2 (after step 2) cannot be written; the run warns once,
    naming it and its size, and finishes; ``latest.json`` went from version 1 to 3 and every
    version it can name is complete."""
    pub = tmp_path / "policy"
    out, res = train(tmp_path, "run", f"publish.dir={pub}", *PUBLISH, at="publish:2", limit=50 * KiB, once=True)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: publish: version 2 ({pub / 'step-2'}) not written: "
                                                   "file too large"), res.stderr
    assert "latest.json still names version 1" in lines[0] and "training goes on" in lines[0]
    assert needed(lines[0]) > 50 * KiB
    assert json.loads((pub / "latest.json").read_text())["version"] == 3
    assert sorted(p.name for p in pub.iterdir()) == ["latest.json", "step-0", "step-1", "step-3"]
    for v in (0, 1, 3):
        assert verify(pub / f"step-{v}", "test") == pub / f"step-{v}" / MANIFEST
    assert leftovers(tmp_path) == []
    log = (out / "train.log").read_text()
    assert "version 2" in log and "published version 3" in log


@pytest.mark.slow
def test_a_required_publish_that_fails_stops_the_run(tmp_path):
    pub = tmp_path / "policy"
    out, res = train(tmp_path, "run", f"publish.dir={pub}", *PUBLISH, "publish.required=true", at="publish:2",
                     limit=50 * KiB, once=True)
    assert res.returncode == 1, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert line.startswith(f"error: publish: version 2 ({pub / 'step-2'}) not written: file too large"), line
    assert line.endswith("(publish.required=true)"), line
    assert json.loads((pub / "latest.json").read_text())["version"] == 1
    assert sorted(p.name for p in pub.iterdir()) == ["latest.json", "step-0", "step-1"]
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_the_first_publish_failing_is_retried_at_the_next_step(tmp_path):
    """Version 0 (before any step) cannot be written: nothing is named in ``latest.json`` until
    version 1 is."""
    pub = tmp_path / "policy"
    out, res = train(tmp_path, "run", f"publish.dir={pub}", *PUBLISH, at="publish:0", limit=16 * KiB, once=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no version was published before" in res.stderr, res.stderr
    assert sorted(p.name for p in pub.iterdir()) == ["latest.json", "step-1", "step-2", "step-3"]


# MLflow artifact copies -------------------------------------------------------------------------

@contextmanager
def file_size_limit(n: int):
    """This process's file-size limit lowered to ``n`` bytes for the block (SIGXFSZ ignored: a
    write past it fails with EFBIG), then lifted again."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)


def test_an_mlflow_artifact_copy_that_fails_leaves_no_partial_copy(tmp_path, caplog):
    """A local artifact store (what a sqlite store on this machine uses): a file and a folder
    copied past the limit fail with one warning each (the artifact, the bytes it needed), no
    partial copy is left, and an earlier artifact of the same name keeps its content. (The
    limit is lowered in this process around the copies only; the client is a stand-in that
    names the run's artifact folder, all MLflow is asked for.)"""
    from treelit.lightning.mlflow_logger import log_artifact_checked

    root = tmp_path / "mlruns" / "run" / "artifacts"
    client = SimpleNamespace(get_run=lambda run_id: SimpleNamespace(info=SimpleNamespace(artifact_uri=root.as_uri())))
    small, big, folder = tmp_path / "x.bin", tmp_path / "big" / "x.bin", tmp_path / "export"
    big.parent.mkdir()
    folder.mkdir()
    small.write_bytes(b"s" * 10_000)
    big.write_bytes(b"b" * 300_000)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"m" * 200_000)
    assert log_artifact_checked(client, "run", small, "files")
    with caplog.at_level(logging.WARNING), file_size_limit(100_000):
        copied = log_artifact_checked(client, "run", big, "files"), log_artifact_checked(client, "run", folder, "export")
    assert copied == (False, False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert f"MLflow artifact {root / 'files' / 'x.bin'} not copied: file too large" in warnings[0]
    assert "(300,000 bytes)" in warnings[0] and "the earlier x.bin is as it was" in warnings[0]
    assert f"MLflow artifact {root / 'export'} not copied: file too large" in warnings[1]
    assert "(200,002 bytes)" in warnings[1]
    assert (root / "files" / "x.bin").read_bytes() == b"s" * 10_000
    assert not (root / "export").exists() and leftovers(tmp_path) == []
    assert log_artifact_checked(client, "run", folder, "export")  # with room again: copied whole
    assert (root / "export" / "model.safetensors").stat().st_size == 200_000


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory):
    """A migrated, empty MLflow database to copy (creating one costs seconds of migrations)."""
    path = tmp_path_factory.mktemp("mlflow_template") / "template.db"
    subprocess.run([sys.executable, "-c", "import sys; from mlflow.tracking import MlflowClient; "
                    "MlflowClient(f'sqlite:///{sys.argv[1]}').search_experiments()", str(path)],
                   env=cli_env(), check=True, capture_output=True, timeout=300)
    return path


@pytest.mark.slow  # a run with MLflow: the export's and the last checkpoint's copies fail
def test_a_run_whose_mlflow_copies_fail_still_ends_with_its_outputs(tmp_path, migrated_db):
    shutil.copy(migrated_db, tmp_path / "mlflow.db")
    limit = 2 * 1024 * KiB  # above the database (about 1 MB, it grows while the run logs) ...
    common = [c.replace("model.config.embed_dim=32", "model.config.embed_dim=768").replace("logger=none", "logger=mlflow")
              for c in COMMON]
    out, res = train(tmp_path, "run", f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                     "trainer.max_steps=1", at="artifacts", limit=limit, common=common)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("warning: MLflow artifact ") for ln in lines), res.stderr
    assert "hf_checkpoint not copied: file too large" in lines[0] and "last.ckpt not copied" in lines[1], lines
    assert all(needed(ln) > limit for ln in lines)  # ... and below the export (and the checkpoint)
    assert (out / "hf_checkpoint" / "model.safetensors").is_file() and step_of(out / "checkpoints" / "last.ckpt") == 1
    assert leftovers(tmp_path) == []


# two FSDP2 processes --------------------------------------------------------------------------


@pytest.mark.slow  # two processes: about 45 s each on 2 cores
@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp2_a_shard_write_that_fails_on_one_rank_stops_every_rank(tmp_path, rank):
    """Step 2's sharded checkpoint: the shard of ``rank`` cannot be written (mid-file). Every
    rank stops after the same step, one line (rank 0's) names the checkpoint, the failing rank
    and the bytes of every shard; step 1's sharded checkpoints are complete and load."""
    out, res = train(tmp_path, "run", "trainer=fsdp2_cpu", at="checkpoint:2", limit=100 * KiB, rank=rank)
    assert res.returncode == 1, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    ckpts = out / "checkpoints"
    assert line.startswith(f"error: checkpoint {ckpts / 'step-000002.ckpt'} not written at step 2: file too large "
                           f"(the file-size limit, ulimit -f) (rank {rank} of 2); it needs about "), line
    assert "(the shards of every rank)" in line and needed(line) > 100 * KiB
    assert leftovers(out) == [] and sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step-000001.ckpt"]
    for name in ("last.ckpt", "step-000001.ckpt"):
        assert step_of(ckpts / name) == 1


@pytest.mark.slow
def test_fsdp2_an_export_that_fails_on_rank_0_stops_every_rank(tmp_path):
    """Only rank 0 writes the export; the other rank learns of the failure and stops too."""
    out, res = train(tmp_path, "run", "trainer=fsdp2_cpu", "trainer.max_steps=1", at="export", limit=50 * KiB)
    assert res.returncode == 1, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert line.startswith(f"error: export {out / 'hf_checkpoint'} not written: file too large"), line
    assert not (out / "hf_checkpoint").exists() and leftovers(out) == []
    assert step_of(out / "checkpoints" / "last.ckpt") == 1


@pytest.mark.slow
def test_fsdp2_a_required_publish_that_fails_on_rank_0_stops_every_rank(tmp_path):
    """Only rank 0 writes a version; with ``publish.required=true`` the ranks agree to stop and
    rank 0's line is the only one printed."""
    pub = tmp_path / "policy"
    out, res = train(tmp_path, "run", "trainer=fsdp2_cpu", f"publish.dir={pub}", *PUBLISH, "publish.required=true",
                     at="publish:2", limit=50 * KiB, once=True)
    assert res.returncode == 1, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert line.startswith(f"error: publish: version 2 ({pub / 'step-2'}) not written: file too large"), line
    assert json.loads((pub / "latest.json").read_text())["version"] == 1 and leftovers(tmp_path) == []


def test_a_full_disk_a_quota_and_the_size_limit_are_recognised_inside_library_errors():
    """The tests above meet EFBIG; a full disk raises ENOSPC and a quota EDQUOT, through the
    same wrappers: torch's RuntimeError over the OSError, safetensors' text, torch's gathered
    CheckpointException (the OSError pickled with its errno), shutil's list of errors."""
    import errno

    from treelit.utils.integrity import disk_full

    def wrapped(code):
        try:
            try:
                raise OSError(code, "write")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        except RuntimeError as exc:
            return exc

    class Gathered(BaseException):
        failures = {1: (OSError(errno.ENOSPC, "No space left on device"), None)}

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert disk_full(wrapped(code)) == code
    assert disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")) \
        == errno.ENOSPC
    assert disk_full(Gathered()) == errno.ENOSPC
    assert disk_full(shutil.Error([("a", "b", "[Errno 122] Disk quota exceeded")])) == errno.EDQUOT
    assert disk_full(RuntimeError("unexpected pos 704 vs 598")) is None and disk_full(PermissionError(13, "x")) is None
