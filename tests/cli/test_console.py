"""What a user sees: a clean console on a good run, one line (no traceback) on a user error,
and a failure before training when the output directory cannot be written or is full."""

from __future__ import annotations

import json
import sys
import os
import shutil
import stat
import subprocess
from collections import Counter

import pytest
import torch

import treelit
from cli_helpers import TINY, finish, runs, start
from treelit.cli.config import ConfigError, compose
from treelit.cli.train import run

BAR = ("steps", "Training", "Epoch")


def test_a_run_prints_each_line_once_and_ends_with_its_summary(tmp_path, migrated_db):
    """The default MLflow store in the working directory, a 3-step run with the progress bar:
    no line twice (Hydra's and Lightning's handlers both printed before), no library noise, no
    Lightning warning about manual optimization, the summary at the end."""
    shutil.copy(migrated_db, tmp_path / "mlflow.db")
    tiny = [o for o in TINY if "progress" not in o]
    res = finish(start(*tiny, "trainer.max_steps=3", "output_dir=out", cwd=tmp_path))
    assert res.returncode == 0, res.stderr[-4000:]
    text = (res.stdout + "\n" + res.stderr).replace("\r", "\n")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(BAR)]
    twice = {line: n for line, n in Counter(lines).items() if n > 1}
    assert not twice, twice
    for noise in ("Traceback", "warning", "Warning", "INFO", "LeafSpec", "Tip:", "manual optimization",
                  "Creating initial MLflow database", "TPU available"):
        assert noise not in text, (noise, text[-3000:])
    assert "done: 3 steps" in res.stdout and "loss " in res.stdout
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}" in res.stdout
    assert "checkpoint  out/checkpoints/last.ckpt" in res.stdout
    assert "model       out/hf_checkpoint  (Hugging Face format)" in res.stdout
    assert "[treelit.train][INFO] - done: 3 steps" in (tmp_path / "out" / "train.log").read_text()
    # the exported weights are an ordinary file, readable by others like any other output
    mode = stat.S_IMODE(os.stat(tmp_path / "out" / "hf_checkpoint" / "model.safetensors").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "out" / "config.yaml").st_mode)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    client, (r,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert summary["mlflow"]["run_id"] == r.info.run_id and r.info.status == "FINISHED"
    # artifacts beside the database
    arts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"config.yaml", "summary.json", "hf_checkpoint", "checkpoints"} <= arts
    assert (tmp_path / "mlruns" / r.info.run_id / "artifacts" / "hf_checkpoint" / "config.json").is_file()


# user errors: one line, no traceback (in this process: the same entry point) -------------------


