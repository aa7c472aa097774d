"""Gemma-3 from records: a chat record with an image part and a raw record with an image, read
with Gemma-3's processor folder (``Gemma3Processor`` over a tiny tokenizer and
``Gemma3ImageProcessor``, built offline), become exactly the token sequence and pixel values of
the processor's own chat template and ``__call__`` on each branch; one ``treelit-train`` step on
the tree built from them (``model.vision=true``, ``attention=sdpa_dense``) equals transformers'
Gemma-3 run branch by branch: the loss and every parameter gradient, float64 <= 1e-10."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import vision_records
from float64_mode import KeepFloat64
from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from vision_oracle import IMAGE, load_reference, random_image, vision_checkpoint, vlm_branch_loss
from vision_records import gemma3_processor, processor_dir

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

F64 = torch.float64
TOKENS = 4  # mm_tokens_per_image of the tiny checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_records")
    proc = gemma3_processor(TOKENS)
    return proc, processor_dir(root / "proc", proc), vision_checkpoint(root / "ckpt", "gemma3")


def _images(folder):
    rng = np.random.default_rng(0)
    pics = {"a.png": random_image(rng, 20, 16), "b.png": random_image(rng, 16, 24)}
    for name, pic in pics.items():
        pic.save(folder / name)
    return pics


def _chat(pics):
    """One conversation with two calls (two branches, the second growing off the first)."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image", "image": "a.png"},
                                         {"type": "text", "text": " what?"}]},
            {"role": "assistant", "content": "red."},
            {"role": "user", "content": [{"type": "image", "image": "b.png"}, {"type": "text", "text": "and this?"}]},
            {"role": "assistant", "content": "blue. "}]
    record = {"id": "c", "messages": msgs}
    for_processor = [dict(m, content=[{"type": "image"} if p["type"] == "image" else p for p in m["content"]])
                     if isinstance(m["content"], list) else m for m in msgs]
    calls = [(for_processor[:2], [pics["a.png"]]), (for_processor, [pics["a.png"], pics["b.png"]])]
    return record, calls


def _expected(proc, calls):
    """Per branch: the processor's ids (its chat template, then ``__call__``) and pixel values."""
    out = []
    for msgs, pics in calls:
        text = proc.apply_chat_template(msgs, tokenize=False)
        enc = proc(text=text, images=pics, return_tensors="pt")
        out.append((enc["input_ids"][0].tolist(), enc["pixel_values"]))
    return out


def _raw(proc, pics):
    """A raw record: two branches sharing an image, each image one image token between Gemma-3's
    markers (as its processor writes them); expected from the processor's ``__call__``."""
    tok = proc.tokenizer
    texts = ["<bos>see:<start_of_image>it is red.", "<bos>see:<start_of_image>no."]
    one = f"\n\n<start_of_image>{tok.image_token}<end_of_image>\n\n"
    branches = [{"input_ids": tok(t.replace("<start_of_image>", one), add_special_tokens=False)["input_ids"],
                 "images": ["a.png"]} for t in texts]
    record = {"id": "r", "branches": branches}
    expected = []
    for t in texts:
        enc = proc(text=t, images=[pics["a.png"]], return_tensors="pt", add_special_tokens=False)
        expected.append((enc["input_ids"][0].tolist(), enc["pixel_values"]))
    return record, expected


def _branch_images(tree, b):
    """The pixel blocks branch ``b`` of a built tree shows, in order (one per image: grid (1, 1, 1))."""
    toks = tree.branch_tokens[tree.branch_ptr[b]: tree.branch_ptr[b + 1]]
    rows = torch.as_tensor(tree.image_row[toks])
    rows = rows[rows >= 0]
    offsets = tree.images.row_offsets
    which = tree.images.image_of_rows(rows)
    starts = which[rows == offsets[which]].tolist()  # an image's first token: one per showing
    assert tree.images.grid_thw[starts].tolist() == [[1, 1, 1]] * len(starts)
    assert tree.images.num_tokens[starts].tolist() == [TOKENS] * len(starts)
    return [tree.images.pixel_values[i: i + 1] for i in starts]


def _train(tmp_path, data, builder, proc_dir, ckpt, *extra):
    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run

    vision_records.CAPTURED.clear()
    overrides = [f"output_dir={tmp_path / 'run'}", *[o for o in SMALL if not o.startswith("model.")], "model=hf_auto",
                 f"model.hf_checkpoint={ckpt}", "model.dtype=float64", "model.vision=true", "attention=sdpa_dense",
                 "data=jsonl", f"data.train_path={data}", "data.shuffle=false", "data.micro_batch_tokens=100000",
                 f"tree_builder={builder}", f"tree_builder.processor_path={proc_dir}", "optimizer=sgd",
                 "grad_clip=null", "trainer.max_steps=1", "callbacks.hf_export=null",
                 "+callbacks.capture._target_=vision_records.CaptureStep"]
    if builder == "chat":
        overrides.append(f"tree_builder.tokenizer_path={proc_dir}")
    overrides += list(extra)
    with KeepFloat64():
        summary = run(compose(overrides))
    assert summary["global_step"] == 1
    return vision_records.CAPTURED["loss"], vision_records.CAPTURED["grads"]


def _transformers(ckpt, branches, images, masks):
    with KeepFloat64():  # loaded in the mode, as treelit-train's model is (Gemma-3's embedding scale a float64 buffer)
        ref = load_reference(ckpt)
        loss = vlm_branch_loss(ref, branches, images, masks, [1.0] * len(branches))
        loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return loss.item(), grads


