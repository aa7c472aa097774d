"""Non-finite steps (``on_nonfinite``): the update is checked before its optimizer step, on every
rank together. ``stop`` ends the run with one line naming the step, the micro-batch and its trees
(``id (file:line)``) and saves nothing of the step; ``skip_step`` drops the update (optimizer state
and scheduler untouched) and logs ``train/skipped_steps``, until ``max_skipped_steps`` drops in a
row. A float64 run whose one non-finite update is skipped equals, bit for bit, a run that never
saw that step's data.

Faults are injected at several points: in a record (a branch weight whose loss overflows to inf),
in the forward pass (NaN embeddings), in the backward pass only (a NaN gradient under a finite
loss), at the first step and at a later one, and - under FSDP2, two processes - on rank 0 and on
rank 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fault_runs import (TINY, TOKEN, assert_same_weights, inject, load_sharded, one_error_line, train, weights,
                        write_trees)


def _run(cli_main, capsys, tmp_path, name, *args):
    status = cli_main(*TINY, f"output_dir={tmp_path / name}", *args)
    out, err = capsys.readouterr()
    return status, out, err, tmp_path / name


def _nothing_of_the_step_saved(out: Path, step: int) -> None:
    assert not (out / "hf_checkpoint").exists(), "no export after a stop"
    assert not (out / "summary.json").exists()
    names = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else []
    assert not any(f"{step:06d}" in n for n in names), names
    if step > 1:  # the steps before it were saved as usual, and load
        path = out / "checkpoints" / f"step-{step - 1:06d}.ckpt"
        if path.is_dir():  # sharded (FSDP2)
            assert torch.load(path / "meta.pt", weights_only=True)["global_step"] == step - 1
            tensors = load_sharded(path)
        else:
            ckpt = torch.load(path, weights_only=True)
            assert ckpt["global_step"] == step - 1
            tensors = ckpt["state_dict"]
        assert tensors and all(bool(torch.isfinite(v).all()) for v in tensors.values() if v.is_floating_point())


@pytest.mark.parametrize("fault", ["record", "forward", "backward"])
def test_stop_names_the_step_the_micro_batch_and_its_trees(fault, tmp_path, cli_main, capsys):
    """``record``: tree t5 (line 6) has a branch weight of 1e308, its loss is inf; ``forward``: the
    embeddings of step 1's first micro-batch are NaN; ``backward``: the loss stays finite, the
    gradient flowing back from the micro-batch holding tree t5 is NaN (found by computing each
    micro-batch's gradient on its own)."""
    data = write_trees(tmp_path / "trees.jsonl", huge_weight=5 if fault == "record" else None, token_in=5)
    extra = {"record": [], "forward": inject("nan", "NonFinite", step=1, kind="loss"),
             "backward": inject("nan", "NonFinite", step=2, kind="gradient", token=TOKEN)}[fault]
    status, out, err, run = _run(cli_main, capsys, tmp_path, "run", f"data.train_path={data}", "trainer.max_steps=4",
                                 "callbacks.checkpoint.every_n_train_steps=1", *extra)
    assert status == 1
    line = one_error_line(err)
    step = 1 if fault == "forward" else 2
    assert line.startswith(f"error: step {step}: non-finite "), line
    what = {"record": "loss", "forward": "loss", "backward": "gradient norm nan"}[fault]
    assert f"non-finite {what}" in line and "the update was not applied and nothing was saved" in line, line
    if fault == "forward":
        assert f"micro-batch 1 of 2 (loss nan): trees t0 ({data}:1), t1 ({data}:2)" in line, line
    else:
        why = "loss inf" if fault == "record" else "its gradient alone is not finite"
        assert f"micro-batch 1 of 2 ({why}): trees t4 ({data}:5), t5 ({data}:6)" in line, line
        assert "micro-batch 2 of 2" not in line, line
    _nothing_of_the_step_saved(run, step)


def test_skipped_step_equals_a_run_without_that_batch(tmp_path, cli_main, capsys):
    """float64, AdamW, a warm-up schedule: the run whose data step 3 is NaN (skipped) and the run
    whose data stream lacks step 3 end with the same weights, bit for bit - the optimizer state and
    the learning-rate schedule did not move on the skipped update. One warning line names it."""
    data = write_trees(tmp_path / "trees.jsonl")
    common = [f"data.train_path={data}", "trainer.max_steps=5", "model.dtype=float64", "scheduler=cosine",
              "scheduler.warmup_steps=3", "on_nonfinite=skip_step"]
    status, _, err, skipped = _run(cli_main, capsys, tmp_path, "skipped", *common,
                                   *inject("nan", "NonFinite", step=3, kind="loss"))
    assert status == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: step 3: non-finite loss"), err
    assert "the update was dropped (on_nonfinite=skip_step: 1 in a row, 1 in all)" in lines[0]
    summary = json.loads((skipped / "summary.json").read_text())
    assert summary["global_step"] == 5 and summary["metrics"]["train/skipped_steps"] == 1.0
    status, _, err, without = _run(cli_main, capsys, tmp_path, "without", *common,
                                   *inject("drop", "DropDataStep", step=3))
    assert status == 0, err
    ckpt = torch.load(skipped / "checkpoints" / "last.ckpt", weights_only=True)
    a = ckpt["state_dict"]
    b = torch.load(without / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert next(iter(a.values())).dtype == torch.float64
    assert_same_weights(a, b)
    adam = ckpt["optimizer_states"][0]["state"]
    assert {float(s["step"]) for s in adam.values()} == {5.0}, "five optimizer steps, not six"
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 5


def test_stop_after_max_skipped_steps_in_a_row(tmp_path, cli_main, capsys):
    """... and ``train/skipped_steps`` ends at the number of dropped updates, the last one counted."""
    data = write_trees(tmp_path / "trees.jsonl")
    status, out, err, run = _run(cli_main, capsys, tmp_path, "run", f"data.train_path={data}", "trainer.max_steps=6",
                                 "on_nonfinite=skip_step", "max_skipped_steps=3",
                                 "callbacks.checkpoint.every_n_train_steps=1",
                                 "+logger.csv._target_=lightning.pytorch.loggers.CSVLogger",
                                 f"+logger.csv.save_dir={tmp_path / 'csv'}",
                                 *inject("nan", "NonFinite", step=2, kind="loss", every=True))
    assert status == 1
    lines = err.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["warning", "warning", "error"], err
    assert lines[-1].startswith("error: step 2 (data step 4): non-finite loss"), lines[-1]
    assert "3 updates in a row were dropped (max_skipped_steps=3): stopping" in lines[-1]
    assert "Traceback" not in err
    _nothing_of_the_step_saved(run, 2)
    import csv

    (metrics,) = (tmp_path / "csv").rglob("metrics.csv")
    history = [float(r["train/skipped_steps"]) for r in csv.DictReader(metrics.open()) if r.get("train/skipped_steps")]
    assert history[-1] == 3.0, history


def test_an_invalid_choice_is_one_line(tmp_path, cli_main, capsys):
    data = write_trees(tmp_path / "trees.jsonl")
    status, _, err, _ = _run(cli_main, capsys, tmp_path, "run", f"data.train_path={data}", "on_nonfinite=ignore")
    assert status == 1
    assert "on_nonfinite=ignore is not a choice: use stop or skip_step" in one_error_line(err)


# two processes (FSDP2, gloo) ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("rank,kind", [(1, "loss"), (0, "gradient")])
def test_fsdp2_ranks_agree_on_a_fault_of_one_rank(rank, kind, tmp_path):
    """A fault on one rank only (its first micro-batch of step 2): both ranks stop at step 2; the
    one line (from rank 0, the whole of stderr) names the rank and its trees; nothing is saved."""
    data = write_trees(tmp_path / "trees.jsonl")
    rc, _, err = train([*TINY, f"data.train_path={data}", f"output_dir={tmp_path / 'run'}", "trainer=fsdp2_cpu",
                        "trainer.max_steps=3", "callbacks.checkpoint.every_n_train_steps=1",
                        *inject("nan", "NonFinite", step=2, kind=kind, rank=rank)], tmp_path)
    assert rc == 1, err
    line = one_error_line(err)
    assert line.startswith("error: step 2: non-finite"), line
    assert f"micro-batch 1 of 1 on rank {rank} (" in line and "): trees t" in line, line
    if kind == "gradient":  # a gradient is the ranks' sum: each rank's first micro-batch is named
        assert "on rank 0" in line and "on rank 1" in line, line
    _nothing_of_the_step_saved(tmp_path / "run", 2)


@pytest.mark.slow
def test_fsdp2_skipped_step_equals_a_run_without_that_batch(tmp_path):
    data = write_trees(tmp_path / "trees.jsonl")
    common = [*TINY, f"data.train_path={data}", "trainer=fsdp2_cpu", "model.dtype=float64", "trainer.max_steps=4",
              "on_nonfinite=skip_step"]
    rc, _, err = train([*common, f"output_dir={tmp_path / 'skipped'}",
                        *inject("nan", "NonFinite", step=2, kind="loss", rank=1)], tmp_path)
    assert rc == 0, err
    assert err.strip().startswith("warning: step 2: non-finite loss") and len(err.strip().splitlines()) == 1, err
    rc, _, err = train([*common, f"output_dir={tmp_path / 'without'}", *inject("drop", "DropDataStep", step=2)],
                       tmp_path)
    assert rc == 0, err
    assert_same_weights(weights(tmp_path / "skipped"), weights(tmp_path / "without"))  # the export: float32
    a, b = (load_sharded(tmp_path / name / "checkpoints" / "last.ckpt") for name in ("skipped", "without"))
    assert next(iter(a.values())).dtype == torch.float64
    assert_same_weights(a, b)
