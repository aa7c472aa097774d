"""Checkpoints with a sliding window: a window that can act is never silently ignored.

A Mistral checkpoint with ``sliding_window: 8`` and a Qwen2 checkpoint with
``use_sliding_window: true, sliding_window: 8, max_window_layers: 0`` (both written by
transformers) must not load into a model that attends to every ancestor. With the
window disabled they load and match transformers run branch by branch in float64.
"""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from hf_oracle import random_hf_checkpoint, tree_vs_hf
from treelit.models.hf import CheckpointError

pytest.importorskip("transformers")

TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
# A tree deeper than the window (depth 12 > 8), with one-token segments and a prefix branch.
BRANCHES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14], [1, 2, 3, 15],
            [1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1]]
MASKS = [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 11, [0, 0, 1, 1], [0, 1, 0], [0] * 12 + [1]]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 1.5]

CASES = {
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
}
OFF = {"mistral": dict(sliding_window=None), "qwen2": dict(use_sliding_window=False)}


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    cfg.pop("layer_types", None)  # re-derived by transformers from the window keys
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_window_checkpoint_refused_with_keys_named_then_exact_without_it(tmp_path, model_type):
    random_hf_checkpoint(tmp_path, model_type, **TINY, **CASES[model_type])
    with pytest.raises(CheckpointError) as err:
        treelit.load_hf_checkpoint(tmp_path)
    for key in CASES[model_type]:
        assert repr(key) in str(err.value)
    _edit_config(tmp_path, **OFF[model_type])
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss_diff, grad_diff, _ = tree_vs_hf(tmp_path, BRANCHES, MASKS, WEIGHTS, aggregation, dtype=torch.float64)
        assert loss_diff <= 1e-10 and grad_diff <= 1e-10, (aggregation, loss_diff, grad_diff)
