"""Files a user is handed run no code and allocate nothing they do not hold: a crafted
checkpoint (a pickle that would create a marker file) is refused naming it, through the
real command line and through Lightning's own restore; a checkpoint or tokenizer that
needs its own Python code is refused; a ``config.json`` that states a model far larger
than its weights is one line naming the key, before anything is allocated."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit.models.errors import CheckpointError

TINY = ["model.config.num_layers=1", "model.config.embed_dim=32", "model.config.intermediate_dim=64",
        "data.max_trees=8", "callbacks.progress=null", "trainer.enable_progress_bar=false", "logger=none"]


class _Creates:
    """Unpickling this calls ``open(marker, "w")``: the file appears if the pickle is run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted(path: Path, marker: Path, legacy: bool = False) -> Path:
    torch.save({"global_step": 1, "state_dict": {}, "x": _Creates(marker)}, path,
               _use_new_zipfile_serialization=not legacy)
    return path


def test_a_crafted_checkpoint_is_refused_by_the_command_line_and_runs_nothing(tmp_path, cli_main, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch's default is no protection then
    marker = tmp_path / "marker"
    evil = _crafted(tmp_path / "evil.ckpt", marker)
    status = cli_main(*TINY, "trainer.max_steps=2", f"resume_from={evil}", f"output_dir={tmp_path / 'out'}")
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and str(evil) in lines[0] and "io.open" in lines[0], err
    assert not marker.exists()


def test_lightning_restores_with_weights_only_too(tmp_path, cli_main, monkeypatch, capsys):
    """With treelit's own read of the file bypassed, Lightning's restore still refuses it. torch
    defaults to ``weights_only=True`` where a caller does not say, unless this variable is set:
    with it, Lightning's load would run the pickle unless treelit passes ``weights_only=True``."""
    from treelit.cli import train

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "marker"
    evil = _crafted(tmp_path / "evil.ckpt", marker)
    monkeypatch.setattr(train, "read_resume_checkpoint", lambda p: {"path": p, "global_step": 1, "mlflow": None})
    status = cli_main(*TINY, "trainer.max_steps=2", f"resume_from={evil}", f"output_dir={tmp_path / 'out'}")
    capsys.readouterr()
    assert status != 0
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-format"])
def test_read_resume_checkpoint_refuses_code_in_a_file(tmp_path, legacy):
    from treelit.cli.train import read_resume_checkpoint

    marker = tmp_path / "marker"
    evil = _crafted(tmp_path / "evil.ckpt", marker, legacy=legacy)
    with pytest.raises(CheckpointError, match=f"resume_from: {evil} is refused: it names io.open") as info:
        read_resume_checkpoint(str(evil))
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_a_sharded_checkpoints_meta_pt_runs_nothing(tmp_path):
    from treelit.cli.train import read_resume_checkpoint

    marker = tmp_path / "marker"
    (tmp_path / "last.ckpt").mkdir()
    meta = _crafted(tmp_path / "last.ckpt" / "meta.pt", marker)
    with pytest.raises(CheckpointError, match=f"resume_from: {meta} is refused"):
        read_resume_checkpoint(str(tmp_path / "last.ckpt"))
    assert not marker.exists()


def _sharded(path: Path) -> Path:
    """A real distributed checkpoint (torch's writer, one process) with Lightning's meta.pt."""
    import torch.distributed.checkpoint as dcp

    model = tiny_model("qwen2_tiny", torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    with pytest.warns(UserWarning):  # no process group: torch says it assumes one process
        dcp.save({"state_dict": model.state_dict(), "optimizer_0": opt.state_dict()}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 7, "epoch": 0}, path / "meta.pt")
    return path


def test_a_sharded_checkpoints_metadata_is_checked_before_torch_unpickles_it(tmp_path):
    """torch's FileSystemReader reads ``.metadata`` with plain pickle: a real one passes the
    check, a crafted one is refused naming it, and nothing runs."""
    from treelit.cli.train import read_resume_checkpoint

    ckpt = _sharded(tmp_path / "last.ckpt")
    assert read_resume_checkpoint(str(ckpt))["global_step"] == 7
    marker = tmp_path / "marker"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Creates(marker), protocol=4))
    with pytest.raises(CheckpointError, match=rf"resume_from: {ckpt / '.metadata'} is refused: it names \S*open"):
        read_resume_checkpoint(str(ckpt))
    assert not marker.exists()


def test_a_sharded_checkpoints_non_tensor_items_are_checked_before_torch_unpickles_them(tmp_path):
    """torch's default load planner reads non-tensor items (optimizer settings) of the
    ``.distcp`` files with ``weights_only=False``: a crafted item is refused naming it."""
    import torch.distributed.checkpoint as dcp

    from treelit.cli.train import read_resume_checkpoint

    marker = tmp_path / "marker"
    ckpt = tmp_path / "last.ckpt"
    with pytest.warns(UserWarning):
        dcp.save({"state_dict": {"w": torch.zeros(2)}, "optimizer_0": {"lr": 0.1, "evil": _Creates(marker)}},
                 checkpoint_id=ckpt, no_dist=True)
    torch.save({"global_step": 7}, ckpt / "meta.pt")
    with pytest.raises(CheckpointError, match=r"resume_from: \S+\.distcp: item 'optimizer_0\.evil' is refused: "
                                              r"it names \S*open"):
        read_resume_checkpoint(str(ckpt))
    assert not marker.exists()


