"""The per-branch reference (mode=linear, verify_every) is built from the records, not read
back from the tree: a tree builder that mis-builds a tree is caught by self-verification.
And the per-branch objective code contains no tree code."""

from __future__ import annotations

import inspect
import json

import pytest

import treelit.builders.base as builders_base
from app_helpers import SMALL
from treelit.cli.config import compose
from treelit.cli.train import run
from treelit.objectives.rl import DPO, _PolicyObjective
from treelit.objectives.sft import SFT

TREE_CODE = ("TreeBatch", "TokenTree", "tree_token_logprobs", "tree_hidden", "branch_target_sums", "path_prefix_sums",
             "branch_ptr", "branch_tokens", "token_weights", "sft_tree_loss")


@pytest.mark.parametrize("fn", [SFT.linear_loss, _PolicyObjective.linear_loss, _PolicyObjective._linear_ref,
                                DPO.linear_loss, DPO._ref_seq_linear])
def test_per_branch_references_contain_no_tree_code(fn):
    src = inspect.getsource(fn)
    assert not [name for name in TREE_CODE if name in src]


def _data(tmp_path):
    path = tmp_path / "data.jsonl"
    recs = [{"id": "a", "branches": [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [1, 2, 3, 6, 7, 8]}]},
            {"id": "b", "branches": [{"input_ids": [2, 9, 10, 11]}, {"input_ids": [2, 9, 12]}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _verify(tmp_path, name):
    cfg = compose([f"output_dir={tmp_path / name}", *SMALL, "data=jsonl", f"data.train_path={_data(tmp_path)}",
                   "trainer.max_steps=1", "verify_every=1", "model.dtype=float64"])
    return run(cfg)["metrics"]


def test_verification_catches_a_tree_builder_that_drops_a_target(tmp_path, monkeypatch):
    good = _verify(tmp_path, "good")
    assert good["verify/loss_rel_diff"] < 1e-9 and good["verify/grad_rel_diff"] < 1e-9

    original = builders_base.TokenTree.from_branches

    def broken(branches, loss_masks=None, weights=None, **kw):  # loses the last target of every branch
        masks = [[1] * (len(b) - 1) + [0] for b in branches]
        return original(branches, masks, weights, **kw)

    monkeypatch.setattr(builders_base.TokenTree, "from_branches", staticmethod(broken))
    bad = _verify(tmp_path, "bad")
    assert bad["verify/loss_rel_diff"] > 1e-3, "a mis-built tree must not match the records' branches"
