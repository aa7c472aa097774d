"""The trainer's wait for the next rollout file says, every ``HEARTBEAT_S`` seconds (30 s), what
it waits for and for how long; when the folder holds rollout files this run did not take (an
earlier run's ``.consumed`` files, whose sampler believes its work done) the heartbeat and the
timeout say so. Before, the wait was silent for all of ``data.timeout_s`` (600 s)."""

from __future__ import annotations

import pytest

from treelit.data.records import DataError
from treelit.lightning import rollouts
from treelit.lightning.rollouts import RolloutDirDataModule


def test_the_wait_prints_a_heartbeat_and_names_an_earlier_runs_files(tmp_path, monkeypatch, caplog):
    d = tmp_path / "rollouts"
    d.mkdir()
    (d / "step-000000.jsonl.consumed").write_text("{}\n")
    monkeypatch.setattr(rollouts, "HEARTBEAT_S", 0.2)
    dm = RolloutDirDataModule(str(d), timeout_s=0.9, poll_s=0.02)
    with caplog.at_level("INFO", logger="treelit.lightning.rollouts"), pytest.raises(DataError) as err:
        dm._wait_next(0)
    note = "it holds 1 file(s) this run did not take (step-000000.jsonl.consumed, ...): an earlier run's?"
    assert f"no rollout file matching '*.jsonl' for step 1 within data.timeout_s=0.9s; {note}" in str(err.value)
    beats = [r.getMessage() for r in caplog.records if "waiting for a rollout file" in r.getMessage()]
    assert 3 <= len(beats) <= 5, beats
    assert beats[0].startswith(f"step 1: waiting for a rollout file matching '*.jsonl' in {d}: 0s of "
                               "data.timeout_s=0.9s (policy version 0 published); " + note), beats[0]


def test_the_heartbeat_is_every_30_seconds_by_default():
    assert rollouts.HEARTBEAT_S == 30.0
