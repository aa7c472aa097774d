"""Fixtures for application tests: the real Hydra config, shrunk to CPU size."""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from helpers import tiny_model

from app_helpers import SMALL  # noqa: F401


@pytest.fixture
def one_tree_jsonl(tmp_path):
    path = tmp_path / "one_tree.jsonl"
    rec = {
        "id": "t0",
        "branches": [
            {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [1, 2, 3, 7, 8], "loss_mask": [0, 1, 1, 1, 1], "weight": 2.0},
            {"input_ids": [1, 2, 9, 10, 3, 4]},
        ],
    }
    path.write_text(json.dumps(rec) + "\n")
    return path


@pytest.fixture
def hf_dir(tmp_path):
    model = tiny_model("qwen2_tiny", torch.float32, max_seq_len=128)
    return treelit.save_hf_checkpoint(model, tmp_path / "ckpt")
