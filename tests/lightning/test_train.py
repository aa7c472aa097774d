"""treelit-train end to end, composed from the real config (shrunk to CPU size)."""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from treelit.cli.config import ConfigError, compose
from treelit.cli.train import run
from app_helpers import SMALL


def train(tmp_path, *overrides, name="run"):
    cfg = compose([f"output_dir={tmp_path / name}", *SMALL, *overrides])
    return run(cfg), tmp_path / name


def state(path):
    return treelit.load_hf_checkpoint(path).state_dict()


def test_default_config_composes_and_names_every_group():
    cfg = compose()
    for group in ("model", "data", "tree_builder", "attention", "partition", "objective", "optimizer",
                  "trainer", "logger", "callbacks"):
        assert group in cfg, group
    assert cfg.trainer.max_steps > 0 and cfg.mode == "tree"


def test_one_sgd_step_equals_linear_mode(tmp_path, hf_dir, one_tree_jsonl):
    """The acceptance command, in tree and in linear mode; and against a hand-made step."""
    common = [f"model.hf_checkpoint={hf_dir}", "data=jsonl", f"data.train_path={one_tree_jsonl}",
              "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=1"]
    _, out_tree = train(tmp_path, *common, name="tree")
    _, out_lin = train(tmp_path, *common, "mode=linear", name="linear")
    a, b = state(out_tree / "hf_checkpoint"), state(out_lin / "hf_checkpoint")
    before = state(hf_dir)
    moved = max((a[k] - before[k]).abs().max().item() for k in a)
    assert moved > 1e-4, "the step must change the weights"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)

    # the same step by hand: per-branch loss, clip to norm 1, w -= lr * g
    model = treelit.load_hf_checkpoint(hf_dir)
    rec = json.loads(one_tree_jsonl.read_text())
    br = rec["branches"]
    loss = treelit.linear_loss(model, [x["input_ids"] for x in br], [x.get("loss_mask") for x in br],
                               [x.get("weight", 1.0) for x in br])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    ref = model.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], ref[k], rtol=1e-4, atol=1e-6, msg=k)


def test_resume_gives_the_uninterrupted_weights(tmp_path):
    common = ["trainer.max_steps=6", "data.max_trees=24", "data.micro_batch_tokens=900",
              "data.micro_batches_per_step=2", "callbacks.checkpoint.every_n_train_steps=1",
              "callbacks.checkpoint.save_top_k=-1"]
    base = [c for c in SMALL if not c.startswith("callbacks.checkpoint")]

    def go(name, *extra):
        cfg = compose([f"output_dir={tmp_path / name}", *base, *common, *extra])
        run(cfg)
        return tmp_path / name

    full = go("full")
    cut = go("cut", "trainer.max_steps=3")
    ckpt = sorted((cut / "checkpoints").glob("step-000003.ckpt"))
    assert ckpt, list((cut / "checkpoints").iterdir())
    resumed = go("resumed", f"resume_from={ckpt[0]}")
    a, b = state(full / "hf_checkpoint"), state(resumed / "hf_checkpoint")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    c = state(cut / "hf_checkpoint")
    assert any(not torch.equal(a[k], c[k]) for k in a), "3 more steps must change the weights"


def test_hybrid_model_trains_with_chunked_and_step_scans_alike(tmp_path):
    """model=hybrid_tiny through the app: ssm.chunk_size=1 (reference scan) and the default
    chunked scan take the same steps."""
    base = [o for o in SMALL if not o.startswith("model.")] + ["trainer.max_steps=2", "model=hybrid_tiny"]

    def hybrid(name, *extra):
        return run(compose([f"output_dir={tmp_path / name}", *base, *extra]))

    a, b = hybrid("steps", "ssm.chunk_size=1"), hybrid("chunked")
    assert b["global_step"] == 2
    assert abs(a["metrics"]["loss"] - b["metrics"]["loss"]) <= 1e-4 * abs(a["metrics"]["loss"])
    # no Hugging Face format mixes Mamba2 with other layers: the export falls back to treelit's,
    # and says so (in the log and in the summary), instead of claiming a Hugging Face checkpoint
    back = treelit.load_hf_checkpoint(tmp_path / "chunked" / "hf_checkpoint")
    assert back.config.layer_types == ["gdn", "attention", "mamba2", "gdn"]
    assert b["export"]["format"] == "treelit"
    from treelit.cli.summary import format_summary

    assert "(treelit's own format, not Hugging Face)" in format_summary(b)


def test_default_run_learns(tmp_path):
    summary, out = train(tmp_path, "trainer.max_steps=40", "optimizer.lr=0.01")
    assert summary["global_step"] == 40
    assert (out / "hf_checkpoint" / "config.json").is_file()
    assert summary["metrics"]["loss"] < 5.5  # from ln(512) = 6.24 at init


def test_verification_logs_small_differences(tmp_path, one_tree_jsonl, hf_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="treelit.lightning.module"):
        summary, _ = train(tmp_path, f"model.hf_checkpoint={hf_dir}", "data=jsonl",
                           f"data.train_path={one_tree_jsonl}", "trainer.max_steps=2", "verify_every=1")
    m = summary["metrics"]
    assert m["verify/loss_rel_diff"] < 1e-5 and m["verify/grad_rel_diff"] < 1e-4
    assert any("self-verification" in r.getMessage() for r in caplog.records)


