"""fla checkpoints: treelit writes what fla's models load, reads it back, and (Mamba2, on CPU)
computes what fla's own model computes."""

from __future__ import annotations

import json

import pytest
import torch

import treelit
from helpers import randomize_

BRANCHES = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8]]


@pytest.mark.parametrize("name", ["gdn_tiny", "mamba2_tiny", "gdn_attn_tiny"])
def test_round_trip(tmp_path, name):
    if name == "gdn_attn_tiny":
        model = treelit.build_decoder(family="qwen2", vocab_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                      embed_dim=32, intermediate_dim=64, qkv_bias=False,
                                      layer_types=["gdn", "attention", "gdn"],
                                      recurrent={"gdn": {"head_dim": 8, "num_heads": 2, "num_v_heads": 4}})
    else:
        model = treelit.build_model(name, vocab_size=32)
    randomize_(model, seed=3, std=0.2)
    treelit.save_hf_checkpoint(model, tmp_path)
    back = treelit.load_hf_checkpoint(tmp_path)
    assert back.config.layer_types == model.config.layer_types
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    tree = treelit.TokenTree.from_branches(BRANCHES)
    torch.testing.assert_close(treelit.tree_loss(back, tree), treelit.tree_loss(model, tree))


def test_hybrid_with_mamba2_has_no_hf_format_and_round_trips_in_treelit_format(tmp_path):
    from treelit.models.hf import CheckpointError

    model = treelit.build_model("hybrid_tiny", vocab_size=32)
    randomize_(model, seed=4, std=0.2)
    with pytest.raises(CheckpointError, match="mixing Mamba2 with other layers"):
        treelit.save_hf_checkpoint(model, tmp_path / "hf")
    treelit.save_hf_checkpoint(model, tmp_path / "native", native_fallback=True)
    assert json.loads((tmp_path / "native" / "config.json").read_text())["model_type"] == "treelit"
    back = treelit.load_hf_checkpoint(tmp_path / "native", max_seq_len=128)
    assert back.config.layer_types == model.config.layer_types and back.config.max_seq_len == 128
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    tree = treelit.TokenTree.from_branches(BRANCHES)
    torch.testing.assert_close(treelit.tree_loss(back, tree), treelit.tree_loss(model, tree))


def test_fla_loads_our_gated_deltanet_checkpoint(tmp_path):
    fla_models = pytest.importorskip("fla.models")
    model = treelit.build_model("gdn_tiny", vocab_size=32)
    randomize_(model, seed=4, std=0.2)
    treelit.save_hf_checkpoint(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gated_deltanet"
    theirs = fla_models.GatedDeltaNetForCausalLM.from_pretrained(tmp_path)
    sd = theirs.state_dict()
    ours = treelit.models.hf_recurrent.tune_to_hf_recurrent(model.state_dict(), model.config)
    assert set(sd) == set(ours)
    for k, v in ours.items():
        torch.testing.assert_close(sd[k], v, msg=k)


FLA_MAMBA2 = """
import sys, torch
import triton.runtime.autotuner as at
at.Autotuner._bench = lambda self, *a, config=None, **k: [1.0, 1.0, 1.0]
from fla.models import Mamba2ForCausalLM
m = Mamba2ForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    torch.save(m(input_ids=torch.tensor([[int(t) for t in sys.argv[3].split(",")]])).logits[0], sys.argv[2])
"""


def test_mamba2_matches_fla_model_on_cpu(tmp_path):
    """fla's Mamba2 model runs its pure-torch path on CPU (its norm kernel through Triton's
    interpreter, in a subprocess); with one B/C group its grouping convention coincides with
    the kernels', so the logits must agree (float32)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("fla.models")
    model = treelit.build_model("mamba2_tiny", vocab_size=32,
                                recurrent={"mamba2": {"head_dim": 16, "state_size": 8, "n_groups": 1, "expand": 2,
                                                      "conv_kernel": 4, "mlp": False}})
    randomize_(model, seed=5, std=0.2)
    treelit.save_hf_checkpoint(model, tmp_path / "ckpt")
    ids = torch.tensor([BRANCHES[0] + [9, 10, 11]])
    out = tmp_path / "logits.pt"
    r = subprocess.run(
        [sys.executable, "-c", FLA_MAMBA2, str(tmp_path / "ckpt"), str(out), ",".join(map(str, ids[0].tolist()))],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ref = torch.load(out)
    with torch.no_grad():
        from treelit.models.context import CausalContext
        from treelit.models.decoder import decoder_hidden, output_weight

        h = decoder_hidden(model, ids, torch.arange(ids.shape[1])[None], CausalContext())[0]
        got = h @ output_weight(model).t()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
