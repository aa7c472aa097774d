"""treelit.models.forward: the passes' entry points dispatch on what a model provides, not its class.

A model built by torchtune's own builders (no ``tree_hidden_states``) runs over its modules by
TreeDecoder's arithmetic; treelit's decoders and the transformers adapter run their own.
"""

from __future__ import annotations

import torch
from torchtune.models.qwen2 import qwen2
from torchtune.modules import TransformerDecoder

import treelit
from treelit.models import decoder, forward
from treelit.models.context import CausalContext


def _torchtune_qwen2(tie: bool) -> TransformerDecoder:
    torch.manual_seed(0)
    model = qwen2(vocab_size=11, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=48,
                  max_seq_len=64, tie_word_embeddings=tie)
    for p in model.parameters():  # torchtune leaves some weights at zero or one: make every one matter
        torch.nn.init.normal_(p, std=0.2)
    return model


def test_a_torchtune_builders_decoder_runs_over_its_modules():
    for tie in (True, False):
        model = _torchtune_qwen2(tie)
        assert not hasattr(model, "tree_hidden_states")
        ids = torch.randint(0, 11, (2, 9))
        h = forward.decoder_hidden(model, ids, torch.arange(9).expand(2, 9), CausalContext())
        with torch.no_grad():
            torch.testing.assert_close(h @ forward.output_weight(model).t(), model(ids), rtol=1e-4, atol=1e-4)
        assert forward.output_weight(model) is (model.output.tied_module.weight if tie else model.output.weight)
        assert forward.in_forward(model, lambda m: m is model)  # no treelit_fn forward: called directly


def test_treelit_decoders_run_their_own_layers_inside_their_forward():
    model = treelit.build_model("qwen3_tiny", vocab_size=11).double()
    ids = torch.randint(0, 11, (1, 7))
    pos = torch.arange(7)[None]
    own = model.tree_hidden_states(ids, pos, CausalContext())
    torch.testing.assert_close(forward.decoder_hidden(model, ids, pos, CausalContext()), own, rtol=0, atol=0)
    torch.testing.assert_close(decoder.layers_hidden(model, ids, pos, CausalContext()), own, rtol=0, atol=0)
    seen = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    assert forward.in_forward(model, lambda m: m is model)
    assert seen == [["treelit_fn"]]  # through the module call: hooks on the forward see the pass


def test_the_decoder_module_re_exports_the_entry_points():
    assert (decoder.decoder_hidden, decoder.in_forward, decoder.output_weight) == (
        forward.decoder_hidden, forward.in_forward, forward.output_weight)
