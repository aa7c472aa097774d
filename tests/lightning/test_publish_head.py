"""A published policy reloads to exactly the trained weights, its output layer included: a
vision checkpoint whose text config says tied while transformers holds a separate head
(Qwen3-VL-MoE's defaults), a version that lacks a separate head is refused, and treelit's own
loader ties (or not) a checkpoint's head as transformers does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import treelit
from helpers import tiny_model
from hf_oracle import hf_from_pretrained
from treelit.lightning.publish import PolicyPublisher, PublishError, read_latest
from treelit.lightning.publish_check import separate_head_key
from vision_oracle import vision_checkpoint


@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory):
    """Qwen3-VL-MoE as configured by default: the text config says tied, the top-level config
    (which transformers ties by) untied, and the checkpoint holds a separate lm_head."""
    path = vision_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt", "qwen3_vl_moe")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["text_config"]["tie_word_embeddings"] is True
    assert "lm_head.weight" in load_file(str(path / "model.safetensors"))
    return path


def _trained(path):
    from treelit.models.hf_adapter import load_hf_model

    model = load_hf_model(path, dtype=torch.float64, vision=True)
    with torch.no_grad():  # "trained": the head and the embedding moved apart from the checkpoint
        model.output.weight.add_(0.5)
        model.tok_embeddings.weight.sub_(0.25)
    return model


def test_a_separate_head_is_published_and_the_sampler_reloads_the_trained_weights(vl_moe, tmp_path):
    from treelit.cli.rollout_images import load_vision_model

    model = _trained(vl_moe)
    assert model.output.weight is not model.tok_embeddings.weight  # transformers' load: untied
    pub = PolicyPublisher(tmp_path / "pub", dtype="float64")
    pub.prepare()
    path = pub.publish(model, 0).path
    assert "lm_head.weight" in load_file(str(path / "model.safetensors"))
    sampler = load_vision_model(path, torch.float64)  # treelit-rollout's loader of a vision version
    trained, loaded = dict(model.hf.named_parameters()), dict(sampler.named_parameters())
    assert set(trained) == set(loaded)
    for name, p in trained.items():
        assert torch.equal(p, loaded[name]), name
    assert not model.config.tie_word_embeddings and separate_head_key(model) == "hf.lm_head.weight"


def test_a_version_without_the_separate_head_is_refused_in_one_line(vl_moe, tmp_path):
    model = _trained(vl_moe)
    model.config.tie_word_embeddings = True  # what the text config said: the writer leaves the head out
    pub = PolicyPublisher(tmp_path / "pub", dtype="float64")
    pub.prepare()
    line = r"^publish: version 0 \(.*step-0\) holds .* trained parameter hf\.lm_head\.weight \(the output layer"
    with pytest.raises(PublishError, match=line) as e:
        pub.publish(model, 0)
    assert "\n" not in str(e.value)
    assert read_latest(tmp_path / "pub") is None and not list((tmp_path / "pub").iterdir())  # nothing left


def test_a_tied_head_is_written_once_and_passes_the_check(tmp_path):
    model = tiny_model("qwen3_tiny", torch.float32)  # tied: the head is the embedding
    assert separate_head_key(model) is None
    path = PolicyPublisher(tmp_path / "pub", dtype="float32").publish(model, 0).path
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    untied = tiny_model("qwen2_tiny", torch.float32)
    assert separate_head_key(untied) == "output.weight"
    path = PolicyPublisher(tmp_path / "pub2", dtype="float32").publish(untied, 0).path
    back = treelit.load_hf_checkpoint(path, dtype=torch.float32)
    assert torch.equal(back.output.weight, untied.output.weight)


@pytest.mark.parametrize("distinct", [True, False])
def test_native_loader_ties_a_checkpoint_head_as_transformers_does(distinct, tmp_path):
    model = tiny_model("qwen3_tiny", torch.float32)
    path = treelit.save_hf_checkpoint(model, tmp_path / "ckpt")
    sd = load_file(str(path / "model.safetensors"))
    emb = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = emb + 0.5 if distinct else emb.clone()  # the config still says tied
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    ours = treelit.load_hf_checkpoint(path, dtype=torch.float32)
    hf = hf_from_pretrained(path, dtype=torch.float32)
    assert ours.config.tie_word_embeddings is (not distinct)
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) is (not distinct)
    assert torch.equal(ours.output.weight if distinct else ours.tok_embeddings.weight, hf.lm_head.weight)
    tokens = torch.randint(0, model.vocab_size, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
    # model=hf_auto is transformers' load: its tie flag (which publishing reads) follows the load
    from treelit.models.hf_adapter import load_hf_model

    auto = load_hf_model(path, dtype=torch.float32)
    assert auto.config.tie_word_embeddings is (not distinct)
    assert torch.equal(auto.output.weight, hf.lm_head.weight)
