"""Image records held against the model before training: a text-only model is named as the cause
(not its vocabulary), the data's image token must be the model's, chat records without the chat
builder are told so, and the missing-processor error names the message that holds the image."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from treelit.builders.base import make_tree_builder
from treelit.builders.chat import ChatBuilder
from treelit.builders.vision import check_model_images
from treelit.data.records import DataError
from treelit.lightning.data import build_trees
from vision_oracle import random_image, vl_processor_dir

pytest.importorskip("PIL")

PAD, START, END = 151655, 151652, 151653
TEXT_ONLY = types.SimpleNamespace(vision=None)


def _vision_model(token):
    return types.SimpleNamespace(vision=types.SimpleNamespace(image_token_id=token))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return vl_processor_dir(tmp_path_factory.mktemp("vl") / "proc")


def _write(folder, records):
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _conv_with_image_in_message_3(ref="a.png"):
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "this:"}, {"type": "image", "image": ref}]},
            {"role": "assistant", "content": "seen"}]


def test_a_processor_with_a_text_only_model_is_one_option_line(vl_dir):
    for b in (make_tree_builder("sequences", processor_path=vl_dir), ChatBuilder(vl_dir, processor_path=vl_dir)):
        with pytest.raises(ValueError) as err:
            check_model_images(b, TEXT_ONLY)
        assert str(err.value) == ("tree_builder.processor_path is set, but the model has no vision tower: records "
                                  "with images need model.vision=true and a vision-language checkpoint "
                                  "(model.hf_checkpoint=DIR)")


def test_image_records_on_a_text_only_model_name_the_record_and_the_missing_tower(vl_dir, tmp_path):
    """Without a processor either, the first error is the model's missing vision tower (not the
    vocabulary, not the processor), naming the field that holds the image."""
    chat = ChatBuilder(vl_dir)
    check_model_images(chat, TEXT_ONLY)
    path = _write(tmp_path, [{"id": "c", "messages": _conv_with_image_in_message_3()}])
    with pytest.raises(DataError) as err:
        build_trees(str(path), chat)
    assert str(err.value) == (f"{path}:1: messages[3].content[1]: the model has no vision tower: records with images "
                              "need model.vision=true and a vision-language checkpoint (model.hf_checkpoint=DIR)")
    raw = make_tree_builder("sequences")
    check_model_images(raw, TEXT_ONLY)
    path = _write(tmp_path, [{"id": "r", "branches": [{"input_ids": [1, START, PAD, END, 5], "images": ["a.png"]}]}])
    with pytest.raises(DataError, match=rf"^{path}:1: branches\[0\].images: the model has no vision tower"):
        build_trees(str(path), raw)


def test_the_missing_processor_error_names_the_message_holding_the_image(vl_dir, tmp_path):
    path = _write(tmp_path, [{"id": "c", "messages": _conv_with_image_in_message_3()}])
    with pytest.raises(DataError) as err:
        build_trees(str(path), ChatBuilder(vl_dir))
    assert str(err.value).startswith(f"{path}:1: messages[3].content[1]: the conversation has image parts; set "
                                     "tree_builder.processor_path"), str(err.value)


@pytest.mark.parametrize("kind", ["sequences", "chat"])
def test_an_image_token_other_than_the_models_is_refused(vl_dir, kind):
    b = make_tree_builder("sequences", processor_path=vl_dir) if kind == "sequences" else \
        ChatBuilder(vl_dir, processor_path=vl_dir)
    with pytest.raises(ValueError) as err:
        check_model_images(b, _vision_model(248056))
    msg = str(err.value)
    assert msg.startswith(f"the data's image token {PAD} (") and msg.endswith(
        "differs from the model's image_token_id 248056: the processor and the model must come from the same "
        "checkpoint"), msg
    check_model_images(b, _vision_model(PAD))  # the same token: fine
    assert b.image_token_id == PAD


def test_with_a_vision_model_a_raw_image_token_without_images_is_refused_even_without_a_processor(tmp_path):
    b = make_tree_builder("sequences")
    path = _write(tmp_path, [{"id": "r", "branches": [{"input_ids": [1, 7, 3]}]}])
    assert len(build_trees(str(path), b)) == 1  # no image token known: 7 is text
    check_model_images(b, _vision_model(7))
    with pytest.raises(DataError, match=rf"^{path}:1: branches\[0\].input_ids\[1\]: image token 7 in a branch "
                                        "without 'images'"):
        build_trees(str(path), b)


@pytest.mark.parametrize("record,field", [
    ({"id": "c", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages"),
    ({"id": "c", "branches": [{"messages": [{"role": "user", "content": "hi"}]}]}, "branches[0].messages"),
])
def test_chat_records_without_the_chat_builder_suggest_it(tmp_path, record, field):
    path = _write(tmp_path, [record])
    with pytest.raises(DataError) as err:
        build_trees(str(path), make_tree_builder("sequences"))
    assert str(err.value) == (f"{path}:1: {field}: a chat record (messages, no input_ids): render it with "
                              "tree_builder=chat (the token builders read input_ids)")


def test_the_trained_image_record_is_unchanged_by_the_model_check(vl_dir, tmp_path):
    random_image(np.random.default_rng(0), 16, 16).save(tmp_path / "x.png")
    b = make_tree_builder("sequences", processor_path=vl_dir)
    check_model_images(b, _vision_model(PAD))
    path = _write(tmp_path, [{"id": "t", "branches": [{"input_ids": [1, START, PAD, END, 5], "images": ["x.png"]}]}])
    (built,) = build_trees(str(path), b)
    assert built.tree.images.num_images == 1 and built.tree.branch(0).tolist() == [1, START] + [PAD] * 4 + [END, 5]


def test_treelit_train_names_the_missing_vision_tower_before_reading_the_data(vl_dir, tmp_path, cli_main, capsys):
    """Image records, the vision processor, and the default (text-only) model: one error line about
    the model's missing vision tower, before any record is built (no vocabulary error, no model preset)."""
    random_image(np.random.default_rng(0), 16, 16).save(tmp_path / "a.png")
    path = _write(tmp_path, [{"id": "c", "messages": _conv_with_image_in_message_3()}])
    status = cli_main("data=jsonl", f"data.train_path={path}", "tree_builder=chat", f"tree_builder.tokenizer_path={vl_dir}",
                      f"tree_builder.processor_path={vl_dir}", "logger=none", "callbacks.hf_export=null",
                      "callbacks.checkpoint=null", f"output_dir={tmp_path / 'out'}")
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.startswith("error: ")]
    assert status != 0 and lines == ["error: tree_builder.processor_path is set, but the model has no vision tower: "
                                     "records with images need model.vision=true and a vision-language checkpoint "
                                     "(model.hf_checkpoint=DIR)"], captured.out[-2000:] + captured.err[-2000:]
    assert "vocabulary" not in captured.out + captured.err


@pytest.mark.parametrize("builder", ["sequences", "groups"])
def test_image_token_id_is_an_option_of_the_token_builders(vl_dir, builder):
    """``tree_builder.image_token_id=N`` as written (no ``+``): in the schema, passed to the builder."""
    from hydra.utils import instantiate

    from treelit.cli.config import compose

    cfg = compose([f"tree_builder={builder}", "tree_builder.image_token_id=9"])
    assert cfg.tree_builder.image_token_id == 9 and instantiate(cfg.tree_builder).image_token_id == 9
    assert compose([f"tree_builder={builder}"]).tree_builder.image_token_id is None
