"""Regression tests for defects found by reviewing the security work (issue 23).

Each test holds the minimal case that got through before its fix:

* a tracking-URI password holding ``/``, ``?`` or ``#`` (SQLAlchemy takes them unescaped)
  was written in full;
* an HTTP credential header of a publish hook (``Authorization: Bearer ...``,
  ``X-API-Key``) reached ``config.yaml``, the MLflow params and Hydra's overrides file;
* a checkpoint that leaves its embedding (and head) out skipped the size check, and the
  model was allocated at the ``vocab_size`` config.json states (a raw allocation error,
  or gigabytes taken);
* ``treelit-rollout`` loaded published models and tokenizers without
  ``trust_remote_code=False``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit.utils.redact import MASK, redact_config, redact_text


@pytest.mark.parametrize("password", ["pa/ss", "a?b", "x#y", "b64+/Zm9v==", "p@ss/word"])
def test_a_uri_password_with_path_characters_is_redacted(password):
    text = f"postgresql://alice:{password}@db:5432/mlflow"
    assert redact_text(text) == "postgresql://alice:***@db:5432/mlflow"
    assert redact_text(f"store {text} failed") == "store postgresql://alice:***@db:5432/mlflow failed"


def test_http_credential_headers_are_redacted_in_configs_and_overrides():
    cfg = {"publish": {"hooks": {"vllm": {"url": "http://h:8000", "headers": {
        "Authorization": "Bearer sk-live-1", "X-API-Key": "k-2", "Proxy-Authorization": "Basic dXNlcjpwdw==",
        "Content-Type": "application/json"}}}}}
    assert redact_config(cfg)["publish"]["hooks"]["vllm"]["headers"] == {
        "Authorization": MASK, "X-API-Key": MASK, "Proxy-Authorization": MASK, "Content-Type": "application/json"}
    # Hydra's overrides.yaml holds the overrides as typed
    for typed in ("publish.hooks.vllm.headers.Authorization=Bearer sk-live-1",
                  "publish.hooks.vllm.headers.Authorization='Bearer sk-live-1'",
                  'publish.hooks.vllm.headers.Authorization="Bearer sk-live-1"',
                  "publish.hooks.vllm.headers.X-API-Key=sk-live-1"):
        clean = redact_text(typed)
        assert "sk-live-1" not in clean and clean.endswith("=" + MASK), clean
    assert redact_text("data.micro_batch_tokens=8192 pad_token=<pad>") == "data.micro_batch_tokens=8192 pad_token=<pad>"


_UNDER_A_CAP = textwrap.dedent("""\
    import resource, sys
    cap = 3 * 2**30  # far below the 8 GB the stated vocabulary would take
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import treelit
    for d in sys.argv[1:]:
        for load in (treelit.load_hf_checkpoint, treelit.load_hf_model):
            try:
                load(d)
                print("loaded")
            except Exception as exc:
                print(type(exc).__name__, str(exc).replace("\\n", " | "))
