"""Credentials in tracking URIs never reach what a run writes, logs, prints or sends to MLflow.

The end-to-end test plants two passwords in a local sqlite store's URI, which works offline:
``sqlite:///.../mlflow.db?password=...`` (SQLAlchemy ignores the query argument with a
warning that names the key, not the value), one through ``MLFLOW_TRACKING_URI`` and one on
the command line, and greps every byte the runs wrote: the output folder (Hydra's files,
``config.yaml``, ``summary.json``, ``train.log``, checkpoints, the export), the MLflow
database and its artifacts, and both runs' stdout and stderr. The store must still have
received the runs (the real URI was used to open it).
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from treelit.utils.redact import MASK, RedactFilter, redact_config, redact_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import TINY, cli_cmd, cli_env, runs  # noqa: E402


@pytest.mark.parametrize("text,expected", [
    ("postgresql://alice:PASSWORD@db/mlflow", "postgresql://alice:***@db/mlflow"),
    ("MLFLOW_TRACKING_URI=mysql+pymysql://bob:s3cr%40t@db:3306/m", "MLFLOW_TRACKING_URI=mysql+pymysql://bob:***@db:3306/m"),
    ("https://ghp_TOKEN123@mlflow.example/api", "https://***@mlflow.example/api"),
    ("http://u:p@ss@host:5000/x", "http://u:***@host:5000/x"),  # an unescaped '@' in the password
    ("sqlite:////tmp/m.db?password=hunter2&timeout=5", "sqlite:////tmp/m.db?password=***&timeout=5"),
    ("http://h/x?TOKEN=abc&Api_Key=def&x=1;Secret=ghi", "http://h/x?TOKEN=***&Api_Key=***&x=1;Secret=***"),
    ("s3://b/k?X-Amz-Signature=abc&X-Amz-Credential=def", "s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***"),
    ("logger.mlflow.tracking_uri=http://a:b@h model.api_key=XYZ HF_TOKEN=hf_1",
     "logger.mlflow.tracking_uri=http://a:***@h model.api_key=*** HF_TOKEN=***"),
])
def test_uri_credentials_are_redacted(text, expected):
    assert redact_text(text) == expected


@pytest.mark.parametrize("text", [
    "http://127.0.0.1:5000/#/experiments/1", "sqlite:///mlflow.db", "mail alice@example.com",
    "data.micro_batch_tokens=8192 partition.budget_tokens=90 pad_token=<|endoftext|> max_tokens=5",
    "file:///data/trees.jsonl?page=2", "outputs/2026-01-01_00-00-00-abcdef/checkpoints/last.ckpt",
])
def test_text_without_credentials_is_unchanged(text):
    assert redact_text(text) == text


def test_configs_are_redacted_by_value_and_by_key():
    cfg = {"logger": {"mlflow": {"tracking_uri": "postgresql://alice:pw@db/m", "experiment_name": "x"}},
           "model": {"token": "hf_abc", "pad_token": "<pad>", "db_password": 12345, "api_key": None},
           "data": {"paths": ["https://u:pw@host/a.jsonl", "b.jsonl"], "budget_tokens": 90}}
    assert redact_config(cfg) == {
        "logger": {"mlflow": {"tracking_uri": "postgresql://alice:***@db/m", "experiment_name": "x"}},
        "model": {"token": MASK, "pad_token": "<pad>", "db_password": MASK, "api_key": None},
        "data": {"paths": ["https://u:***@host/a.jsonl", "b.jsonl"], "budget_tokens": 90}}
    assert cfg["model"]["token"] == "hf_abc"  # a copy: the run keeps the real values


def test_log_records_and_tracebacks_are_redacted():
    uri = "postgresql://a:" + "hunter2" + "@db/m"
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "store %s failed", (uri,), None)
    try:
        raise RuntimeError(f"cannot connect to {uri}")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    assert RedactFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "hunter2" not in text
    assert text.startswith("store postgresql://a:***@db/m failed") and "connect to postgresql://a:***@db/m" in text


def _run(args, cwd: Path, env) -> subprocess.CompletedProcess:
    return subprocess.run(cli_cmd(*args), cwd=str(cwd), env=env, capture_output=True, text=True, timeout=600)


def test_a_planted_password_reaches_no_file_no_output_and_not_the_store(tmp_path):
    """Run 1 takes its store from ``MLFLOW_TRACKING_URI`` (``?password=``), run 2 resumes it in
    the same folder with the store given as ``logger.mlflow.tracking_uri=...?token=`` (so Hydra's
    own files hold it too). Neither secret appears in any file under the working directory,
    the MLflow database included, nor in what the runs printed; the store holds both runs."""
    env_secret, cli_secret = f"envpw{secrets.token_hex(6)}", f"clitok{secrets.token_hex(6)}"
    db = tmp_path / "store" / "mlflow.db"
    out = tmp_path / "out"
    common = [*TINY, "callbacks.checkpoint.every_n_train_steps=1", f"output_dir={out}"]
    env = cli_env(MLFLOW_TRACKING_URI=f"sqlite:///{db}?password={env_secret}")
    first = _run([*common, "trainer.max_steps=2"], tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run([*common, "trainer.max_steps=3", f"resume_from={out / 'checkpoints' / 'last.ckpt'}",
                   f"logger.mlflow.tracking_uri='sqlite:///{db}?token={cli_secret}'"], tmp_path, env)
    assert second.returncode == 0, second.stderr[-3000:]

    leaks = []
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    for p in files:
        data = p.read_bytes()
        leaks += [f"{p.relative_to(tmp_path)}: {s}" for s in (env_secret, cli_secret) if s.encode() in data]
    for name, text in (("run 1 stdout", first.stdout), ("run 1 stderr", first.stderr),
                       ("run 2 stdout", second.stdout), ("run 2 stderr", second.stderr)):
        leaks += [f"{name}: {s}" for s in (env_secret, cli_secret) if s in text]
    assert not leaks, leaks

    # what was searched is what a run writes, redacted where the URI used to be
    names = {str(p.relative_to(tmp_path)) for p in files}
    assert {"out/config.yaml", "out/summary.json", "out/train.log", "out/.hydra/overrides.yaml",
            "out/checkpoints/last.ckpt", "store/mlflow.db"} <= names, sorted(names)
    assert "tracking_uri=sqlite:///" in (out / ".hydra" / "overrides.yaml").read_text().replace("'", "")
    assert "?token=***" in (out / ".hydra" / "overrides.yaml").read_text()
    assert "?token=***" in (out / "config.yaml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mlflow"]["tracking_uri"].endswith("mlflow.db?token=***")
    assert "?token=***" in second.stdout  # the printed summary's MLflow UI line
    import torch

    link = torch.load(out / "checkpoints" / "step-000001.ckpt", map_location="cpu", weights_only=True)["treelit_mlflow"]
    assert link["tracking_uri"] == f"sqlite:///{db}?password=***"
    assert "this run logs to" in (out / "train.log").read_text()  # the store differs: a new MLflow run, said so

    # the store was opened with the real URI and holds both runs, their URIs redacted
    _, rs = runs(f"sqlite:///{db}")
    assert [r.info.status for r in rs] == ["FINISHED", "FINISHED"]
    assert rs[0].data.params["logger.mlflow.tracking_uri"] == f"sqlite:///{db}?password=***"
    assert rs[1].data.params["logger.mlflow.tracking_uri"] == f"sqlite:///{db}?token=***"
    assert (db.parent / "mlruns" / rs[0].info.run_id / "artifacts" / "config.yaml").is_file()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_password_in_a_tracking_server_uri_reaches_no_file_and_not_the_server(tmp_path):
    """``MLFLOW_TRACKING_URI=http://alice:PASSWORD@127.0.0.1:PORT`` with a local ``mlflow
    server`` (started here; a minute or more on a loaded machine): the run logs to the server
    (the client sends the credentials as HTTP basic auth), and the password is in no file
    under the working directory (the server's database, artifacts and log included) nor in
    the run's output."""
    import time
    import urllib.request

    secret = f"srvpw{secrets.token_hex(6)}"
    port = _free_port()
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    with open(server_dir / "server.log", "w") as log:
        server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
                                   f"sqlite:///{server_dir / 'server.db'}", "--host", "127.0.0.1", "--port", str(port),
                                   "--workers", "1"], cwd=server_dir, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, (server_dir / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(2)
        uri = f"http://alice:{secret}@127.0.0.1:{port}"
        out = tmp_path / "out"
        done = _run([*TINY, "trainer.max_steps=2", f"output_dir={out}"], tmp_path / "server",
                    cli_env(MLFLOW_TRACKING_URI=uri))
        assert done.returncode == 0, done.stderr[-3000:]
        _, rs = runs(f"http://127.0.0.1:{port}")
        assert len(rs) == 1 and rs[0].info.status == "FINISHED"
        assert rs[0].data.params["logger.mlflow.tracking_uri"] == f"http://alice:***@127.0.0.1:{port}"
        assert json.loads((out / "summary.json").read_text())["mlflow"]["tracking_uri"] == \
            f"http://alice:***@127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(60)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    leaks = [str(p.relative_to(tmp_path)) for p in files if secret.encode() in p.read_bytes()]
    leaks += [f"{name}: {line}" for name, text in (("stdout", done.stdout), ("stderr", done.stderr))
              for line in text.splitlines() if secret in line]
    assert not leaks, leaks
    assert {"server/server.db", "out/config.yaml", "out/train.log", "out/checkpoints/last.ckpt"} <= \
        {str(p.relative_to(tmp_path)) for p in files}
