"""Fixtures for command-line tests: a migrated MLflow database to copy (creating one from
scratch costs seconds of alembic migrations). In-process ``treelit-train`` runs (``cli_main``)
come from tests/conftest.py, shared with tests/security."""

from __future__ import annotations

import shutil

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
