"""The example plugin package is installed and used with no change to treelit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app_helpers import SMALL

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "plugins" / "treelit_example"


def _pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def installed():
    r = _pip("install", "-q", "--no-deps", "-e", str(PLUGIN))
    assert r.returncode == 0, r.stderr
    yield
    _pip("uninstall", "-y", "-q", "treelit-example-plugin")


def _cli(name, *args, cwd):
    exe = Path(sys.executable).with_name(name)
    return subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=cwd, env={**os.environ, "HYDRA_FULL_ERROR": "1"})


def test_plugin_components_are_listed_with_their_origin(installed, tmp_path):
    r = _cli("treelit", "list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "prompt_completions" in r.stdout and "scaled_sft" in r.stdout
    assert "plugin treelit-example-plugin (treelit_example.objectives:ScaledSFT)" in r.stdout


def test_training_with_the_plugin_builder_objective_and_config(installed, tmp_path):
    data = tmp_path / "prompts.jsonl"
    with data.open("w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"p{i}", "prompt": [1, 2, 3, 4 + i], "completions": [[5, 6], [5, 7, 8], [9]]}) + "\n")
    out = tmp_path / "run"
    r = _cli(
        "treelit-train", "objective=scaled_sft", "objective.scale=0.5", "data=jsonl", f"data.train_path={data}",
        "tree_builder=prompt_completions", "trainer.max_steps=2", f"output_dir={out}", *SMALL, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 2 and summary["data"]["trees"] == 4
    cfg = (out / "config.yaml").read_text()
    assert "name: scaled_sft" in cfg and "scale: 0.5" in cfg