@pytest.fixture
def bad_inputs(tmp_path):
    good = {"id": "a", "branches": [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [1, 2, 5]}]}
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(good) + "\n{not json\n")
    corrupt_ckpt = tmp_path / "corrupt.ckpt"
    corrupt_ckpt.write_bytes(b"PK\x03\x04 definitely not a checkpoint")
    hf = treelit.save_hf_checkpoint(treelit.build_model("qwen2_tiny"), tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    return {"bad_json": bad_json, "corrupt_ckpt": corrupt_ckpt, "corrupt_hf": hf, "weights": weights}


def _cases(p):
    return [
        (["data=jsonl", f"data.train_path={p['bad_json']}"], f"{p['bad_json']}:2"),
        (["data=jsonl"], "data.train_path"),
        (["mode=bogus"], "mode must be 'tree' or 'linear'"),
        (["objective.name=nope"], "unknown objective 'nope'"),
        (["resume_from=/nonexistent/last.ckpt"], "resume_from: checkpoint '/nonexistent/last.ckpt' does not exist"),
        ([f"resume_from={p['corrupt_ckpt']}"], f"resume_from: {p['corrupt_ckpt']} is not a readable Lightning checkpoint"),
        ([f"model.hf_checkpoint={p['corrupt_hf']}"], f"{p['weights']}: cannot read weights"),
    ]


@pytest.mark.parametrize("case", range(7), ids=["bad-data", "missing-option", "bad-option", "unknown-name",
                                                 "missing-checkpoint", "corrupt-checkpoint", "corrupt-safetensors"])
def test_user_errors_print_one_line_without_traceback(case, tmp_path, bad_inputs, cli_main, capsys):
    args, expected = _cases(bad_inputs)[case]
    status = cli_main(*args, "logger=none", f"output_dir={tmp_path / 'out'}")
    out, err = capsys.readouterr()
    assert status == 1
    assert "Traceback" not in out + err
    assert "error: " in err and expected in err, err
    lines = err.strip().splitlines()  # the whole of stderr: exactly the one error line
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_hydra_full_error_shows_the_traceback(tmp_path, bad_inputs, cli_main, monkeypatch, capsys):
    from treelit.data.records import DataError

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(DataError, match=":2"):
        cli_main("data=jsonl", f"data.train_path={bad_inputs['bad_json']}", "logger=none",
                 f"output_dir={tmp_path / 'out'}")


def test_an_unknown_config_option_lists_the_known_ones(tmp_path, cli_main, capsys):
    status = cli_main("attention=nope", "logger=none", f"output_dir={tmp_path / 'out'}")
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert "attention/nope" in err and "segment" in err


# the output directory ---------------------------------------------------------------------


def _unwritable(tmp_path):
    if os.geteuid() != 0:
        d = tmp_path / "locked"
        d.mkdir()
        d.chmod(0o500)
        return d / "out"
    return "/sys/treelit-cannot-write-here"  # root ignores permissions; sysfs refuses new entries


def test_an_unwritable_output_dir_fails_before_anything_runs(tmp_path, cli_main, capsys):
    out = _unwritable(tmp_path)
    status = cli_main("logger=none", f"output_dir={out}")
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert f"error: output_dir '{out}': cannot write there" in err
    with pytest.raises(ConfigError, match="cannot write there"):  # the library entry point too
        run(compose([f"output_dir={out}", *TINY, "logger=none"]))


def test_too_little_free_space_fails_before_training(tmp_path, monkeypatch):
    """The first checkpoint and the export must fit: the run stops before training, with the
    numbers (the free space is faked; the check reads it from the filesystem)."""
    from treelit.cli import preflight

    monkeypatch.setattr(preflight, "free_bytes", lambda path: 100 * 1024)
    with pytest.raises(ConfigError, match=r"output_dir .*: 100.0 KiB free on its filesystem, but the first "
                                          r"checkpoint and the model export need about"):
        run(compose([f"output_dir={tmp_path / 'out'}", *TINY, "logger=none"]))
    assert not (tmp_path / "out" / "checkpoints").exists() and not (tmp_path / "out" / "hf_checkpoint").exists()


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs filled to the last byte (needs permission to mount; skipped otherwise)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_fails_before_anything_runs(full_disk, cli_main, capsys):
    status = cli_main("logger=none", f"output_dir={full_disk / 'out'}")
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert f"error: output_dir '{full_disk / 'out'}': cannot write there: No space left on device" in err


def test_exported_weights_and_resume_checkpoint_errors_name_the_file(tmp_path):
    """Library level: a corrupt checkpoint file is named (not a bare pickle/safetensors error)."""
    from treelit.cli.train import read_resume_checkpoint
    from treelit.models.hf import CheckpointError

    ckpt = tmp_path / "x.ckpt"
    torch.save({"state_dict": {}}, ckpt)
    with pytest.raises(CheckpointError, match=rf"{ckpt} is not a Lightning checkpoint"):
        read_resume_checkpoint(str(ckpt))
    ckpt.write_bytes(ckpt.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=rf"{ckpt} is not a readable Lightning checkpoint"):
        read_resume_checkpoint(str(ckpt))


def test_a_file_that_is_not_a_checkpoint_says_what_it_is_not(tmp_path):
    """``resume_from=random.bin``: one line saying the file is not a checkpoint (and what it starts
    with), not torch's weights-only paragraph that invites loading it unsafely."""
    from treelit.cli.train import read_resume_checkpoint
    from treelit.models.hf import CheckpointError

    for name, data in (("random.bin", bytes(range(7, 107))), ("empty.ckpt", b"")):
        f = tmp_path / name
        f.write_bytes(data)
        with pytest.raises(CheckpointError) as info:
            read_resume_checkpoint(str(f))
        msg = str(info.value)
        assert f"{f} is not a checkpoint: a Lightning checkpoint is a zip archive" in msg
        assert "weights_only" not in msg and "\n" not in msg


def test_files_named_in_the_config_are_checked_before_heavy_imports(tmp_path):
    """A missing data file, a file that is not a checkpoint and a checkpoint folder without a
    readable config.json are reported by the first check treelit-train runs, before torch (and so
    Lightning, transformers, MLflow) is imported."""
    import subprocess

    (tmp_path / "random.bin").write_bytes(bytes(range(50, 90)))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "qwen3",')
    cases = [
        (["data=jsonl", f"data.train_path={tmp_path / 'nope.jsonl'}"],
         f"data.train_path: data file '{tmp_path / 'nope.jsonl'}' does not exist"),
        ([f"resume_from={tmp_path / 'random.bin'}"],
         f"resume_from: {tmp_path / 'random.bin'} is not a checkpoint: a Lightning checkpoint is a zip archive"),
        (["model=hf_auto", f"model.hf_checkpoint={tmp_path / 'hf'}"],
         f"model.hf_checkpoint: {tmp_path / 'hf' / 'config.json'}: invalid JSON"),
        (["model=hf_auto", f"model.hf_checkpoint={tmp_path}"],
         f"model.hf_checkpoint: {tmp_path / 'config.json'} does not exist"),
    ]
    code = ("import sys, json\nfrom treelit.cli.config import ConfigError, check_input_files, compose\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    try:\n        check_input_files(compose(args))\n        print('no error')\n"
            "    except ConfigError as exc:\n        print(exc)\n"
            "print('torch' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code, json.dumps([a for a, _ in cases])], capture_output=True,
                         text=True, timeout=120)
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and len(lines) == len(cases) + 1, res.stdout + res.stderr
    for (_, expected), line in zip(cases, lines):
        assert line.startswith(expected), (expected, line)
    assert lines[-1] == "False"  # checked before torch was imported
