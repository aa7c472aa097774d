"""GLM-4.5V from chat records: read with its processor folder (its markers around ``<|image|>``),
one ``treelit-train`` step on the tree built from them equals transformers' GLM-4.5V (MoE, its
sigmoid router, a dense first layer) run branch by branch: the loss and every parameter
gradient, float64 <= 1e-10 (slow; the default suite holds the tokens and pixels against the
processor in ``tests/builders/test_image_markers.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import grad_floor, max_rel_grad_diff, negligible_grad
from test_hf_gemma3_records import _train, _transformers
from treelit.builders.chat import ChatBuilder
from treelit.lightning.data import build_trees
from treelit.tree.images import ProcessedImage
from vision_oracle import IMAGE, vision_checkpoint
from vision_records import glm4v_processor, glm_record, processor_dir

pytest.importorskip("transformers")
pytest.importorskip("PIL")

F64 = torch.float64


@pytest.mark.slow
def test_glm4v_chat_records_train_exactly_as_transformers_per_branch(tmp_path):
    proc = glm4v_processor()
    folder = processor_dir(tmp_path / "proc", proc)
    ckpt = vision_checkpoint(tmp_path / "ckpt", "glm4v_moe")
    record, calls = glm_record(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    (built,) = build_trees(str(data), ChatBuilder(folder, processor_path=folder))
    tree = built.tree
    branches, images, masks = [], [], []
    for b, (msgs, pics) in enumerate(calls):
        ids = tree.branch(b).tolist()
        assert ids == proc(text=proc.apply_chat_template(msgs, tokenize=False), images=pics,
                           return_tensors="pt")["input_ids"][0].tolist()
        ims = []
        for pic in pics:
            out = proc.image_processor(images=[pic], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            ims.append(ProcessedImage(out["pixel_values"].to(F64), grid, grid[0] * grid[1] * grid[2] // 4, IMAGE))
        branches.append(ids)
        images.append(ims)
        masks.append([int(m) for m in tree.loss_mask(b).tolist()])
    loss, grads = _train(tmp_path, data, "chat", folder, ckpt)
    expected_loss, theirs = _transformers(ckpt, branches, images, masks)
    mine = {n[len("hf."):]: g for n, g in grads.items()}
    assert mine.keys() == theirs.keys() and any("visual" in k for k in mine)
    assert abs(loss - expected_loss) <= 1e-10 * abs(expected_loss), (loss, expected_loss)
    assert max_rel_grad_diff(mine, theirs, grad_floor(F64), negligible_grad(F64)) <= 1e-10
