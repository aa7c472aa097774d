"""Checkpoint files: sharded checkpoints in and out, clear errors for missing or corrupt
weights, ordinary file permissions."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import treelit
from hf_oracle import random_hf_checkpoint
from treelit.models.hf import CheckpointError
from hf_oracle import hf_from_pretrained  # noqa: E402

TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_sharded_save_and_load(tmp_path, name):
    model = treelit.build_model(name, vocab_size=16)
    treelit.save_hf_checkpoint(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    _same(model, treelit.load_hf_checkpoint(tmp_path))
    treelit.save_hf_checkpoint(model, tmp_path)  # re-saved unsharded: the stale shards are gone
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    _same(model, treelit.load_hf_checkpoint(tmp_path))
    transformers = pytest.importorskip("transformers")
    treelit.save_hf_checkpoint(model, tmp_path, max_shard_bytes=20_000)
    hf = hf_from_pretrained(tmp_path)  # transformers reads our shards
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())


def test_transformers_sharded_checkpoint_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    random_hf_checkpoint(tmp_path / "one", "qwen3", **TINY)
    hf = hf_from_pretrained(tmp_path / "one", dtype=torch.float64)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _same(treelit.load_hf_checkpoint(tmp_path / "one", dtype=torch.float64),
          treelit.load_hf_checkpoint(tmp_path / "sharded", dtype=torch.float64))


def test_missing_shard_and_corrupt_file_are_named(tmp_path):
    model = treelit.build_model("qwen3_tiny", vocab_size=16)
    treelit.save_hf_checkpoint(model, tmp_path, max_shard_bytes=20_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        treelit.load_hf_checkpoint(tmp_path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard files {shard.name} are missing"):
        treelit.load_hf_checkpoint(tmp_path)


def test_weights_get_ordinary_permissions(tmp_path):
    treelit.save_hf_checkpoint(treelit.build_model("qwen3_tiny", vocab_size=16), tmp_path)
    mode = stat.S_IMODE(os.stat(tmp_path / "model.safetensors").st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
