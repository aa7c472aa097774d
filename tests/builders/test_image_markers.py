"""Each family's image markers in chat records: GLM-4.5V's processor writes an image as
``<|begin_of_image|>`` ``<|image|>`` x n ``<|end_of_image|>``; a chat record read with its
processor folder is exactly the processor's chat template and ``__call__`` (tokens, pixels,
grids). A tokenizer with no family's image tokens, or markers other than the model's, is one
line before any record is read."""

from __future__ import annotations

import json
import types

import pytest
import torch

from treelit.builders.chat import ChatBuilder
from treelit.builders.vision import check_model_images
from treelit.lightning.data import build_trees
from vision_oracle import END, IMAGE, START
from vision_records import GEMMA3_SPECIALS, char_tokenizer, glm4v_processor, glm_record, processor_dir

pytest.importorskip("transformers")
pytest.importorskip("PIL")


def _model(**config):
    hf = types.SimpleNamespace(config=types.SimpleNamespace(**config))
    return types.SimpleNamespace(vision=types.SimpleNamespace(image_token_id=IMAGE, _hf=[hf]))


def _image_spans(ids):
    """The placeholder count of each image of ``ids``, each run of them checked to sit between
    the start and end markers."""
    spans, t = [], 0
    while t < len(ids):
        if ids[t] == IMAGE:
            n = next(k for k in range(t, len(ids) + 1) if k == len(ids) or ids[k] != IMAGE) - t
            assert ids[t - 1] == START and ids[t + n] == END
            spans.append(n)
            t += n
        t += 1
    return spans


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    proc = glm4v_processor()
    return proc, processor_dir(tmp_path_factory.mktemp("glm4v") / "proc", proc)


def test_glm4v_chat_records_are_its_processors_tokens_and_pixels(glm, tmp_path):
    """Default suite: GLM-4.5V's markers around its <|image|> placeholder, repeated t*h*w / merge^2
    times, and its image processor's patches and grids, branch by branch; the model check takes
    the markers of a GLM-4.5V config and refuses Qwen's ids for them."""
    proc, folder = glm
    record, calls = glm_record(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    builder = ChatBuilder(folder, processor_path=folder)
    assert (builder.image_markers.family, builder.image_token_id) == ("GLM-4.5V", IMAGE)
    check_model_images(builder, _model(image_start_token_id=START, image_end_token_id=END))
    (built,) = build_trees(str(data), builder)
    tree = built.tree
    assert tree.num_branches == 2
    for b, (msgs, pics) in enumerate(calls):
        enc = proc(text=proc.apply_chat_template(msgs, tokenize=False), images=pics, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        assert tree.branch(b).tolist() == ids
        assert _image_spans(ids) == [int(g.prod()) // 4 for g in enc["image_grid_thw"]]
    enc = proc(text="<|begin_of_image|><|image|><|end_of_image|>" * 2, images=calls[1][1], return_tensors="pt")
    assert tree.images.grid_thw.tolist() == enc["image_grid_thw"].tolist()
    assert torch.equal(tree.images.pixel_values, enc["pixel_values"])
    with pytest.raises(ValueError) as err:
        check_model_images(builder, _model(vision_start_token_id=151652, vision_end_token_id=151653))
    assert str(err.value) == (f"the tokenizer's GLM-4.5V image markers ({START}, {END}) differ from the model's "
                              "vision_start_token_id/vision_end_token_id (151652, 151653): the tokenizer "
                              "(tree_builder.tokenizer_path) and the model must come from the same checkpoint")


def test_a_tokenizer_with_no_familys_image_tokens_is_one_line(glm, tmp_path):
    """Gemma-3's tokens with a grid-counting (GLM) image processor: neither Qwen's nor GLM's markers;
    GLM's tokens with Gemma-3's processor (a fixed count): not Gemma-3's."""
    from vision_records import gemma3_processor

    proc, folder = glm
    with pytest.raises(ValueError) as err:
        ChatBuilder(tokenizer=proc.tokenizer, processor=gemma3_processor())
    assert str(err.value) == ("the tokenizer has no <start_of_image>, <image_soft_token>, <end_of_image> token(s); an "
                              "image processor with a fixed number of tokens per image (Gemma-3) needs Gemma-3's image "
                              "tokens in the tokenizer (tree_builder.tokenizer_path)")
    tok = char_tokenizer(GEMMA3_SPECIALS, "{{ messages[0]['content'] }}")
    with pytest.raises(ValueError) as err:
        ChatBuilder(tokenizer=tok, processor=proc.image_processor)
    assert "\n" not in str(err.value) and str(err.value).startswith(
        "the tokenizer has the image tokens of no vision family treelit reads (Qwen: <|vision_start|> <|image_pad|> "
        "<|vision_end|>; GLM-4.5V: <|begin_of_image|> <|image|> <|end_of_image|>)")


def test_the_content_parts_probe_is_bounded_by_the_render_timeout(glm):
    """Whether the template renders content parts is asked of it once, under the render time limit."""
    import copy
    import time

    proc, _ = glm
    tok = copy.copy(proc.tokenizer)
    tok.chat_template = ("{% if messages[0]['content'] is not string %}{% for i in range(100000) %}"
                         "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}") + proc.chat_template
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^the chat template of the tokenizer took longer than "
                                         r"tree_builder.render_timeout_s=0.5 s on one short message$"):
        ChatBuilder(tokenizer=tok, processor=proc.image_processor, render_timeout_s=0.5)
    assert time.monotonic() - t0 < 15
