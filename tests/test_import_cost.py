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


def test_treelit_train_on_a_transformers_checkpoint_loads_no_torchtune(tmp_path):
    """``treelit-train model=hf_auto``: one training step of a transformers model (and its export)
    runs through transformers' modelling code; torchtune (and the torchao and datasets it loads)
    is for treelit's own decoders only."""
    pytest.importorskip("transformers")
    from hf_oracle import random_hf_checkpoint

    ckpt = tmp_path / "ckpt"
    random_hf_checkpoint(ckpt, "qwen3", std=0.1, vocab_size=16, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"branches": [{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [1, 2, 3, 7, 8]}]}) + "\n")
    out = tmp_path / "run"
    argv = ["treelit-train", "model=hf_auto", f"model.hf_checkpoint={ckpt}", "data=jsonl", f"data.train_path={data}",
            "logger=none", "callbacks.checkpoint=null", "callbacks.progress=null", "trainer.enable_progress_bar=false",
            "trainer.max_steps=1", f"output_dir={out}"]
    heavy, _ = _loaded("import contextlib, io\n"
                       f"sys.argv = {argv!r}\n"
                       "from treelit.cli.train import main\n"
                       "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
                       "    try:\n        main()\n    except SystemExit as e:\n        assert not e.code, e.code")
    assert (out / "hf_checkpoint" / "config.json").is_file(), "the run did not finish"
    assert "transformers" in heavy and "lightning" in heavy, heavy  # the check saw the training path
    assert not {"torchtune", "torchao", "datasets", "mlflow"} & set(heavy), heavy


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
