"""Resuming a two-process run with the MLflow logger ends without a traceback: every rank
builds the end-of-run summary, and only rank 0 holds the MLflow store (issue: rank 1 raised
AttributeError on ``get_run(...).info``)."""

from __future__ import annotations

import json

import pytest

from cli import run, tail

ARGS = [
    "data=jsonl", "data.shuffle=false", "data.micro_batch_tokens=200", "optimizer=sgd", "trainer=ddp_cpu",
    "callbacks.progress=null", "trainer.enable_progress_bar=false", "model.config.num_layers=1",
    "model.config.embed_dim=32", "model.config.intermediate_dim=64", "callbacks.checkpoint.every_n_train_steps=1",
]


@pytest.mark.slow
def test_resumed_two_process_run_ends_without_a_traceback(tmp_path):
    data = tmp_path / "trees.jsonl"
    data.write_text("".join(json.dumps({"branches": [{"input_ids": [1, 2, 3 + i, 4]}, {"input_ids": [1, 2, 9]}]}) + "\n"
                            for i in range(4)))
    uri = f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*ARGS, f"data.train_path={data}", uri]
    first = tmp_path / "first"
    assert run([*common, f"output_dir={first}", "trainer.max_steps=2"], tmp_path, tmp_path / "first.log") == 0, \
        tail(tmp_path / "first.log")
    ckpt = first / "checkpoints" / "last.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (first / "checkpoints").iterdir())
    log = tmp_path / "resumed.log"
    rc = run([*common, f"output_dir={tmp_path / 'resumed'}", "trainer.max_steps=3", f"resume_from={ckpt}"], tmp_path, log)
    text = log.read_text(errors="replace")
    assert rc == 0, tail(log)
    assert "Traceback" not in text and "AttributeError" not in text, tail(log)
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["mlflow"]["continued"] and summary["mlflow"]["run_name"]
