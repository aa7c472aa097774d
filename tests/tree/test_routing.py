"""Recorded MoE routing (``routed_experts``): the compact encoding, the merge onto the trie and
the data errors (one line naming the file, the record, the field; a disagreement names the
branch pair, the token position and the MoE layer)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import treelit
from treelit.builders.assemble import Limits
from treelit.builders.sequences import SequencesBuilder
from treelit.data.records import DataError
from treelit.lightning.data import build_trees
from treelit.tree.routing import decode_routing, encode_routing
from treelit.tree.token_tree import TreeInputError


def routing_for(tokens, layers=2, k=2, experts=4, seed=0):
    """Routing that is a function of the prefix (as a deterministic sampler's would be)."""
    out = []
    for t in range(len(tokens)):
        rng = np.random.default_rng([seed, *tokens[: t + 1]])
        out.append([sorted(rng.choice(experts, k, replace=False).tolist()) for _ in range(layers)])
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("dtype", [None, "int16", "int32", "uint8"])
def test_compact_encoding_round_trips(dtype):
    arr = routing_for([1, 2, 3, 4, 5], layers=3, k=2, experts=200)
    enc = encode_routing(arr, dtype)
    assert enc["dtype"] == (dtype or "uint8") and enc["shape"] == [5, 3, 2]
    assert json.loads(json.dumps(enc)) == enc
    assert np.array_equal(decode_routing(enc), arr)
    assert np.array_equal(decode_routing(arr.tolist()), arr)  # nested lists too
    assert np.array_equal(decode_routing(arr[..., ::-1].tolist()), arr)  # order within a token: none


@pytest.mark.parametrize("value, match", [
    ({"dtype": "float32", "shape": [1, 1, 1], "b64": "AAAAAA=="}, "dtype must be one of"),
    ({"dtype": "int16", "shape": [2, 1, 1], "b64": "AAA="}, "holds 2 bytes"),
    ({"dtype": "int16", "shape": [1, 1], "b64": "AAA="}, "shape must be"),
    ({"dtype": "int16", "shape": [1, 1, 1], "b64": "!!"}, "not valid base64"),
    ({"dtype": "int16", "shape": [1, 1, 1], "b64": "AAA=", "x": 1}, "unknown key 'x'"),
    ({"dtype": "int16", "shape": [2**32, 2**32, 4], "b64": ""}, r"holds 0 bytes, shape \[4294967296, 4294967296, 4\] "
                                                              r"of int16 needs 147573952589676412928"),
    ([[1, 2]], "2 levels"),
    ([[[1, 1]]], "appears twice"),
    ([[[-1, 2]]], "negative expert id"),
    ([[[1.5, 2]]], "must be integers"),
])
def test_malformed_routing_is_one_line(value, match):
    with pytest.raises(TreeInputError, match=match) as info:
        decode_routing(value, "f.jsonl:3: branches[0].routed_experts")
    assert "\n" not in str(info.value) and str(info.value).startswith("f.jsonl:3: branches[0].routed_experts: ")


def test_the_trie_carries_one_routing_per_token():
    branches = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]]
    rec = [routing_for(b) for b in branches]
    rec[1] = rec[1][:-1]  # the final sampled token was never run through the sampler's model
    tree = treelit.TokenTree.from_branches(branches, routed_experts=rec)
    for b, br in enumerate(branches):
        idx = tree.branch_tokens[tree.branch_ptr[b] : tree.branch_ptr[b + 1]]
        n = len(rec[b])
        assert np.array_equal(tree.token_routing[idx[:n]], rec[b])
    last = tree.branch_tokens[tree.branch_ptr[2] - 1]  # branch 1's final token: recorded by no branch
    assert (tree.token_routing[last] == -1).all()
    batch = tree.to_batch()
    assert batch.token_routing.shape == (tree.num_tokens, 2, 2)
    part = batch.subset(batch.position_ids.new_tensor([0, 1, 2]))
    assert np.array_equal(part.token_routing.numpy(), tree.token_routing[:3])
    packed = treelit.TreeBatch.pack([batch, batch])
    assert packed.token_routing.shape[0] == 2 * tree.num_tokens


def test_disagreement_on_a_shared_token_names_the_pair_the_position_and_the_layer():
    branches = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6]]
    rec = [routing_for(b) for b in branches]
    rec[2] = rec[2].copy()
    rec[2][2, 1] = [0, 3] if rec[2][2, 1].tolist() != [0, 3] else [1, 2]  # token 3 at position 2, MoE layer 1
    with pytest.raises(TreeInputError, match=r"branches 0 and 2 share the token at position 2 but disagree on its "
                                             r"routed experts at MoE layer 1") as info:
        treelit.TokenTree.from_branches(branches, routed_experts=rec)
    assert info.value.branches == (0, 2)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rec(rid, branches, routing):
    return {"id": rid, "branches": [{"input_ids": b, "routed_experts": encode_routing(r)}
                                    for b, r in zip(branches, routing)]}


REPLAY = Limits(vocab_size=16, max_seq_len=64, needs={}, routing=(2, 4, 2))


def test_a_record_whose_branches_disagree_is_named_by_file_line_field_position_and_layer(tmp_path):
    b = [[1, 2, 3], [1, 2, 4]]
    r = [routing_for(x) for x in b]
    r[1] = r[1].copy()
    r[1][1, 0] = [0, 1] if r[1][1, 0].tolist() != [0, 1] else [2, 3]
    path = _write(tmp_path / "d.jsonl", [_rec("ok", [[5, 6]], [routing_for([5, 6])]), _rec("bad", b, r)])
    with pytest.raises(DataError) as info:
        build_trees(str(path), SequencesBuilder(), limits=REPLAY)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:2: branches[1].routed_experts[1][0] = ")
    assert f"disagrees with {path}:2 branches[0]" in msg and "position 1, MoE layer 0" in msg


