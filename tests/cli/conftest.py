"""Fixtures for command-line tests: a migrated MLflow database to copy (creating one from
scratch costs seconds of alembic migrations), and in-process ``treelit-train`` runs."""

from __future__ import annotations

import logging
import shutil
import sys

import pytest


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory):
    """A migrated, empty MLflow sqlite database (copy it; never write to it)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_template") / "template.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(tmp_path, migrated_db):
    """A private copy of the migrated database: (path, tracking uri)."""
    path = tmp_path / "mlflow.db"
    shutil.copy(migrated_db, path)
    return path, f"sqlite:///{path}"


@pytest.fixture
def cli_main(monkeypatch):
    """Run ``treelit-train ARGS`` in this process: returns the exit status (0 when it returns).
    Hydra's logging setup and global state are undone afterwards."""
    from hydra.core.global_hydra import GlobalHydra

    from treelit.cli import train

    root = logging.getLogger()
    level, before = root.level, list(root.handlers)

    def call(*args: str) -> int:
        monkeypatch.setattr(sys, "argv", ["treelit-train", *args])
        GlobalHydra.instance().clear()
        try:
            train.main()
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    yield call
    GlobalHydra.instance().clear()
    for h in list(root.handlers):
        if h not in before:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)
