"""Hugging Face checkpoints: round trip, and an independent check against ``transformers``.

The transformers implementation of the same checkpoint, run branch by branch with a
plain loss written here, must give treelit's tree-mode loss and gradients. transformers
computes RMSNorm and RoPE through float32 even for float64 models, so both dtypes are
compared at float32-level tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from helpers import FAMILIES, grad_floor, max_rel_grad_diff, negligible_grad, tiny_model
from hf_oracle import hf_grads, load_hf_oracle
from treelit.models.hf import CheckpointError, tune_to_hf_state_dict

transformers = pytest.importorskip("transformers")

BRANCHES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 10, 2]]
MASKS = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1], [0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 1.5]


def hf_branch_loss(hf_model, aggregation):
    """Per-branch loss straight from the definition, one branch at a time."""
    total, n_targets, n_seq = 0.0, 0, 0
    for br, m, w in zip(BRANCHES, MASKS, WEIGHTS):
        ids = torch.tensor([br])
        logits = hf_model(input_ids=ids).logits[0]
        logp = torch.log_softmax(logits.double(), -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        mask = torch.tensor(m[1:], dtype=torch.float64)
        n = mask.sum()
        n_targets += int(n)
        n_seq += int(n > 0)
        s = -(logp * mask).sum() * w
        total = total + (s / n if aggregation == "seq-mean-token-mean" and n > 0 else s)
    Z = {"token-mean": n_targets, "seq-mean-token-mean": n_seq, "seq-mean-token-sum": n_seq, "sum": 1}[aggregation]
    return total / Z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", FAMILIES)
def test_tree_mode_equals_transformers_branch_by_branch(tmp_path, name, aggregation, dtype):
    src = tiny_model(name, dtype)
    treelit.save_hf_checkpoint(src, tmp_path / "ckpt")
    ours = treelit.load_hf_checkpoint(tmp_path / "ckpt", dtype=dtype)
    # transformers as users run it (float32 norms/RoPE, eager attention); the strict float64 check is
    # tests/oracles/test_transformers_oracle.py
    hf = load_hf_oracle(tmp_path / "ckpt", dtype=dtype, exact=False, attn_implementation="eager")

    tree = treelit.TokenTree.from_branches(BRANCHES, MASKS, WEIGHTS)
    loss = treelit.tree_loss(ours, tree, aggregation)
    loss.backward()
    ref = hf_branch_loss(hf, aggregation)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)

    ours_grads = tune_to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, ours.config)
    theirs = hf_grads(hf, ours.config.tie_word_embeddings)
    assert ours_grads.keys() == theirs.keys()
    assert max_rel_grad_diff(ours_grads, theirs, grad_floor(torch.float32), negligible_grad(torch.float32)) < 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_lossless(tmp_path, name):
    src = tiny_model(name, torch.float32)
    treelit.save_hf_checkpoint(src, tmp_path)
    back = treelit.load_hf_checkpoint(tmp_path)
    for (k, a), (k2, b) in zip(src.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert back.config.rope_scaling == src.config.rope_scaling
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == src.config.model_type


def test_transformers5_rope_parameters_are_read(tmp_path):
    src = tiny_model("llama3_2_tiny", torch.float32)
    treelit.save_hf_checkpoint(src, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    scaling = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), **scaling}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = treelit.load_hf_checkpoint(tmp_path)
    assert back.config.rope_scaling["rope_type"] == "llama3"
    assert back.config.rope_base == src.config.rope_base


def test_plain_llama_gets_no_llama3_scaling(tmp_path):
    src = tiny_model("mistral_tiny", torch.float32)
    treelit.save_hf_checkpoint(src, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama"
    cfg["rope_scaling"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = treelit.load_hf_checkpoint(tmp_path)
    rope = model.layers[0].attn.pos_embeddings
    assert rope.scaling is None and rope.style == "interleaved"


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        treelit.load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="missing config.json"):
        treelit.load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'"):
        treelit.load_hf_checkpoint(tmp_path)
