"""Pin what the tree forward relies on from torchtune.

The tree forward re-implements the layer arithmetic over torchtune's modules; these
tests make sure it computes what torchtune's own ``TransformerDecoder.forward`` computes
and that our models carry torchtune's parameter names.
"""

from __future__ import annotations

import pytest
import torch
from torchtune.models.llama3_2 import llama3_2
from torchtune.models.mistral import mistral
from torchtune.models.qwen2 import qwen2

import treelit
from helpers import FAMILIES, tiny_model
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden, output_weight


# torchtune's own builders and forward cover these (q/k-norm families run treelit's forward)
TORCHTUNE_FAMILIES = [n for n in FAMILIES if treelit.build_model(n).config.family in ("llama", "qwen2", "mistral")]


@pytest.mark.parametrize("name", TORCHTUNE_FAMILIES)
def test_forward_matches_torchtune_forward(name):
    model = tiny_model(name, torch.float32)
    ids = torch.randint(0, 11, (2, 17))
    pos = torch.arange(17).expand(2, 17)
    ours = decoder_hidden(model, ids, pos, CausalContext()) @ output_weight(model).t()
    with torch.no_grad():
        theirs = model(ids)  # torchtune's own TransformerDecoder.forward
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def _torchtune_reference(name):
    c = treelit.build_model(name, vocab_size=11, max_seq_len=64).config
    common = dict(vocab_size=c.vocab_size, num_layers=c.num_layers, num_heads=c.num_heads,
                  num_kv_heads=c.num_kv_heads, embed_dim=c.embed_dim, max_seq_len=c.max_seq_len,
                  intermediate_dim=c.intermediate_dim, norm_eps=c.norm_eps)
    if c.family == "llama":
        return llama3_2(rope_base=int(c.rope_base), scale_factor=32, tie_word_embeddings=True, **common)
    if c.family == "qwen2":
        return qwen2(rope_base=c.rope_base, tie_word_embeddings=c.tie_word_embeddings, **common)
    return mistral(rope_base=int(c.rope_base), **common)


@pytest.mark.parametrize("name", TORCHTUNE_FAMILIES)
def test_same_modules_as_torchtune_builders(name):
    ours = tiny_model(name, torch.float32)
    ref = _torchtune_reference(name)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 11, (1, 23))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in TORCHTUNE_FAMILIES])
def test_own_forward_for_models_torchtune_cannot_run(name):
    model = tiny_model(name, torch.float64)
    ids = torch.randint(0, 11, (2, 9))
    ours = decoder_hidden(model, ids, torch.arange(9).expand(2, 9), CausalContext()) @ output_weight(model).t()
    torch.testing.assert_close(model(ids), ours, rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError, match="token ids only"):
        model(ids, input_pos=torch.arange(9).expand(2, 9))


def test_single_branch_tree_equals_causal_forward():
    model = tiny_model("qwen2_tiny", torch.float64)
    ids = torch.randint(0, 11, (1, 30))
    tree = treelit.TokenTree.from_branches([ids[0].tolist()]).to_batch()
    from treelit.loss.tree import tree_hidden

    h_tree, _ = tree_hidden(model, tree, "sdpa_dense")
    h_lin = decoder_hidden(model, ids, torch.arange(30)[None], CausalContext())[0]
    torch.testing.assert_close(h_tree, h_lin, rtol=1e-12, atol=1e-12)


def test_unknown_model_name_lists_known():
    with pytest.raises(KeyError, match="unknown model 'gpt5'.*qwen2_tiny"):
        treelit.build_model("gpt5")