@pytest.mark.parametrize("builder", ["chat", pytest.param("sequences", marks=pytest.mark.slow)])
def test_gemma3_records_train_exactly_as_transformers_per_branch(builder, folders, tmp_path):
    """Default suite (chat): the record's branches are the processor's tokens and pixels, and the
    treelit-train step on them is transformers' Gemma-3 per branch (loss and every gradient)."""
    from treelit.builders.base import make_tree_builder
    from treelit.builders.chat import ChatBuilder
    from treelit.lightning.data import build_trees
    from treelit.tree.images import ProcessedImage

    proc, proc_dir, ckpt = folders
    pics = _images(tmp_path)
    if builder == "chat":
        record, calls = _chat(pics)
        expected = _expected(proc, calls)
        reader = ChatBuilder(proc_dir, processor_path=proc_dir)
    else:
        record, expected = _raw(proc, pics)
        reader = make_tree_builder("sequences", processor_path=proc_dir)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    (built,) = build_trees(str(data), reader)
    tree = built.tree
    assert tree.num_branches == len(expected)
    branches, images, masks = [], [], []
    for b, (ids, pixels) in enumerate(expected):
        assert tree.branch(b).tolist() == ids, b
        shown = _branch_images(tree, b)
        assert torch.equal(torch.cat(shown), pixels) and ids.count(IMAGE) == TOKENS * len(shown)
        branches.append(ids)
        images.append([ProcessedImage(pv.to(F64), (1, 1, 1), TOKENS, IMAGE) for pv in shown])
        masks.append([int(m) for m in tree.loss_mask(b).tolist()])
        assert sum(masks[-1]) > 0 and not any(m for t, m in zip(ids, masks[-1]) if t == IMAGE)
    loss, grads = _train(tmp_path, data, builder, proc_dir, ckpt)
    expected_loss, theirs = _transformers(ckpt, branches, images, masks)
    mine = {n[len("hf."):]: g for n, g in grads.items()}
    assert mine.keys() == theirs.keys() and any("vision_tower" in k for k in mine)
    assert abs(loss - expected_loss) <= 1e-10 * abs(expected_loss), (loss, expected_loss)
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10


@pytest.mark.slow
def test_bad_gemma3_records_and_folders_are_one_line(folders, tmp_path):
    """Records: one line naming the file, the line and the field. Folders: one line naming what
    is missing or not read (pan-and-scan crops; no tokens-per-image count)."""
    from treelit.builders.base import make_tree_builder
    from treelit.builders.chat import ChatBuilder
    from treelit.data.records import DataError
    from treelit.lightning.data import build_trees

    proc, proc_dir, _ = folders
    _images(tmp_path)
    one = [2, 37, IMAGE, 38]
    cases = [
        ("sequences", {"id": "r", "branches": [{"input_ids": one + [IMAGE, 38], "images": ["a.png"]}]},
         "branches[0].input_ids: 2 image token(s) 35 for 1 image(s)"),
        ("sequences", {"id": "r", "branches": [{"input_ids": [2, 37, IMAGE, IMAGE, 38], "images": ["a.png", "b.png"]}]},
         "branches[0].input_ids[3]: images 0 and 1 have no token between them"),
        ("chat", {"id": "c", "messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]},
                                          {"role": "assistant", "content": "ok."}]},
         "messages[0].content[0]: image 'gone.png' does not exist"),
    ]
    for kind, record, says in cases:
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(json.dumps({"id": "fine", "branches": [{"input_ids": [2, 6, 7]}]} if kind == "sequences" else
                                   {"id": "fine", "messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "ok."}]})
                        + "\n" + json.dumps(record) + "\n")
        builder = (ChatBuilder(proc_dir, processor_path=proc_dir) if kind == "chat"
                   else make_tree_builder(kind, processor_path=proc_dir))
        with pytest.raises(DataError) as err:
            build_trees(str(path), builder)
        assert "\n" not in str(err.value) and str(err.value).startswith(f"{path}:2: {says}"), str(err.value)
    panned = gemma3_processor(TOKENS)
    panned.image_processor.do_pan_and_scan = True
    no_count = tmp_path / "no_count"
    proc.image_processor.save_pretrained(no_count)  # preprocessor_config.json only: no image_seq_length
    for folder, says in ((processor_dir(tmp_path / "panned", panned), "do_pan_and_scan=true is not read"),
                         (str(no_count), "or a fixed number of tokens per image (Gemma-3: image_seq_length")):
        with pytest.raises(ValueError) as err:
            make_tree_builder("sequences", processor_path=folder)
        assert "\n" not in str(err.value) and says in str(err.value), str(err.value)


@pytest.mark.slow
def test_a_whole_gemma3_conversation_is_the_processors_tokens(folders, tmp_path):
    """export=trajectory: the whole conversation, one branch, is the processor's chat template and
    ``__call__`` with both images."""
    from treelit.builders.chat import ChatBuilder
    from treelit.lightning.data import build_trees

    proc, proc_dir, _ = folders
    record, calls = _chat(_images(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    (built,) = build_trees(str(data), ChatBuilder(proc_dir, processor_path=proc_dir, export="trajectory"))
    ((ids, pixels),) = _expected(proc, calls[-1:])
    assert built.tree.num_branches == 1 and built.tree.branch(0).tolist() == ids
    assert torch.equal(torch.cat(_branch_images(built.tree, 0)), pixels)
