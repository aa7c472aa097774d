"""``treelit-train`` started again in the folders of an earlier online-RL run. A fresh run that
finds the earlier run's policy versions (``publish.dir``) or the rollout files it consumed
(``data.directory``) stops in one line that names the folders and the two ways out, before the
model is built (before: it published version 0 below the old ones, keep-pruning deleted that
version while ``latest.json`` named it, and the trainer waited ``data.timeout_s`` for files the
sampler believed written). A run resumed from an earlier checkpoint continues the folder: the
versions published after that checkpoint are removed and ``latest.json`` names the resumed step,
then moves forward again."""

from __future__ import annotations

import json
import shutil

import pytest

from treelit.lightning.publish import read_latest

TINY = ["logger=none", "trainer.enable_progress_bar=false", "callbacks.progress=null", "model.config.num_layers=1",
        "model.config.embed_dim=32", "model.config.intermediate_dim=64", "publish.dtype=float32"]


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """Three steps publishing versions 0-3 (keep=3 leaves 1-3), a checkpoint every 2 steps."""
    from treelit.cli.config import compose
    from treelit.cli.train import run

    d = tmp_path_factory.mktemp("rl_rerun")
    run(compose([*TINY, f"output_dir={d / 'run1'}", f"publish.dir={d / 'policy'}", "publish.keep=3",
                 "trainer.max_steps=3", "callbacks.checkpoint.every_n_train_steps=2"]))
    return d


def test_a_fresh_run_in_an_earlier_runs_publish_dir_is_refused_before_the_model(first_run, tmp_path, cli_main,
                                                                               capsys):
    pub = first_run / "policy"
    before = sorted(p.name for p in pub.iterdir())
    assert before == ["latest.json", "step-1", "step-2", "step-3"]
    out = tmp_path / "run2"
    status = cli_main(*TINY, f"output_dir={out}", f"publish.dir={pub}", "trainer.max_steps=2")
    line = _one_error_line(capsys.readouterr().err)
    assert status == 1
    assert line == (f"error: publish.dir {pub} holds policy versions 1-3, latest.json naming version 3: an earlier "
                    "run's. Continue that run with resume_from=<its checkpoint> (resume_from=auto "
                    "output_dir=<its output_dir>), or start a new one in new or empty folders (publish.dir=NEW, or "
                    "empty these folders)"), line
    assert not (out / "config.yaml").exists(), "the run went on past its start-up checks"
    assert sorted(p.name for p in pub.iterdir()) == before and read_latest(pub)["version"] == 3


def test_consumed_rollouts_of_an_earlier_run_are_refused(tmp_path, cli_main, capsys):
    rollouts = tmp_path / "rl" / "rollouts"
    rollouts.mkdir(parents=True)
    for i in range(3):
        (rollouts / f"step-{i:06d}.jsonl.consumed").write_text("{}\n")
    status = cli_main("experiment=rl_online", f"rl_dir={tmp_path / 'rl'}", *TINY, f"output_dir={tmp_path / 'out'}")
    line = _one_error_line(capsys.readouterr().err)
    assert status == 1
    assert line.startswith(f"error: data.directory {rollouts} holds 3 rollout file(s) a trainer already took "
                           "(step-000000.jsonl.consumed .. step-000002.jsonl.consumed): an earlier run's. Continue "
                           "that run with resume_from="), line
    assert line.endswith("(rl_dir=NEW, or empty these folders)"), line


def test_a_resumed_run_continues_the_publish_dir_from_its_step(first_run, tmp_path, cli_main, capsys):
    """Resumed from step 2 (versions 1-3 there): version 3 goes (its step is trained again),
    ``latest.json`` names 2, then 3 and 4; every folder it names exists."""
    pub = tmp_path / "policy"
    shutil.copytree(first_run / "policy", pub)
    latest = read_latest(pub)  # it holds an absolute path: point it at the copy
    (pub / "latest.json").write_text(json.dumps({**latest, "path": str((pub / "step-3").resolve())}))
    ckpt = first_run / "run1" / "checkpoints" / "step-000002.ckpt"
    assert ckpt.is_file()
    status = cli_main(*TINY, f"output_dir={tmp_path / 'run3'}", f"publish.dir={pub}", "publish.keep=3",
                      "trainer.max_steps=4", f"resume_from={ckpt}")
    stdout, err = capsys.readouterr()
    assert status == 0, err
    assert ("publish: resumed at step 2: removed the versions published after that checkpoint (3; their steps are "
            "trained again)") in stdout, stdout
    assert sorted(p.name for p in pub.iterdir()) == ["latest.json", "step-2", "step-3", "step-4"]
    latest = read_latest(pub)
    assert latest["version"] == 4 and latest["path"] == str((pub / "step-4").resolve())
