"""Hostile image and routing inputs: each is one line naming the file, the line and the field, and
``data.on_error=skip`` skips the record and goes on (raw branches and chat records alike); the
image token of raw records comes from the checkpoint and is held against it."""

from __future__ import annotations

import base64
import json
import shutil
import warnings

import numpy as np
import pytest

from treelit.builders.assemble import Limits
from treelit.builders.base import make_tree_builder
from treelit.builders.chat import ChatBuilder
from treelit.data.records import DataError, ReadStats
from treelit.lightning.data import build_trees
from treelit.tree.routing import encode_routing
from vision_oracle import image_processor, png_bytes, random_image, vl_processor_dir

pytest.importorskip("PIL")

PAD, START, END = 151655, 151652, 151653


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A Qwen2 BPE tokenizer with Qwen's vision tokens and a tiny Qwen2-VL image processor (no config.json)."""
    return vl_processor_dir(tmp_path_factory.mktemp("vl") / "proc")


@pytest.fixture(scope="module")
def chat(vl_dir):
    return ChatBuilder(vl_dir, processor_path=vl_dir)


_png = png_bytes


def _good_png(folder, name="ok.png"):
    random_image(np.random.default_rng(0), 16, 16).save(folder / name)
    return name


def _write(folder, records, name="data.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _raw(ref, rid="r"):
    return {"id": rid, "branches": [{"input_ids": [1, START, PAD, END, 5, 6], "images": [ref]}]}


def _chat(ref, rid="r"):
    return {"id": rid, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                                 {"type": "image", "image": ref}]},
                                    {"role": "assistant", "content": "ok"}]}


def _one_line_then_skipped(builder, folder, bad_record, field, says, limits=None):
    """``bad_record`` between two good ones: ``raise`` stops at line 2 in one line naming ``field``
    and saying ``says``; ``skip`` builds the two good records and counts one skip."""
    good = _raw if not isinstance(builder, ChatBuilder) else _chat
    ref = _good_png(folder)
    path = _write(folder, [good(ref, "a"), bad_record, good(ref, "c")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing printed before the one error line
        with pytest.raises(DataError) as err:
            build_trees(str(path), builder, limits=limits)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}:2: {field}"), msg
    assert says in msg, msg
    stats = ReadStats()
    trees = build_trees(str(path), builder, on_error="skip", stats=stats, limits=limits)
    assert len(trees) == 2 and stats.skipped == 1 and says in stats.errors[0]


def _uri(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("kind", ["raw", "chat"])
@pytest.mark.parametrize("content,says", [
    (b"", "has 0 byte(s), too few to be an image"),
    (b"BM\x00", "has 3 byte(s), too few to be an image"),
    (b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09", "cannot be decoded"),  # past the length check: no format's
])
@pytest.mark.parametrize("as_uri", [False, True])
def test_short_and_empty_images_are_one_line_and_skipped(vl_dir, chat, tmp_path, kind, content, says, as_uri):
    (tmp_path / "bad.png").write_bytes(content)
    ref = _uri(content) if as_uri else "bad.png"
    if kind == "raw":
        _one_line_then_skipped(make_tree_builder("sequences", processor_path=vl_dir), tmp_path, _raw(ref),
                               "branches[0].images[0]: ", says)
    else:
        _one_line_then_skipped(chat, tmp_path, _chat(ref), "messages[0].content[1]: ", says)


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_a_nul_byte_in_an_image_path_is_one_line_and_skipped(vl_dir, chat, tmp_path, kind):
    ref = "ok.png\x00.txt"
    if kind == "raw":
        _one_line_then_skipped(make_tree_builder("sequences", processor_path=vl_dir), tmp_path, _raw(ref),
                               "branches[0].images[0]: ", "cannot contain a NUL byte")
    else:
        _one_line_then_skipped(chat, tmp_path, _chat(ref), "messages[0].content[1]: ", "cannot contain a NUL byte")


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_the_image_processors_refusal_is_one_line_and_skipped(vl_dir, chat, tmp_path, kind):
    """A 1x300 image: Qwen's processor refuses aspect ratios over 200."""
    random_image(np.random.default_rng(0), 1, 300).save(tmp_path / "thin.png")
    says = "image 'thin.png' (300x1) is refused by the image processor (ValueError: "
    if kind == "raw":
        _one_line_then_skipped(make_tree_builder("sequences", processor_path=vl_dir), tmp_path, _raw("thin.png"),
                               "branches[0].images[0]: ", says)
    else:
        _one_line_then_skipped(chat, tmp_path, _chat("thin.png"), "messages[0].content[1]: ", says)


def _png_header_only(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("side,says", [
    (10_000, "has 10000x10000 = 100000000 pixels, more than tree_builder.max_image_pixels=40000000"),  # Pillow warns
    (15_000, "refused by Pillow's decompression-bomb limit"),  # Pillow refuses (over twice its limit)
])
def test_pillows_decompression_bomb_warning_does_not_print_before_the_error(vl_dir, tmp_path, side, says):
    """Pillow warns (DecompressionBombWarning) at open for images over ~89 Mpx: the warning would
    print before the one error line; ``warnings.simplefilter("error")`` in the helper makes it fail."""
    (tmp_path / "bomb.png").write_bytes(_png_header_only(side, side))
    _one_line_then_skipped(make_tree_builder("sequences", processor_path=vl_dir), tmp_path, _raw("bomb.png"),
                           "branches[0].images[0]: ", says)


def test_a_compact_routing_shape_too_large_for_an_array_is_one_line_and_skipped(tmp_path):
    """``[2**62, 0, 2]`` holds no bytes (so the byte count agrees) but numpy cannot shape it."""
    good = {"id": "g", "branches": [{"input_ids": [1, 2], "routed_experts": encode_routing(np.array(
        [[[0, 1], [2, 3]], [[1, 2], [0, 3]]]))}]}
    bad = {"id": "b", "branches": [{"input_ids": [1, 2, 3],
                                    "routed_experts": {"dtype": "int16", "shape": [2**62, 0, 2], "b64": ""}}]}
    path = _write(tmp_path, [good, bad, dict(good, id="h")])
    limits = Limits(vocab_size=16, max_seq_len=64, needs={}, routing=(2, 4, 2))
    builder = make_tree_builder("sequences")
    with pytest.raises(DataError) as err:
        build_trees(str(path), builder, limits=limits)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}:2: branches[0].routed_experts: shape [4611686018427387904, 0, "
                                              "2] is larger than an array can be"), msg
    stats = ReadStats()
    assert len(build_trees(str(path), builder, on_error="skip", stats=stats, limits=limits)) == 2
    assert stats.skipped == 1


def test_an_image_token_without_images_is_refused_and_skipped(vl_dir, tmp_path):
    rec = {"id": "b", "branches": [{"input_ids": [1, START, PAD, END, 5]}]}
    _one_line_then_skipped(make_tree_builder("sequences", processor_path=vl_dir), tmp_path, rec,
                           "branches[0].input_ids[2]: ", "image token 151655 in a branch without 'images'")


def _with_config(vl_dir, tmp_path, image_token_id):
    d = tmp_path / "ckpt"
    shutil.copytree(vl_dir, d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "image_token_id": image_token_id}))
    return str(d)


def test_the_image_token_option_must_agree_with_the_checkpoint(vl_dir, tmp_path):
    ckpt = _with_config(vl_dir, tmp_path, PAD)
    with pytest.raises(ValueError) as err:
        make_tree_builder("sequences", processor_path=ckpt, image_token_id=PAD + 1)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"tree_builder.image_token_id={PAD + 1} differs from the checkpoint's "
                                              f"image token {PAD} ({ckpt}/config.json)"), msg
    assert make_tree_builder("sequences", processor_path=ckpt, image_token_id=PAD).image_token_id == PAD


