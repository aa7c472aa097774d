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