def test_mlflow_run_has_params_metrics_and_artifacts(tmp_path, one_tree_jsonl, hf_dir):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose([f"output_dir={tmp_path / 'run'}", *[s for s in SMALL if s != "logger=none"],
                   f"logger.mlflow.tracking_uri={uri}", f"model.hf_checkpoint={hf_dir}", "data=jsonl",
                   f"data.train_path={one_tree_jsonl}", "trainer.max_steps=2", "trainer.log_every_n_steps=1"])
    run(cfg)
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("treelit")
    (r,) = client.search_runs([exp.experiment_id])
    for key in ("loss", "lr", "grad_norm", "tree_tokens", "flat_tokens", "por", "tree_tok/s", "flat_tok/s", "peak_mem_bytes",
                "tree/shared_tokens_lost"):
        assert key in r.data.metrics, key
    assert r.data.metrics["tree/shared_tokens_lost"] == 0.0  # nothing split
    assert r.data.params["optimizer.lr"] == str(cfg.optimizer.lr)
    arts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"config.yaml", "hf_checkpoint", "summary.json"} <= arts


# bad input ---------------------------------------------------------------------------------


def test_malformed_jsonl_line_is_reported_with_file_and_line(tmp_path, one_tree_jsonl, hf_dir):
    bad = tmp_path / "bad.jsonl"
    good = one_tree_jsonl.read_text()
    bad.write_text(good + "{not json\n" + good.replace('"input_ids": [1, 2, 9, 10, 3, 4]', '"input_ids": []'))
    args = [f"model.hf_checkpoint={hf_dir}", "data=jsonl", f"data.train_path={bad}", "trainer.max_steps=1"]
    from treelit.data.records import DataError

    with pytest.raises(DataError, match=rf"{bad}:2: invalid JSON"):
        train(tmp_path, *args)
    summary, _ = train(tmp_path, *args, "data.on_error=skip", name="skip")
    assert summary["data"]["records_skipped"] == 2


def test_incompatible_and_unknown_options_fail_before_training(tmp_path, hf_dir):
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="attention=flex needs a CUDA device.*attention=segment"):
            train(tmp_path, "attention=flex")
    with pytest.raises(ConfigError, match="ssm.chunk_size must be a positive number of tokens.*got 0"):
        train(tmp_path, "ssm.chunk_size=0")
    with pytest.raises(ConfigError, match="model.hf_checkpoint: directory '/nonexistent' does not exist"):
        train(tmp_path, "model.hf_checkpoint=/nonexistent")
    with pytest.raises(KeyError, match="unknown tree_builder 'nope'; known tree_builder names: chat"):
        train(tmp_path, "tree_builder.name=nope")
    with pytest.raises(KeyError, match="unknown objective 'nope'.*sft"):
        train(tmp_path, "objective.name=nope")
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="attention"):
        compose(["attention=nope"])


def test_tokens_outside_the_model_vocabulary_fail_before_training(tmp_path, hf_dir):
    path = tmp_path / "big_ids.jsonl"
    path.write_text(json.dumps({"id": "x", "branches": [{"input_ids": [1, 2, 500]}]}) + "\n")
    from treelit.data.records import DataError

    with pytest.raises(DataError, match=r"big_ids.jsonl:1: branches\[0\].input_ids\[2\]: token id 500 .*vocabulary \(size 11\)"):
        train(tmp_path, f"model.hf_checkpoint={hf_dir}", "data=jsonl", f"data.train_path={path}")


def test_ten_percent_malformed_lines_under_skip_train_on_exactly_the_rest(tmp_path):
    """A 50-line stream with 5 malformed lines of different kinds (bad JSON, a missing field,
    no branches, a mask of the wrong length, a negative token id) under data.on_error=skip
    trains exactly as the 45 good lines alone: same trees, same steps, same weights."""
    import numpy as np

    rng = np.random.default_rng(0)
    good = []
    for i in range(45):
        prefix = rng.integers(0, 512, size=int(rng.integers(3, 12))).tolist()
        good.append(json.dumps({"id": f"r{i}", "branches": [
            {"input_ids": prefix + rng.integers(0, 512, size=int(rng.integers(1, 9))).tolist()} for _ in range(3)]}))
    bad = ['{"id": "b0", "branches": [{"input_ids": [1, 2, 3]}',
           json.dumps({"id": "b1", "branches": [{"tokens": [1, 2, 3]}]}),
           json.dumps({"id": "b2", "branches": []}),
           json.dumps({"id": "b3", "branches": [{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}]}),
           json.dumps({"id": "b4", "branches": [{"input_ids": [1, -2, 3]}]})]
    lines = list(good)
    for k, b in enumerate(bad):
        lines.insert(4 + 10 * k, b)
    assert len(lines) == 50
    mixed, clean = tmp_path / "mixed.jsonl", tmp_path / "clean.jsonl"
    mixed.write_text("\n".join(lines) + "\n")
    clean.write_text("\n".join(good) + "\n")
    common = ["data=jsonl", "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=3", "data.micro_batch_tokens=200"]
    s_mixed, out_mixed = train(tmp_path, *common, f"data.train_path={mixed}", "data.on_error=skip", name="mixed")
    s_clean, out_clean = train(tmp_path, *common, f"data.train_path={clean}", name="clean")
    assert s_mixed["data"]["records_skipped"] == 5 and s_clean["data"]["records_skipped"] == 0
    assert {k: v for k, v in s_mixed["data"].items() if k != "records_skipped"} == \
        {k: v for k, v in s_clean["data"].items() if k != "records_skipped"}
    assert s_mixed["data"]["trees"] == 45 and s_mixed["global_step"] == 3
    a, b = state(out_mixed / "hf_checkpoint"), state(out_clean / "hf_checkpoint")
    assert s_mixed["metrics"]["grad_norm"] > 0, "the steps must train something"
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(Exception, match=rf"{mixed}:5"):  # and without skip, the first bad line stops it
        train(tmp_path, *common, f"data.train_path={mixed}", name="raise")
