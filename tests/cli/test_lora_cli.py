"""``treelit-train ... model.lora.rank=8`` as a user runs it: the run trains only the adapters,
its checkpoint holds them and their optimizer state and nothing else, its export is a PEFT
adapter folder that ``peft.PeftModel.from_pretrained(base, DIR)`` loads to treelit's logits
(float64, 1e-10), ``export.merge=true`` adds the merged weights, a resume is bit-exact, and bad
options are one line before training."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import treelit
from app_helpers import SMALL
from float64_mode import KeepFloat64
from hf_oracle import load_hf_oracle, random_hf_checkpoint
from treelit.cli.config import compose
from treelit.cli.train import run

peft = pytest.importorskip("peft")

TINY = dict(vocab_size=512, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_hidden_layers=2, max_position_embeddings=4096)
RUN = [o for o in SMALL if not o.startswith(("model.", "callbacks.checkpoint"))] + [
    "model=hf_auto", "model.dtype=float64", "model.lora.rank=8", "model.lora.init=false", "data.max_trees=16",
    "data.micro_batch_tokens=2000", "optimizer.lr=0.01", "callbacks.checkpoint.every_n_train_steps=1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_base")
    random_hf_checkpoint(path, "qwen2", std=0.05, **TINY)
    return path


def train(tmp_path, base, name, *extra):
    out = tmp_path / name
    return run(compose([f"output_dir={out}", f"model.hf_checkpoint={base}", *RUN, *extra])), out


def treelit_model(base, ckpt):
    """treelit's model as the run left it: the base checkpoint plus the checkpoint's adapters."""
    from treelit.models.hf_adapter import make_hf_model

    model = make_hf_model(str(base), dtype="float64", lora=dict(rank=8, init=False))
    sd = torch.load(ckpt, weights_only=True)["state_dict"]
    missing = model.load_state_dict({k[len("model."):]: v for k, v in sd.items()}, strict=False)
    assert not missing.unexpected_keys
    return model


def test_lora_run_exports_an_adapter_peft_loads_to_treelits_logits(tmp_path, base):
    summary, out = train(tmp_path, base, "run", "trainer.max_steps=3", "export.merge=true")
    assert summary["global_step"] == 3 and summary["export"]["format"] == "lora"
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    keys = list(ckpt["state_dict"])
    assert keys and all(".lora_" in k for k in keys), keys[:3]
    assert len(ckpt["optimizer_states"][0]["state"]) == len(keys)  # adapters' optimizer state only
    assert sorted(p.name for p in (out / "hf_checkpoint").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    ids = torch.tensor([[3, 17, 5, 200, 41, 9, 77, 311]])
    ours = treelit_model(base, out / "checkpoints" / "last.ckpt")
    ref = load_hf_oracle(base, dtype=torch.float64, exact=True)
    loaded = peft.PeftModel.from_pretrained(ref, str(out / "hf_checkpoint"))
    merged = load_hf_oracle(out / "hf_checkpoint_merged", dtype=torch.float64, exact=True)
    with torch.no_grad(), KeepFloat64():
        expected = ours(ids)
        moved = (expected - load_hf_oracle(base, dtype=torch.float64, exact=True)(input_ids=ids).logits).abs().max()
        assert moved > 1e-6, "training must move the adapters"
        for got in (loaded(input_ids=ids).logits, merged(input_ids=ids).logits):
            assert (got - expected).abs().max().item() <= 1e-10 * expected.abs().max().item()
    # the base checkpoint is untouched by the merge
    assert load_file(str(base / "model.safetensors")).keys() == load_file(
        str(out / "hf_checkpoint_merged" / "model.safetensors")).keys()


@pytest.mark.slow
def test_lora_resume_is_bit_exact(tmp_path, base):
    train(tmp_path, base, "full", "trainer.max_steps=4", "optimizer=adamw")
    train(tmp_path, base, "cut", "trainer.max_steps=2", "optimizer=adamw")
    _, resumed = train(tmp_path, base, "resumed", "trainer.max_steps=4", "optimizer=adamw",
                       f"resume_from={tmp_path / 'cut' / 'checkpoints' / 'step-000002.ckpt'}")
    a = load_file(str(tmp_path / "full" / "hf_checkpoint" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "hf_checkpoint" / "adapter_model.safetensors"))
    c = load_file(str(tmp_path / "cut" / "hf_checkpoint" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], c[k]) for k in a), "two more steps must change the adapters"


@pytest.mark.parametrize("args,expected", [
    (["model.lora.rank=0"], "model.lora.rank must be a positive integer"),
    (["model.lora.rank=4", "model.lora.target_modules=[qproj]"], "'qproj' matches no module of this model"),
    (["model.lora.rank=4", "model.lora.dropout=0.1"], "model.lora.dropout=0.1: in tree mode"),
    (["objective=grpo", "objective.kl_coef=0.1", "objective.reference=base"],
     "objective.reference=base is the model with its LoRA adapters off, and this model has none"),
], ids=["rank", "target", "dropout", "reference-base"])
def test_bad_lora_options_are_one_line_before_training(args, expected, tmp_path, cli_main, capsys):
    status = cli_main(*args, "logger=none", "data.max_trees=4", f"output_dir={tmp_path / 'out'}")
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not (tmp_path / "out" / "checkpoints").exists()


_LOAD_OFFLINE = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
adapter, merged = sys.argv[1], sys.argv[2]
ids = torch.tensor([[3, 17, 5, 200, 41, 9, 77, 311]])
a = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float64)
b = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64)
with torch.no_grad():
    x, y = a(input_ids=ids).logits, b(input_ids=ids).logits
print(json.dumps({"diff": (x - y).abs().max().item(), "scale": y.abs().max().item(), "task": type(a).__name__}))
"""


def test_adapter_config_names_the_base_absolute_and_the_task(tmp_path, base, monkeypatch):
    """A base typed as a relative folder is written absolute; a hub id stays as given."""
    import json

    from treelit.models.hf_adapter import make_hf_model
    from treelit.models.lora import save_adapter

    monkeypatch.chdir(base.parent)
    model = make_hf_model(base.name, dtype="float32", lora=dict(rank=4))
    save_adapter(model, tmp_path / "a", base_model=base.name)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(base.resolve())
    save_adapter(model, tmp_path / "b", base_model="Qwen/Qwen2.5-0.5B")
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "Qwen/Qwen2.5-0.5B"


@pytest.mark.slow
def test_lora_export_loads_with_auto_peft_from_another_folder_offline(tmp_path, base, monkeypatch):
    """The base as a user types it (a relative path): the export's adapter_config.json names it
    absolute and says CAUSAL_LM, so AutoPeftModelForCausalLM loads the folder from any working
    directory with the hub unreachable, to the logits of treelit's merged export (float64)."""
    import json
    import os
    import subprocess
    import sys

    monkeypatch.chdir(base.parent)
    out = tmp_path / "run"
    run(compose([f"output_dir={out}", f"model.hf_checkpoint={base.name}", *RUN, "trainer.max_steps=2",
                 "export.merge=true"]))
    config = json.loads((out / "hf_checkpoint" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(base.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _LOAD_OFFLINE, str(out / "hf_checkpoint"),
                          str(out / "hf_checkpoint_merged")], cwd=str(elsewhere), env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["task"] == "PeftModelForCausalLM", got
    assert got["diff"] <= 1e-10 * got["scale"], got
