"""Regression tests for small command-line bugs, each with its minimal case: the end-of-run
summary on a rank without the MLflow store, ``treelit stats`` on globs and directories, and
messages (grammar, what ``max_steps=-1`` means, an output_dir that is a file)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


# resuming a multi-process run: build_summary on a rank that holds no MLflow store ------------------


def test_summary_on_a_rank_without_the_mlflow_store(tmp_path, mlflow_db, monkeypatch):
    """On rank > 0 (a resumed run passes the checkpoint's run id to every rank) the logger's
    experiment is Lightning's no-op stand-in and get_run returns None."""
    import lightning.fabric.loggers.logger as fabric_logger

    from treelit.cli.summary import build_summary, format_summary
    from treelit.lightning.mlflow_logger import TreeMLFlowLogger

    _, uri = mlflow_db
    first = TreeMLFlowLogger(tracking_uri=uri, run_name="first")
    run_id = first.run_id
    monkeypatch.setattr(fabric_logger.rank_zero_only, "rank", 1)
    other = TreeMLFlowLogger(tracking_uri=uri, run_name="first", run_id=run_id)
    assert other.experiment.get_run(run_id) is None  # the case: no store on this rank
    trainer = SimpleNamespace(callback_metrics={}, global_step=3, callbacks=[], loggers=[other],
                              is_global_zero=False)
    s = build_summary(out=tmp_path, trainer=trainer, data_stats={}, wall_seconds=1.0,
                      resume={"path": "last.ckpt", "global_step": 2})
    assert s["mlflow"]["run_id"] == run_id and s["mlflow"]["run_name"] is None
    assert f"(id {run_id}, continued)" in format_summary(s)
    monkeypatch.setattr(fabric_logger.rank_zero_only, "rank", 0)
    trainer.loggers = [first]
    s = build_summary(out=tmp_path, trainer=trainer, data_stats={}, wall_seconds=1.0)
    assert s["mlflow"]["run_name"] == "first"
    first.finalize("success")


# treelit stats: globs, directories and lists, as data=stream takes them -----------------------------


def _shards(root):
    import gzip
    import json

    (root / "shards" / "sub").mkdir(parents=True)
    files = [root / "shards" / "a.jsonl.gz", root / "shards" / "b.jsonl.gz", root / "shards" / "sub" / "c.jsonl"]
    for i, f in enumerate(files):
        text = "".join(json.dumps({"branches": [{"input_ids": [1, 2, 3 + i, k]}, {"input_ids": [1, 2, 9]}]}) + "\n"
                       for k in range(i + 2))
        if f.suffix == ".gz":
            with gzip.open(f, "wt") as fh:
                fh.write(text)
        else:
            f.write_text(text)
    return files  # 2 + 3 + 4 records, one tree each


def _stats_out(capsys, *args):
    from treelit.cli.main import main

    rc = main(["stats", *args])
    out, err = capsys.readouterr()
    return rc, {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in out.splitlines()}, err


@pytest.mark.parametrize("args, trees", [
    (["{root}/shards/*.jsonl.gz"], 5),
    (["{root}/shards"], 9),  # a directory: its data files, recursively
    (["{root}/shards/**/*.jsonl"], 4),
    (["{root}/shards/a.jsonl.gz", "{root}/shards/sub"], 6),  # a list
    (["{root}/shards/sub/c.jsonl"], 4),
])
def test_stats_takes_globs_directories_and_lists(tmp_path, capsys, args, trees):
    _shards(tmp_path)
    rc, out, err = _stats_out(capsys, *[a.format(root=tmp_path) for a in args])
    assert rc == 0, err
    assert out["trees"] == str(trees) and out["records"] == str(trees)


def test_stats_glob_matching_nothing_is_one_error_line(tmp_path, capsys):
    _shards(tmp_path)
    rc, _, err = _stats_out(capsys, str(tmp_path / "shards" / "*.parquet"))
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith("treelit stats: error: the pattern") and "matches no file" in err
    assert "data.source.paths" not in err


def test_stats_still_reads_a_bundled_file_by_name(capsys):
    rc, out, err = _stats_out(capsys, "synthetic_agentic.jsonl.gz")
    assert rc == 0, err
    assert int(out["trees"].replace(",", "")) > 0 and out["file"].endswith("synthetic_agentic.jsonl.gz")


# one step axis in MLflow: the optimizer step, also with several optimizer steps per data step -------


def test_rl_metrics_share_the_optimizer_step_axis(tmp_path, mlflow_db):
    """ppo_epochs=2: each data step makes two optimizer steps. The module's metrics (loss, clip
    fraction) and the reward-margin callback's must be logged on the same (optimizer) axis:
    a data step's metrics at its last optimizer step's index (k - 1), the margin measured after
    k optimizer steps at k."""
    from mlflow.tracking import MlflowClient

    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run

    _, uri = mlflow_db
    small = [o for o in SMALL if not o.startswith("logger=")]
    cfg = compose([f"output_dir={tmp_path / 'rl'}", "experiment=rl_synthetic", *small, f"logger.mlflow.tracking_uri={uri}",
                   "trainer.max_steps=6", "trainer.log_every_n_steps=1", "callbacks.reward_margin.every_n_steps=2",
                   "callbacks.reward_margin.max_trees=4", "callbacks.hf_export=null"])
    assert cfg.ppo_epochs == 2
    summary = run(cfg)
    assert summary["global_step"] == 6 and "step" not in summary["metrics"]
    client = MlflowClient(uri)
    rid = summary["mlflow"]["run_id"]
    steps = {k: sorted(m.step for m in client.get_metric_history(rid, k))
             for k in ("loss", "clip_frac", "epoch", "reward/margin")}
    assert steps["loss"] == steps["clip_frac"] == steps["epoch"] == [1, 3, 5], steps
    assert steps["reward/margin"] == [0, 2, 4, 6], steps


# small messages ------------------------------------------------------------------------------------


def test_invalid_json_control_character_says_at_once(tmp_path):
    from treelit.data.records import DataError, iter_file

    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"branches": [{"input_ids": [1, 2]}]}\n{"id": "a\x01b", "branches": []}\n')
    errors = [str(x) for x in iter_file(str(p)) if isinstance(x, DataError)]
    assert len(errors) == 1 and errors[0].endswith("d.jsonl:2: invalid JSON (Invalid control character at column 10)")
    q = tmp_path / "d.json"
    q.write_bytes(b'[{"id": "a\x01b"}]')
    errors = [str(x) for x in iter_file(str(q)) if isinstance(x, DataError)]
    assert len(errors) == 1 and "at at" not in errors[0] and "Invalid control character at column" in errors[0]


