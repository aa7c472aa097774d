"""A fast start: ``import treelit`` loads nothing heavy, and each command pays only for what it uses.

Each check runs in a fresh interpreter (this test process has imported everything already)
and lists which heavy packages the command left in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import treelit

HEAVY = ("torch", "torchtune", "torchao", "datasets", "transformers", "lightning", "mlflow", "hydra")


def _loaded(code: str):
    """Run ``code`` in a fresh interpreter; the heavy packages it imported and its CPU seconds."""
    probe = (
        "import json, resource, sys\n"
        f"{code}\n"
        "r = resource.getrusage(resource.RUSAGE_SELF)\n"
        f"print(json.dumps([sorted(m for m in {HEAVY!r} if m in sys.modules), r.ru_utime + r.ru_stime]))\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    heavy, cpu = json.loads(res.stdout.strip().splitlines()[-1])
    return heavy, cpu


def test_import_treelit_loads_nothing_heavy():
    heavy, cpu = _loaded("import treelit")
    assert heavy == [], f"import treelit imported {heavy}"
    assert cpu < 1.5, f"import treelit took {cpu:.2f} s of CPU time"


def test_treelit_list_loads_no_model_library_lightning_or_mlflow():
    heavy, _ = _loaded("import contextlib, io\nfrom treelit.cli.main import main\n"
                       "with contextlib.redirect_stdout(io.StringIO()):\n    assert main(['list']) == 0")
    assert set(heavy) <= {"torch", "hydra"}, heavy  # components are torch modules; the options are Hydra's


def test_treelit_stats_loads_no_model_library_lightning_mlflow_or_hydra():
    heavy, _ = _loaded("import contextlib, io\nfrom treelit.cli.main import main\n"
                       "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
                       "    assert main(['stats', 'synthetic_rollouts.jsonl.gz']) == 0")
    assert set(heavy) <= {"torch"}, heavy


def test_treelit_train_help_loads_only_hydra():
    heavy, _ = _loaded("import contextlib, io, sys\nsys.argv = ['treelit-train', '--help']\n"
                       "from treelit.cli.train import main\n"
                       "with contextlib.redirect_stdout(io.StringIO()):\n"
                       "    try:\n        main()\n    except SystemExit as e:\n        assert not e.code, e.code")
    assert heavy == ["hydra"], heavy


def test_the_check_sees_a_heavy_import():
    heavy, _ = _loaded("import treelit\ntreelit.TokenTree.from_branches([[1, 2]]).to_batch()")
    assert "torch" in heavy


@pytest.mark.parametrize("name", treelit.__all__)
def test_every_public_name_resolves(name):
    assert getattr(treelit, name) is not None
    assert name in dir(treelit)


def test_subpackages_are_attributes_and_unknown_names_fail():
    assert treelit.models.build_model is treelit.build_model
    assert treelit.tree.TreeInputError is treelit.TreeInputError
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        treelit.nope  # noqa: B018