def test_the_raw_image_token_is_the_checkpoints(vl_dir, tmp_path):
    """Qwen3.5 checkpoints use 248056: read from config.json, not a fixed 151655."""
    ckpt = _with_config(vl_dir, tmp_path, 248056)
    b = make_tree_builder("sequences", processor_path=ckpt)
    assert b.image_token_id == 248056
    _good_png(tmp_path)
    path = _write(tmp_path, [{"id": "t", "branches": [{"input_ids": [1, 248056, 5], "images": ["ok.png"]}]}])
    (built,) = build_trees(str(path), b)
    assert built.tree.images.num_images == 1 and built.tree.branch(0).tolist() == [1] + [248056] * 4 + [5]
    # without config.json: the tokenizer's <|image_pad|>
    assert make_tree_builder("sequences", processor_path=vl_dir).image_token_id == PAD


def test_a_folder_naming_no_image_token_needs_the_option(tmp_path):
    d = tmp_path / "proc"
    image_processor().save_pretrained(d)
    with pytest.raises(ValueError, match=r"neither its config.json \(image_token_id\) nor its tokenizer files name "
                                         r"the image token; set tree_builder.image_token_id$"):
        make_tree_builder("sequences", processor_path=str(d))
    assert make_tree_builder("sequences", processor_path=str(d), image_token_id=9).image_token_id == 9


def test_per_token_fields_grow_with_the_images_placeholders(vl_dir, tmp_path):
    """A raw branch with images carries old_logprobs, ref_logprobs, token_rewards and policy_versions
    (a rollout of an image prompt): each image token's entry becomes one null per placeholder, the
    others keep their tokens (before: refused, 'a branch with images cannot carry them')."""
    from treelit.data.records import Record

    ref = _good_png(tmp_path)  # 16x16: 4 placeholder tokens
    old = [None, None, None, None, -0.5, -1.25]
    br = {"input_ids": [1, START, PAD, END, 5, 6], "loss_mask": [0, 0, 0, 0, 1, 1], "images": [ref],
          "old_logprobs": old, "ref_logprobs": old, "token_rewards": [None] * 5 + [1.0],
          "policy_versions": [None] * 4 + [3, 3], "reward": 1.0, "group": "g"}
    path = _write(tmp_path, [{"id": "r", "branches": [br, dict(br, input_ids=[1, START, PAD, END, 5, 7])]}])
    builder = make_tree_builder("groups", processor_path=vl_dir, advantage="grpo")
    rec = Record(json.loads(path.read_text()), f"{path}:1", path=str(path))
    (out, _) = builder.encode(rec)
    assert out["input_ids"] == [1, START] + [PAD] * 4 + [END, 5, 6]
    assert out["loss_mask"] == [0] * 7 + [1, 1]
    assert out["old_logprobs"] == out["ref_logprobs"] == [None] * 7 + [-0.5, -1.25]
    assert out["token_rewards"] == [None] * 8 + [1.0]
    assert out["policy_versions"] == [None] * 7 + [3, 3]
    needs = {"advantage": True, "old_logprobs": True}
    (built,) = build_trees(str(path), builder, limits=Limits(PAD + 1, 64, needs=needs))
    assert built.tree.images.num_images == 1 and built.tree.num_tokens == 10  # one image, shared by both branches
    bad = dict(br, old_logprobs=[None, None, -2.0, None, -0.5, -1.25])
    plain = make_tree_builder("sequences", processor_path=vl_dir)
    _one_line_then_skipped(plain, tmp_path, {"id": "b", "branches": [bad]}, "branches[0].old_logprobs[2]: ",
                           "must be null at an image token")