# code shipped beside a checkpoint or tokenizer (auto_map) is never run --------------------------

_CODE = """\
open({marker!r}, "w").close()
from transformers import PretrainedConfig

class EvilConfig(PretrainedConfig):
    model_type = "evil_model"
"""


def _with_code(path: Path, marker: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "evil_model", "vocab_size": 16, "auto_map": {
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "configuration_evil.EvilConfig"}}))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "EvilTokenizer", "auto_map": {
        "AutoTokenizer": ["configuration_evil.EvilConfig", None]}}))
    (path / "configuration_evil.py").write_text(_CODE.format(marker=str(marker)))
    return path


def test_a_checkpoint_with_its_own_code_is_refused_without_asking(tmp_path, monkeypatch):
    from treelit.builders.chat import load_tokenizer

    marker = tmp_path / "marker"
    d = _with_code(tmp_path / "ckpt", marker)
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # a prompt would read here
    with pytest.raises(CheckpointError, match="needs its own Python code") as info:
        treelit.load_hf_model(d)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="tokenizer directory .* needs its own Python code"):
        load_tokenizer(str(d))
    assert not marker.exists()


# config.json against the weights, before anything is allocated ----------------------------------


def _saved(tmp_path: Path, **edits) -> Path:
    model = tiny_model("qwen2_tiny", torch.float32, max_seq_len=64)
    d = treelit.save_hf_checkpoint(model, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edits)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


_UNDER_A_CAP = textwrap.dedent("""\
    import resource, sys
    cap = 3 * 2**30  # far below the 16 GB the stated vocabulary would take
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import treelit
    for load in (treelit.load_hf_checkpoint, treelit.load_hf_model):
        try:
            load(sys.argv[1])
            print("loaded")
        except Exception as exc:
            print(type(exc).__name__, str(exc).replace("\\n", " | "))
""")


def test_a_huge_vocab_size_is_one_line_without_allocating(tmp_path):
    """The issue's case: 780 KB of weights, ``vocab_size=62500000`` in config.json (16 GB of
    embeddings). Both loaders name the key, the value and the weight's shape, under an
    address-space cap far below what the model would take."""
    d = _saved(tmp_path, vocab_size=62_500_000)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        shape = list(f.get_slice("model.embed_tokens.weight").get_shape())
    res = subprocess.run([sys.executable, "-c", _UNDER_A_CAP, str(d)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    expected = f"CheckpointError {d / 'config.json'} vocab_size=62500000 but model.embed_tokens.weight has shape {shape}"
    assert res.stdout.splitlines() == [expected, expected], res.stdout + res.stderr[-2000:]


@pytest.mark.parametrize("edit, key, says", [
    ({"hidden_size": 4096}, "hidden_size=4096", "but model.embed_tokens.weight has shape"),
    ({"num_hidden_layers": 9, "layer_types": ["full_attention"] * 9}, "num_hidden_layers=9", "but model.layers holds {n} layers (model.layers.0 to "
                                                      "model.layers.{last})"),
    ({"intermediate_size": 100000}, "intermediate_size=100000", "but model.layers.0.mlp.gate_proj.weight has shape"),
], ids=["hidden", "layers", "mlp"])
def test_other_sizes_are_checked_against_the_weights(tmp_path, edit, key, says):
    d = _saved(tmp_path, **edit)
    n = tiny_model("qwen2_tiny").config.num_layers
    says = says.format(n=n, last=n - 1)
    for load in (treelit.load_hf_checkpoint, treelit.load_hf_model):
        with pytest.raises(CheckpointError) as info:
            load(d)
        assert str(info.value).startswith(f"{d / 'config.json'} {key} {says}"), str(info.value)


def test_treelits_own_format_is_checked_too(tmp_path):
    """``model_type: treelit`` (its ``treelit_config`` and treelit's parameter names)."""
    from safetensors.torch import save_file

    from treelit.models.hf import NATIVE_MODEL_TYPE

    model = tiny_model("qwen2_tiny", torch.float32, max_seq_len=64)
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    config = model.config.to_dict()
    (d / "config.json").write_text(json.dumps({"model_type": NATIVE_MODEL_TYPE, "treelit_config": config}))
    assert treelit.load_hf_checkpoint(d).config.vocab_size == config["vocab_size"]  # as saved, it loads
    shape = list(model.tok_embeddings.weight.shape)
    (d / "config.json").write_text(json.dumps({"model_type": NATIVE_MODEL_TYPE,
                                               "treelit_config": {**config, "vocab_size": 62_500_000}}))
    with pytest.raises(CheckpointError) as info:
        treelit.load_hf_checkpoint(d)
    assert str(info.value) == (f"{d / 'config.json'} treelit_config.vocab_size=62500000 but tok_embeddings.weight "
                               f"has shape {shape}")