@pytest.mark.parametrize("edit, match", [
    (lambda r: np.where(r == 3, 9, r), "expert id 9 at token 0, MoE layer 0 is out of range .*4 experts"),
    (lambda r: r[:, :1], "routing for 1 MoE layers; the model has 2"),
    (lambda r: np.concatenate([r, r[..., :1] + 4], -1), "3 experts per token; the model routes each token to top_k=2"),
    (lambda r: r[:1], "routing for 1 tokens; the branch has 3"),
    (lambda r: None, "model.moe.routing=replay needs the sampler's routing on every branch"),
])
def test_bad_routing_is_one_line_naming_file_record_and_field(tmp_path, edit, match):
    branch = [1, 2, 3]
    r = routing_for(branch)
    r[0, 0] = [1, 3]
    bad = edit(r)
    rec = {"id": "x", "branches": [{"input_ids": branch}]}
    if bad is not None:
        rec["branches"][0]["routed_experts"] = bad.tolist()
    path = _write(tmp_path / "d.jsonl", [_rec("ok", [[5, 6]], [routing_for([5, 6])]), rec])
    with pytest.raises(DataError, match=match) as info:
        build_trees(str(path), SequencesBuilder(), limits=REPLAY)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{path}:2: branches[0].routed_experts: ")


@pytest.mark.parametrize("value", [
    {"dtype": "int16", "shape": [2**32, 2**32, 4], "b64": ""},
    {"dtype": "int16", "shape": [1, 1, 1], "b64": "!!"},
    [[[1, 1]]],
])
def test_bad_compact_routing_under_replay_is_one_line_naming_file_record_and_field(tmp_path, value):
    rec = {"id": "x", "branches": [{"input_ids": [1, 2, 3], "routed_experts": value}]}
    path = _write(tmp_path / "d.jsonl", [_rec("ok", [[5, 6]], [routing_for([5, 6])]), rec])
    with pytest.raises(DataError) as info:
        build_trees(str(path), SequencesBuilder(), limits=REPLAY)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{path}:2: branches[0].routed_experts: ")


@pytest.mark.parametrize("value", [
    {"dtype": "int16", "shape": [2**32, 2**32, 4], "b64": ""},
    [[[1, 1]], [[0, 2]], [[0, 3]]],
    [[[0, 1]]],
])
def test_bad_routing_read_without_model_limits_names_file_record_and_field(tmp_path, value):
    """Records built without the model's limits (the builder called on its own) keep the field and
    the tree decodes it: still one line naming the file, the record and the field."""
    rec = {"id": "x", "branches": [{"input_ids": [5, 6]}, {"input_ids": [1, 2, 3], "routed_experts": value}]}
    path = _write(tmp_path / "d.jsonl", [rec])
    with pytest.raises(DataError) as info:
        build_trees(str(path), SequencesBuilder())
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{path}:1: branches[1].routed_experts: ")


@pytest.mark.parametrize("value", [
    [[[9, 10]]] * 3,  # out of range for the model
    {"dtype": "int16", "shape": [2**32, 2**32, 4], "b64": ""},  # malformed: not decoded, not checked
    {"dtype": "int16", "shape": [1, 1, 1], "b64": "!!"},
    [[[1, 1]], [[-1, 2]]],
    "routing",
])
def test_live_routing_reads_no_routing(tmp_path, value):
    """Under model.moe.routing=live the field is dropped unread: neither decoded nor checked."""
    rec = {"id": "x", "branches": [{"input_ids": [1, 2, 3], "routed_experts": value}]}
    path = _write(tmp_path / "d.jsonl", [rec])
    trees = build_trees(str(path), SequencesBuilder(), limits=Limits(16, 64, needs={}))
    assert trees[0].tree.token_routing is None and trees[0].tree.num_tokens == 3


def test_a_streaming_source_carries_and_checks_the_routing(tmp_path):
    """data=stream: records read as they come are checked against the replay shape like files."""
    from treelit.builders.base import make_tree_builder
    from treelit.data.sources import make_data_source
    from treelit.lightning.streaming import StreamingTreeDataModule
    from treelit.objectives import make_objective

    good = [_rec(f"r{i}", [[1, 2, 3 + i], [1, 2, 4 + i, 5]], [routing_for([1, 2, 3 + i]), routing_for([1, 2, 4 + i, 5])])
            for i in range(4)]
    path = _write(tmp_path / "s.jsonl", good)

    def module(p):
        m = StreamingTreeDataModule(make_data_source("files", paths=[str(p)]), make_tree_builder("sequences"),
                                    micro_batch_tokens=64, shuffle=False)
        m.check_against(16, 64, make_objective("sft"), routing=(2, 4, 2))
        return m

    step = module(path).next_step()
    assert step.micro_batches and all(mb.token_routing is not None and mb.token_routing.shape[1:] == (2, 2)
                                      for mb in step.micro_batches)
    bad = good[:2] + [{"id": "x", "branches": [{"input_ids": [1, 2], "routed_experts": [[[0, 5]], [[1, 2]]]}]}]
    path = _write(tmp_path / "b.jsonl", bad)
    with pytest.raises(DataError, match=rf"^{path}:3: branches\[0\].routed_experts: routing for 1 MoE layers; "
                                        r"the model has 2$"):
        m = module(path)
        m.next_step()