""")


def test_a_checkpoint_without_its_embedding_is_refused_before_allocating(tmp_path):
    """``vocab_size=62500000`` with the embedding and head left out of the weights (Hugging
    Face and treelit's own format): one line naming the sizes, under an address-space cap
    far below what the model would take."""
    from safetensors.torch import load_file, save_file

    from treelit.models.hf import NATIVE_MODEL_TYPE

    model = tiny_model("qwen2_tiny", torch.float32, max_seq_len=64)
    hf = treelit.save_hf_checkpoint(model, tmp_path / "hf")
    weights = load_file(str(hf / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        weights.pop(key, None)
    save_file(weights, str(hf / "model.safetensors"))
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "vocab_size": 62_500_000}))

    native = tmp_path / "native"
    native.mkdir()
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()
               if k not in ("tok_embeddings.weight", "output.weight")}, str(native / "model.safetensors"))
    config = model.config.to_dict()
    (native / "config.json").write_text(json.dumps({"model_type": NATIVE_MODEL_TYPE,
                                                    "treelit_config": {**config, "vocab_size": 62_500_000}}))

    res = subprocess.run([sys.executable, "-c", _UNDER_A_CAP, str(hf), str(native)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    dim = model.config.embed_dim
    expected_hf = (f"CheckpointError {hf / 'config.json'} vocab_size=62500000 and hidden_size={dim} make an "
                   f"embedding of {62_500_000 * dim} values, but the weights hold ")
    assert len(lines) == 4 and all(line.startswith(expected_hf) for line in lines[:2]), res.stdout
    expected_native = (f"CheckpointError {native / 'config.json'} treelit_config.vocab_size=62500000 and "
                       f"treelit_config.embed_dim={dim} make an embedding of ")
    assert lines[2].startswith(expected_native), res.stdout
    assert lines[3].startswith("CheckpointError"), res.stdout  # transformers does not know the native format


def test_the_rollout_worker_never_runs_code_from_a_published_folder(tmp_path, monkeypatch):
    import transformers

    from treelit.cli.rollout import Sampler, read_prompts

    calls = []

    class Refuse(Exception):
        pass

    def recorder(what):
        def from_pretrained(path, *args, **kwargs):
            calls.append((what, kwargs.get("trust_remote_code", "not given")))
            raise Refuse(what)
        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recorder("model"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recorder("tokenizer"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(Refuse):
        Sampler(str(tmp_path)).load({"path": str(tmp_path), "version": 0})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(Refuse):
        read_prompts(str(prompts), tokenizer_dir=Path(tmp_path))
    assert calls == [("model", False), ("tokenizer", False)]


def test_rollout_staleness_reads_each_file_within_the_data_limits(tmp_path):
    """The staleness gate reads each rollout file for its policy versions before the tree
    builder does; it read with the default limits, so a record over the user's
    ``data.max_record_bytes`` was parsed whole (and counted as stale) instead of refused."""
    from treelit.data.limits import ReadLimits
    from treelit.data.records import DataError
    from treelit.lightning.rollouts import RolloutDirDataModule
    from treelit.lightning.staleness import record_versions

    d = tmp_path / "rollouts"
    d.mkdir()
    fresh = {"id": "a", "policy_version": 3, "branches": [{"input_ids": [1, 2, 3], "advantage": 1.0}]}
    long = {"id": "b", "policy_version": 0, "branches": [{"input_ids": [5] * 2000, "advantage": 1.0}]}
    (d / "f0.jsonl").write_text(json.dumps(fresh) + "\n" + json.dumps(long) + "\n")
    assert record_versions(d / "f0.jsonl", ReadLimits(max_record_bytes=2048)) == [3]

    dm = RolloutDirDataModule(str(d), timeout_s=1, poll_s=0.01, max_staleness=1, max_record_bytes=2048)
    dm.policy_version = lambda: 3
    dm.setup()
    with pytest.raises(DataError, match=r"f0\.jsonl:2: the record is longer than data\.max_record_bytes=2048"):
        dm.load_step(0)


def test_a_checkpoint_without_its_mlp_weights_is_refused_before_allocating(tmp_path):
    """``intermediate_size=10000000`` with every MLP weight left out (so no MLP shape can be
    compared with it): ``treelit.load_hf_checkpoint`` names the missing weights in one line
    before the model is built, under an address-space cap far below what it would take."""
    from safetensors.torch import load_file, save_file

    model = tiny_model("qwen2_tiny", torch.float32, max_seq_len=64)
    d = treelit.save_hf_checkpoint(model, tmp_path / "hf")
    save_file({k: v for k, v in load_file(str(d / "model.safetensors")).items() if ".mlp." not in k},
              str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 10_000_000}))
    script = _UNDER_A_CAP.replace("(treelit.load_hf_checkpoint, treelit.load_hf_model)", "(treelit.load_hf_checkpoint,)")
    res = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines() == [f"CheckpointError {d}: missing weights for layers.0.mlp.w1.weight, "
                                       "layers.0.mlp.w2.weight, layers.0.mlp.w3.weight, layers.1.mlp.w1.weight, "
                                       "layers.1.mlp.w2.weight, layers.1.mlp.w3.weight"], res.stdout + res.stderr[-2000:]


def test_a_weight_whose_shape_disagrees_with_the_config_is_one_line(tmp_path):
    """A shape the config does not make (here ``num_key_value_heads``, which no header check
    covers) is a :class:`CheckpointError` naming the weight, not a raw size-mismatch error."""
    from treelit.models.errors import CheckpointError

    model = tiny_model("qwen2_tiny", torch.float32, max_seq_len=64)
    d = treelit.save_hf_checkpoint(model, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    kv = cfg["num_key_value_heads"]
    other = next(h for h in range(1, cfg["num_attention_heads"] + 1)
                 if h != kv and cfg["num_attention_heads"] % h == 0)
    (d / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": other}))
    with pytest.raises(CheckpointError, match=r"config\.json: the config makes layers\.0\.attn\.k_proj\.weight of "
                                              r"shape \[\d+, \d+\], but the weights hold \[\d+, \d+\]"):
        treelit.load_hf_checkpoint(d)
