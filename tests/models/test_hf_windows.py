"""Sliding windows, checked against transformers run branch by branch.

Checkpoints written by transformers with a window shorter than the tree depth (Mistral
``sliding_window: 8``; Qwen2 ``use_sliding_window: true, sliding_window: 8,
max_window_layers: 0``; Qwen3 with the window on some layers only) train in tree mode
exactly as transformers trains each branch: float64 with transformers' float32 upcasts
rebound, every attention backend, partitioned and not. With the window switched off the
same checkpoints still match (the window is read, not assumed).
"""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from hf_oracle import random_hf_checkpoint, tree_vs_hf

pytest.importorskip("transformers")

TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
# A tree deeper than the window (depth 13 > 8), with one-token segments and a prefix branch.
BRANCHES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14], [1, 2, 3, 15],
            [1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1]]
MASKS = [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 11, [0, 0, 1, 1], [0, 1, 0], [0] * 12 + [1]]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 1.5]

CASES = {
    "mistral": ("mistral", dict(sliding_window=8), dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
              dict(use_sliding_window=False)),
    "qwen3_upper_layer": ("qwen3", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
                          dict(use_sliding_window=False)),
    "qwen3_moe": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=2, moe_intermediate_size=16,
                                    num_experts=4, num_experts_per_tok=2), dict(use_sliding_window=False)),
}


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    cfg.pop("layer_types", None)  # re-derived by transformers from the window keys
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", sorted(CASES))
def test_window_checkpoint_trains_like_transformers(tmp_path, case):
    model_type, on, off = CASES[case]
    random_hf_checkpoint(tmp_path, model_type, **TINY, **on)
    cfg = treelit.load_hf_checkpoint(tmp_path).config
    assert cfg.sliding_window == on["sliding_window"]
    for attention in ("sdpa_dense", "segment"):
        for aggregation in ("token-mean", "seq-mean-token-mean"):
            loss_diff, grad_diff, _ = tree_vs_hf(tmp_path, BRANCHES, MASKS, WEIGHTS, aggregation, attention)
            assert loss_diff <= 1e-10 and grad_diff <= 1e-10, (attention, aggregation, loss_diff, grad_diff)
    for budget in (13, 14):  # partitioned (16 tree tokens): external ancestor keys carry their depths into the window
        loss_diff, grad_diff, _ = tree_vs_hf(tmp_path, BRANCHES, MASKS, WEIGHTS, "token-mean", "segment",
                                             partition_budget=budget)
        assert loss_diff <= 1e-10 and grad_diff <= 1e-10, (budget, loss_diff, grad_diff)
    _edit_config(tmp_path, **off)
    assert treelit.load_hf_checkpoint(tmp_path).config.window(1) is None
    loss_diff, grad_diff, _ = tree_vs_hf(tmp_path, BRANCHES, MASKS, WEIGHTS, "token-mean", "segment")
    assert loss_diff <= 1e-10 and grad_diff <= 1e-10


def test_window_round_trips_through_a_saved_checkpoint(tmp_path):
    model = treelit.build_model("qwen3_tiny", sliding_window=4, sliding_window_layers=[1], vocab_size=16)
    treelit.save_hf_checkpoint(model, tmp_path)
    back = treelit.load_hf_checkpoint(tmp_path)
    assert [back.config.window(i) for i in range(2)] == [None, 4]
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_cfg.layer_types == ["full_attention", "sliding_attention"] and hf_cfg.sliding_window == 4
