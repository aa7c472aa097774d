"""Records with images: chat content parts (path, data: URI, OpenAI image_url) through the checkpoint's
image processor, read relative to the data file and never outside its folder, bounded in bytes and
pixels with one-line errors naming the file and the record."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
import torch

from treelit.builders.chat import ChatBuilder
from treelit.data.records import DataError, iter_file
from vision_oracle import image_processor, png_bytes, random_image, vl_processor_dir

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A Qwen2 BPE tokenizer with Qwen's vision tokens and a tiny Qwen2-VL image processor (4-px patches)."""
    return vl_processor_dir(tmp_path_factory.mktemp("vl") / "proc")


@pytest.fixture(scope="module")
def builder(vl_dir):
    return ChatBuilder(vl_dir, processor_path=vl_dir)


_png = png_bytes


def _write(folder, records):
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _conv(*parts, answer="ok"):
    return [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": answer}]


def _trees(builder, path):
    return builder(list(iter_file(path)))


@pytest.mark.parametrize("export", ["per_call", "trajectory"])
def test_image_parts_become_the_processors_tokens_and_pixels(builder, vl_dir, tmp_path, export):
    rng = np.random.default_rng(0)
    a, b = random_image(rng, 16, 24), random_image(rng, 24, 32)
    (tmp_path / "shots").mkdir()
    a.save(tmp_path / "shots" / "a.png")
    uri = "data:image/png;base64," + base64.b64encode(_png(b)).decode()
    msgs = _conv({"type": "text", "text": "Screen: "}, {"type": "image", "image": "shots/a.png"}) + [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "done"}]
    path = _write(tmp_path, [{"id": "r", "messages": msgs}])
    (built,) = _trees(ChatBuilder(tokenizer=builder.tok, processor_path=vl_dir, export=export), path)
    tree = built.tree
    proc = image_processor()
    tok = builder.tok
    # what the processor makes of the same conversation: the text with each <|image_pad|> repeated
    # t*h*w / merge**2 times, tokenized; pixels from its image processor
    outs = [proc(images=[im], return_tensors="pt") for im in (a, b)]
    counts = [int(o["image_grid_thw"][0].prod()) // 4 for o in outs]
    text = tok.apply_chat_template([{"role": "user", "content": "Screen: <|vision_start|><|image_pad|><|vision_end|>"},
                                    {"role": "assistant", "content": "ok"},
                                    {"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>and"},
                                    {"role": "assistant", "content": "done"}], tokenize=False)
    first, second = text.split("<|image_pad|>", 2)[:2], text.split("<|image_pad|>", 2)[2]
    expanded = first[0] + "<|image_pad|>" * counts[0] + first[1] + "<|image_pad|>" * counts[1] + second
    want = tok(expanded, add_special_tokens=False)["input_ids"]
    assert tree.branches()[-1] == want
    assert tree.images.num_images == 2 and tree.images.grid_thw.tolist() == [o["image_grid_thw"][0].tolist() for o in outs]
    torch.testing.assert_close(tree.images.pixel_values, torch.cat([o["pixel_values"] for o in outs]), rtol=0, atol=0)
    mask = tree.loss_mask(tree.num_branches - 1)
    ids = np.asarray(want)
    assert not mask[ids == 151655].any() and mask.any()  # image tokens are never targets
    # the data's image counts (the start-up line, data statistics, the summary): per call, the
    # first call's branch shows a, the second a and b
    from treelit.lightning.data import _image_totals

    want_counts = ({"images": 3, "distinct_images": 2, "shared_images": 1} if export == "per_call" else
                   {"images": 2, "distinct_images": 2, "shared_images": 0})
    assert _image_totals([tree]) == want_counts


def test_raw_branches_reference_images_too(vl_dir, tmp_path):
    from treelit.builders.base import make_tree_builder

    rng = np.random.default_rng(1)
    random_image(rng, 16, 16).save(tmp_path / "x.png")
    pad, start, end = 151655, 151652, 151653
    recs = [{"id": "t", "branches": [{"input_ids": [1, start, pad, end, 5, 6], "images": ["x.png"]},
                                     {"input_ids": [1, start, pad, end, 7], "images": ["x.png"]}]}]
    path = _write(tmp_path, recs)
    b = make_tree_builder("sequences", processor_path=vl_dir)
    (built,) = b(list(iter_file(path)))
    tree = built.tree
    n = 16 // 4 * (16 // 4) // 4
    assert tree.branch(0).tolist() == [1, start] + [pad] * n + [end, 5, 6]
    assert tree.images.num_images == 1 and tree.num_tokens == 2 + n + 1 + 3


@pytest.mark.parametrize("ref,match", [
    ("../outside.png", "resolves outside the data file's folder"),
    ("/etc/passwd", "resolves outside the data file's folder"),
    ("https://example.com/a.png", "nothing is downloaded"),
    ("missing.png", "does not exist"),
    ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("notes.txt", "cannot be decoded"),
])
def test_bad_image_references_name_the_record(builder, tmp_path, ref, match):
    (tmp_path / "outside.png").write_bytes(_png(random_image(np.random.default_rng(0), 8, 8)))
    sub = tmp_path / "data"
    sub.mkdir()
    (sub / "notes.txt").write_text("not an image")
    path = _write(sub, [{"id": "r", "messages": _conv({"type": "image", "image": ref})}])
    with pytest.raises(DataError, match=match) as err:
        _trees(builder, path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:1: ") and "\n" not in msg


def test_a_symlink_out_of_the_folder_is_refused(builder, tmp_path):
    (tmp_path / "secret.png").write_bytes(_png(random_image(np.random.default_rng(0), 8, 8)))
    sub = tmp_path / "data"
    sub.mkdir()
    os.symlink(tmp_path / "secret.png", sub / "link.png")
    path = _write(sub, [{"id": "r", "messages": _conv({"type": "image", "image": "link.png"})}])
    with pytest.raises(DataError, match="link.png' resolves outside"):
        _trees(builder, path)


def test_byte_and_pixel_limits(builder, vl_dir, tmp_path):
    img = random_image(np.random.default_rng(0), 40, 50)
    img.save(tmp_path / "big.png")
    path = _write(tmp_path, [{"id": "r", "messages": _conv({"type": "image", "image": "big.png"})}])
    size = (tmp_path / "big.png").stat().st_size
    tok = builder.tok
    small = ChatBuilder(tokenizer=tok, processor_path=vl_dir, max_image_bytes=size - 1)
    with pytest.raises(DataError, match=rf"{path}:1: .*'big.png' has {size} bytes, more than "
                                        rf"tree_builder.max_image_bytes={size - 1}"):
        _trees(small, path)
    few = ChatBuilder(tokenizer=tok, processor_path=vl_dir, max_image_pixels=1999)
    with pytest.raises(DataError, match=r"'big.png' has 50x40 = 2000 pixels, more than "
                                        r"tree_builder.max_image_pixels=1999"):
        _trees(few, path)
    uri = "data:image/png;base64," + base64.b64encode(_png(img)).decode()
    path2 = _write(tmp_path, [{"id": "r", "messages": _conv({"type": "image", "image": uri})}])
    with pytest.raises(DataError, match="data: URI image larger than tree_builder.max_image_bytes"):
        _trees(ChatBuilder(tokenizer=tok, processor_path=vl_dir, max_image_bytes=100), path2)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` RGB pixels, with 16 bytes of pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def test_the_pixel_limit_is_checked_from_the_header_before_decoding(builder, tmp_path, monkeypatch):
    """A header claiming 8000x8000 pixels (64 Mpx: over the 40 Mpx default, under Pillow's own
    bomb limit) with no pixel data behind it: refused for its size - decoding it would fail
    ("cannot be decoded") and is made to fail loudly - so the header check comes first."""
    from PIL import ImageFile

    def no_decoding(self):
        raise AssertionError("pixels were decoded before the pixel limit was checked")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    (tmp_path / "huge.png").write_bytes(_png_header_only(8000, 8000))
    path = _write(tmp_path, [{"id": "r", "messages": _conv({"type": "image", "image": "huge.png"})}])
    with pytest.raises(DataError) as err:
        _trees(builder, path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:1: messages[0].content[0]: ") and msg.endswith(
        "image 'huge.png' has 8000x8000 = 64000000 pixels, more than tree_builder.max_image_pixels=40000000"), msg


def test_images_without_a_processor_are_refused(builder, tmp_path):
    path = _write(tmp_path, [{"id": "r", "messages": _conv({"type": "image", "image": "a.png"})}])
    with pytest.raises(DataError, match=r"data.jsonl:1: .*image parts; set tree_builder.processor_path"):
        _trees(ChatBuilder(tokenizer=builder.tok), path)


def test_bad_content_parts(builder, tmp_path):
    path = _write(tmp_path, [{"id": "r", "messages": _conv({"type": "audio", "audio": "a.wav"})}])
    with pytest.raises(DataError, match=r"messages\[0\].content\[0\]: a content part must be an object with type"):
        _trees(builder, path)


def test_only_common_image_formats_are_decoded(builder, tmp_path, monkeypatch):
    """An EPS file (Pillow would hand it to Ghostscript) is refused by its signature before any
    Pillow plugin opens it: one line naming the file, the record's field, the image and the format."""
    from PIL import EpsImagePlugin

    def ghostscript(*a, **k):
        raise AssertionError("the EPS plugin was reached")

    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", ghostscript)
    (tmp_path / "doc.eps").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n")
    path = _write(tmp_path, [{"id": "r", "messages": _conv({"type": "image", "image": "doc.eps"})}])
    with pytest.raises(DataError) as err:
        _trees(builder, path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:1: ") and "\n" not in msg and "messages[0].content[0]" in msg \
        and msg.endswith("image 'doc.eps' is EPS; only PNG, JPEG, WEBP, GIF, BMP images are read"), msg


def test_the_processed_image_cache_is_bounded_in_bytes_least_recently_used_first(tmp_path):
    """Processed images are kept up to ``cache_bytes`` of pixel values: the least recently used
    one is dropped first, a cached one is not processed again, and the bound is never exceeded."""
    from treelit.data.images import ImageReader

    proc = image_processor()
    calls = []

    def counting(*a, **k):
        calls.append(1)
        return proc(*a, **k)

    counting.merge_size = proc.merge_size
    rng = np.random.default_rng(0)
    uris = {k: "data:image/png;base64," + base64.b64encode(_png(random_image(rng, 16, 16))).decode() for k in "abc"}
    one = proc(images=[random_image(rng, 16, 16)], return_tensors="pt")["pixel_values"]
    size = one.numel() * one.element_size()
    reader = ImageReader(counting, cache_bytes=int(2.5 * size))
    held = []
    for k in "abac":  # a, b, a again (cached: now the most recent), c: b is dropped
        reader.read(uris[k], None, "f:1: messages[0].content[0]", 7)
        held.append(reader._cached)
        assert reader._cached <= reader.cache_bytes
    assert len(calls) == 3 and held == [size, 2 * size, 2 * size, 2 * size]
    reader.read(uris["a"], None, "w", 7)
    reader.read(uris["c"], None, "w", 7)
    assert len(calls) == 3  # a and c kept
    reader.read(uris["b"], None, "w", 7)
    assert len(calls) == 4 and reader._cached == 2 * size  # b processed again, a (least recent) dropped
    reader.read(uris["c"], None, "w", 7)
    assert len(calls) == 4
