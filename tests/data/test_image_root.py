"""``tree_builder.image_root``: a folder images may be read from besides the data file's, under the
same rules - confinement (``../``, absolute paths and symbolic links that leave both folders are
refused), the byte and pixel limits - with one-line errors naming the file, line and field."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from treelit.builders.base import make_tree_builder
from treelit.builders.chat import ChatBuilder
from treelit.data.records import DataError, ReadStats
from treelit.lightning.data import build_trees
from vision_oracle import random_image, vl_processor_dir

pytest.importorskip("PIL")

PAD, START, END = 151655, 151652, 151653


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return vl_processor_dir(tmp_path_factory.mktemp("vl") / "proc")


@pytest.fixture
def layout(tmp_path):
    """``work/data/d.jsonl`` beside ``work/shots/`` (the image root), and ``work/private/``."""
    work = tmp_path / "work"
    for d in ("data", "shots", "private"):
        (work / d).mkdir(parents=True)
    rng = np.random.default_rng(0)
    random_image(rng, 16, 16).save(work / "shots" / "a.png")
    random_image(rng, 16, 24).save(work / "data" / "local.png")
    random_image(rng, 8, 8).save(work / "private" / "secret.png")
    return work


def _raw(ref, rid="r"):
    return {"id": rid, "branches": [{"input_ids": [1, START, PAD, END, 5], "images": [ref]}]}


def _chat(ref, rid="c"):
    return {"id": rid, "messages": [{"role": "user", "content": [{"type": "image", "image": ref}]},
                                    {"role": "assistant", "content": "ok"}]}


def _builder(kind, vl_dir, **options):
    if kind == "raw":
        return make_tree_builder("sequences", processor_path=vl_dir, **options)
    return ChatBuilder(vl_dir, processor_path=vl_dir, **options)


def _write(work, records):
    path = work / "data" / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("kind", ["raw", "chat"])
@pytest.mark.parametrize("ref", ["a.png", "../shots/a.png", "SHOTS/a.png", "local.png"])
def test_images_are_read_from_the_image_root_and_the_data_folder(vl_dir, layout, kind, ref):
    ref = ref.replace("SHOTS", str(layout / "shots"))  # an absolute path into the image root
    make = _raw if kind == "raw" else _chat
    path = _write(layout, [make(ref)])
    (built,) = build_trees(str(path), _builder(kind, vl_dir, image_root=str(layout / "shots")))
    assert built.tree.images.num_images == 1
    if ref != "local.png":  # without the option: the data folder only
        with pytest.raises(DataError, match="resolves outside the data file's folder|does not exist"):
            build_trees(str(path), _builder(kind, vl_dir))


@pytest.mark.parametrize("kind", ["raw", "chat"])
@pytest.mark.parametrize("ref,says", [
    ("../private/secret.png", "resolves outside the data file's folder {data} and tree_builder.image_root {shots}; "
                              "images are read from those folders only"),
    ("{work}/private/secret.png", "resolves outside the data file's folder {data} and tree_builder.image_root "
                                  "{shots}; images are read from those folders only"),
    ("link.png", "resolves outside the data file's folder {data} and tree_builder.image_root {shots}"),
    ("missing.png", "does not exist (relative to {data} or {shots})"),
    ("big.png", "has {size} bytes, more than tree_builder.max_image_bytes={limit}"),
])
def test_the_image_root_keeps_the_data_folders_rules(vl_dir, layout, kind, ref, says):
    os.symlink(layout / "private" / "secret.png", layout / "shots" / "link.png")  # a link out of the root
    random_image(np.random.default_rng(1), 40, 50).save(layout / "shots" / "big.png")
    size = (layout / "shots" / "big.png").stat().st_size
    ref = ref.format(work=layout)
    says = says.format(data=layout / "data", shots=layout / "shots", size=size, limit=size - 1)
    make = _raw if kind == "raw" else _chat
    field = "branches[0].images[0]" if kind == "raw" else "messages[0].content[0]"
    path = _write(layout, [make("a.png", "x"), make(ref), make("a.png", "y")])
    builder = _builder(kind, vl_dir, image_root=str(layout / "shots"), max_image_bytes=size - 1)
    with pytest.raises(DataError) as err:
        build_trees(str(path), builder)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}:2: {field}: image ") and says in msg, msg
    stats = ReadStats()
    assert len(build_trees(str(path), builder, on_error="skip", stats=stats)) == 2 and stats.skipped == 1


def test_the_pixel_limit_applies_in_the_image_root(vl_dir, layout):
    path = _write(layout, [_raw("a.png")])
    with pytest.raises(DataError, match=r"'a.png' has 16x16 = 256 pixels, more than tree_builder.max_image_pixels=255"):
        build_trees(str(path), _builder("raw", vl_dir, image_root=str(layout / "shots"), max_image_pixels=255))


@pytest.mark.parametrize("root", ["missing", "a.png"])
def test_the_image_root_must_be_a_folder(vl_dir, layout, root):
    with pytest.raises(ValueError, match=r"^tree_builder.image_root '.*' is not a directory$"):
        _builder("raw", vl_dir, image_root=str(layout / "shots" / root))


@pytest.mark.parametrize("builder", ["sequences", "groups", "chat"])
def test_image_root_is_an_option_of_every_builder(builder):
    from treelit.cli.config import compose

    assert compose([f"tree_builder={builder}"]).tree_builder.image_root is None