def test_one_skipped_record_is_one_record(tmp_path, caplog):
    import logging

    from treelit.builders.base import make_tree_builder
    from treelit.lightning.data import TreeDataModule

    p = tmp_path / "d.jsonl"
    p.write_text('{"branches": [{"input_ids": [1, 2, 3]}]}\nnot json\n')
    with caplog.at_level(logging.WARNING):
        dm = TreeDataModule(str(p), tree_builder=make_tree_builder("sequences"), on_error="skip", shuffle=False)
        dm.check_against(100, 64)
    assert dm.read_stats.skipped == 1
    assert "skipped 1 malformed record (data.on_error=skip)" in caplog.text


def test_done_line_says_one_step():
    from treelit.cli.summary import format_summary

    s = {"global_step": 1, "wall_seconds": 2.0, "config": "out/config.yaml", "data": {}}
    assert format_summary(s).splitlines()[0] == "done: 1 step in 2s"
    assert format_summary({**s, "global_step": 2}).splitlines()[0] == "done: 2 steps in 2s"


def test_one_group_of_one_sample_is_the_only_group(caplog):
    import logging

    from treelit.rl.advantages import AdvantageError, compute_advantages

    with pytest.raises(AdvantageError, match=r"the only group \(samples sharing 'group'\) has a single sample"):
        compute_advantages("grpo", [1.0], ["g"])
    with caplog.at_level(logging.WARNING):
        compute_advantages("grpo", [1.0, 0.0, 1.0], ["g", "g", "h"])
    assert "1 of 2 groups (samples sharing 'group') has a single sample; its advantage is 0" in caplog.text


@pytest.mark.parametrize("value", [-1, 0])
def test_max_steps_not_positive_says_why_for_any_data(value):
    from treelit.cli.config import ConfigError, compose, validate_config

    for data in ("synthetic_agentic", "stream"):  # in memory and streamed alike
        cfg = compose([f"trainer.max_steps={value}", f"data={data}"])
        with pytest.raises(ConfigError) as err:
            validate_config(cfg)
        msg = str(err.value)
        assert msg.startswith(f"trainer.max_steps must be a positive number of optimizer steps, got {value}")
        assert "endless" not in msg


def test_output_dir_that_is_a_file_is_one_line_naming_option_and_path(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from treelit.cli.config import ConfigError
    from treelit.cli.preflight import check_writable

    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=rf"output_dir '{f}' is a file, not a directory"):
        check_writable(f)
    with pytest.raises(ConfigError, match=rf"output_dir '{f / 'sub'}': '{f}' is a file, not a directory"):
        check_writable(f / "sub")
    exe = str(Path(sys.executable).with_name("treelit-train"))
    r = subprocess.run([exe, f"output_dir={f}", "trainer.max_steps=1", "logger=none"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert err == [f"error: output_dir '{f}' is a file, not a directory; choose a directory with output_dir=DIR"], r.stderr
    assert f.read_text() == "x"
