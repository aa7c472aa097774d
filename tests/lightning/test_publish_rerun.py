"""Publishing into a folder an earlier run used, and a stop in the middle of a publish:
``latest.json`` only moves forward and never names a folder that is not there. Before, a new
run's version 0 went below the old versions 1-3, ``latest.json`` named ``step-0`` and
``publish.keep=3`` deleted it at once (the newest three by number were the old run's)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_model
from treelit.lightning.publish import LATEST, PolicyPublisher, PublishError, read_latest


def _model(value: float):
    model = tiny_model("qwen2_tiny", torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _named_folder_exists(directory) -> bool:
    latest = read_latest(directory)
    return latest is not None and (directory / f"step-{latest['version']}").is_dir()


@pytest.fixture
def model():
    return _model(0.5)


def test_a_version_below_latest_is_refused_and_nothing_is_deleted(tmp_path, model):
    """The earlier run's versions 0-3 (keep=3: 1-3 left); a new run's version 0 is refused."""
    pub = tmp_path / "policy"
    old = PolicyPublisher(pub, dtype="float32", keep=3)
    for v in range(4):
        old.publish(model, v)
    with pytest.raises(PublishError, match=r"version 0 is below version 3, which .*latest.json names: versions only "
                                           r"go forward"):
        PolicyPublisher(pub, dtype="float32", keep=3).publish(model, 0)
    assert old.versions() == [1, 2, 3] and read_latest(pub)["version"] == 3 and _named_folder_exists(pub)


def test_keep_never_deletes_the_version_latest_names(tmp_path, model):
    """``latest.json`` naming a version that is not among the newest (a pointer left by the old
    code): pruning keeps it, and leaves the versions above it alone."""
    pub = tmp_path / "policy"
    p = PolicyPublisher(pub, dtype="float32", keep=5)
    for v in range(4):
        p.publish(model, v)
    latest = read_latest(pub)
    (pub / LATEST).write_text(json.dumps({**latest, "version": 1, "path": str((pub / "step-1").resolve())}))
    PolicyPublisher(pub, dtype="float32", keep=1)._prune()
    assert (pub / "step-1").is_dir() and _named_folder_exists(pub)
    assert [v for v in PolicyPublisher(pub).versions()] == [1, 2, 3]  # 0 pruned; 2 and 3 not this publisher's


def test_a_stop_between_the_version_folder_and_the_pointer(tmp_path, model, monkeypatch):
    """Killed (here: an exception) after ``step-3`` was renamed into place and before
    ``latest.json`` was replaced: the pointer still names version 2, whose folder is there; the
    run resumed from step 2 removes the orphan, a retry of version 3 replaces it."""
    pub = tmp_path / "policy"
    p = PolicyPublisher(pub, dtype="float32", keep=2)
    for v in range(3):
        p.publish(model, v)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed between the folder and the pointer")

    with monkeypatch.context() as m:
        m.setattr(PolicyPublisher, "_point_latest", killed)
        with pytest.raises(KeyboardInterrupt):
            p.publish(model, 3)
    assert (pub / "step-3").is_dir() and read_latest(pub)["version"] == 2 and _named_folder_exists(pub)
    assert p.versions() == [1, 2, 3]

    retry = PolicyPublisher(pub, dtype="float32", keep=2)
    retry.prepare()
    retry.publish(_model(0.25), 3)
    assert read_latest(pub)["version"] == 3 and retry.versions() == [2, 3] and _named_folder_exists(pub)


def test_a_resumed_run_rewinds_to_its_step_and_drops_the_versions_after_it(tmp_path, model, caplog):
    pub = tmp_path / "policy"
    p = PolicyPublisher(pub, dtype="float32", keep=3)
    for v in range(5):
        p.publish(model, v)
    with pytest.raises(PublishError, match="versions above 2 are kept while latest.json names version 4"):
        p.drop_newer(2)  # never before latest.json names the step resumed
    with caplog.at_level("INFO", logger="treelit.lightning.publish"):
        p.publish(_model(0.25), 2, rewind=True)
    assert read_latest(pub)["version"] == 2 and p.versions() == [2] and _named_folder_exists(pub)
    assert any("removed the versions published after that checkpoint (3, 4" in r.getMessage() for r in caplog.records)
    for v in (3, 4):
        p.publish(model, v)
    assert p.versions() == [2, 3, 4] and read_latest(pub)["version"] == 4
