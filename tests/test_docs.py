"""The documentation: the README is a front page, the site builds strictly, the configuration
reference is generated and complete, and every recipe's commands run as written.

Recipes are the ``bash`` blocks of docs/recipes.md preceded by ``<!-- recipe: NAME -->``; each runs
in a fresh folder with ``CKPT``, ``HYBRID_CKPT`` and ``DATA`` pointing at a tiny random Qwen3
checkpoint, a tiny random Qwen3.5 checkpoint and a small token-tree file, and must exit 0. One
recipe runs in the default suite, the others with ``-m slow``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = re.compile(r"<!-- recipe: (\w+) -->\s*```bash\n(.*?)```", re.S)
DEFAULT_RECIPE = "jsonl"  # the representative case in the default suite


def recipes():
    return dict(RECIPE.findall((REPO / "docs" / "recipes.md").read_text()))


def test_readme_is_a_front_page_that_links_every_recipe():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    headings = re.findall(r"^## (.+)$", (REPO / "docs" / "recipes.md").read_text(), re.M)
    for h in headings:  # one click from the README to each recipe
        anchor = re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-")
        assert f"recipes.md#{anchor}" in readme, f"the README does not link the recipe {h!r} (#{anchor})"


def test_every_recipe_section_has_a_command_block():
    text = (REPO / "docs" / "recipes.md").read_text()
    assert len(recipes()) >= 10
    for block in recipes().values():
        assert block.strip()
    # every *Run by the tests* claim has a recipe block in its section
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        if "*Run by the tests" in section:
            assert "<!-- recipe:" in section, section.splitlines()[0]


def test_configuration_reference_is_generated_and_every_option_described():
    from treelit.cli import config_reference

    assert config_reference.undocumented() == []
    page = (REPO / "docs" / "config-reference.md").read_text()
    assert page == config_reference.reference(), \
        "docs/config-reference.md is stale: python -m treelit.cli.config_reference --write docs/config-reference.md"


def test_docs_build_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).with_name("mkdocs"))
    res = subprocess.run([mkdocs, "build", "--strict", "-q", "-d", str(tmp_path / "site")], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "recipes" / "index.html").is_file()


@pytest.fixture(scope="module")
def recipe_inputs(tmp_path_factory):
    from hf_oracle import random_hf_checkpoint
    from models.test_hf_hybrid import HYBRID

    root = tmp_path_factory.mktemp("recipe_inputs")
    model_type, cfg = HYBRID["qwen3_5"]
    random_hf_checkpoint(root / "hybrid", model_type, **dict(cfg, vocab_size=64))
    random_hf_checkpoint(root / "qwen3", "qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         num_hidden_layers=2)
    with open(root / "trees.jsonl", "w") as f:
        for i in range(6):
            prefix = [1, 2 + i, 3, 4, 5]
            f.write(json.dumps({"id": f"t{i}", "branches": [
                {"input_ids": prefix + [6, 7 + i]}, {"input_ids": prefix + [8, 9, 10 + i]},
                {"input_ids": prefix[:3] + [11, 12], "loss_mask": [0, 0, 0, 1, 1]}]}) + "\n")
    return {"CKPT": str(root / "qwen3"), "HYBRID_CKPT": str(root / "hybrid"), "DATA": str(root / "trees.jsonl")}


def _recipe_params():
    return [pytest.param(name, marks=() if name == DEFAULT_RECIPE else pytest.mark.slow) for name in recipes()]


@pytest.mark.parametrize("name", _recipe_params())
def test_recipe_runs_as_written(name, recipe_inputs, tmp_path):
    env = dict(os.environ, **recipe_inputs, PYTHONUNBUFFERED="1", MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    block = recipes()[name]
    if name == "plugins":  # the recipe installs the example plugin: take it out again afterwards
        block = block.replace("pip install -q -e plugins/treelit_example",
                              f"pip install -q --no-deps -e {REPO / 'plugins' / 'treelit_example'}")
    try:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
    finally:
        if name == "plugins":
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "treelit-example-plugin"],
                           capture_output=True)
    assert res.returncode == 0, f"recipe {name!r} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "error:" not in res.stderr
    if name == "online_rl":  # the loop's rewards reach its MLflow run
        assert "reward/mean" in _metric_names(tmp_path / "mlflow.db")


def _metric_names(db: Path) -> set:
    import sqlite3

    with sqlite3.connect(db) as con:
        return {row[0] for row in con.execute("SELECT DISTINCT key FROM metrics")}
