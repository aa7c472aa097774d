"""``tree_builder.routing_conflict=split``: branches whose recorded MoE experts disagree on a
token stop sharing the tree there (as ``logprob_conflict=split``), the replayed loss and every
gradient equal per-branch training (transformers, run branch by branch with each branch's own
recorded routing: tests/routing_oracle.py), and ``tree/shared_tokens_lost`` counts exactly the
tokens no longer shared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treelit
from helpers import max_rel_grad_diff
from hf_oracle import hf_grads, load_hf_oracle, random_hf_checkpoint
from routing_oracle import replay_branch_loss, routing_for
from treelit.builders.base import make_tree_builder
from treelit.data.records import DataError, Record
from treelit.models.factory import set_moe_routing
from treelit.tree.batch import TreeBatch
from treelit.tree.token_tree import TokenTree

pytest.importorskip("transformers")

TINY = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, moe_intermediate_size=8,
            num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])  # MoE layers 0 and 2
BRANCHES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9], [1, 2, 10], [11, 12, 13, 14], [1, 2, 3, 4, 5, 6, 15],
            [1, 2, 3, 4, 5, 6, 7]]
MASKS = [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1], [0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1],
         [0, 1, 1, 1, 1, 1, 1]]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 1.5, 1.0]


def records(conflicts):
    """Every branch's routing over all its tokens, a function of its prefix; ``conflicts``: (branch,
    position, layer) where that branch's record differs from the prefix's (a sampler that routed
    the same token otherwise)."""
    out = [routing_for(b, 2, 2, 6) for b in BRANCHES]
    for b, t, layer in conflicts:
        old = set(out[b][t, layer].tolist())
        out[b][t, layer] = sorted(e for e in range(6) if e not in old)[:2]
    return out


def expected_lost(branches, recs):
    """From the definition: tree tokens = distinct (token prefix, routing prefix) pairs; without the
    routing they would be the distinct token prefixes."""
    split = {(tuple(b[: t + 1]), r[: t + 1].tobytes()) for b, r in zip(branches, recs) for t in range(len(b))}
    plain = {tuple(b[: t + 1]) for b in branches for t in range(len(b))}
    return len(split) - len(plain)


def own_records(branches, recs):
    """Each branch's routing over all its tokens from the definition: its own record, and for a
    token it did not record (its final one) the record of the first branch that reached the same
    token by the same tokens and the same routing (the copy of the tree it shares); -1 (live) else."""
    seen = {}
    for b, r in zip(branches, recs):
        for t in range(len(r)):
            seen.setdefault((tuple(b[: t + 1]), r[:t].tobytes()), r[t])
    out = []
    for b, r in zip(branches, recs):
        rows = [r[t] if t < len(r) else seen.get((tuple(b[: t + 1]), r[:t].tobytes()), np.full(r.shape[1:], -1))
                for t in range(len(b))]
        out.append(np.stack(rows).astype(np.int64))
    return out


def compare(path, recs, kind="native", budget=None, aggregation="token-mean"):
    """Loss and every gradient of the split tree (replayed) against transformers per branch."""
    if kind == "native":
        ours, strip = treelit.load_hf_checkpoint(path, dtype=torch.float64), ""
    else:
        from hf_oracle import make_exact

        ours, strip = treelit.load_hf_model(path, dtype=torch.float64), "hf."
        make_exact(ours.hf)
    set_moe_routing(ours, "replay")
    tree = TokenTree.from_branches(BRANCHES, MASKS, WEIGHTS, routed_experts=recs, routing_conflict="split")
    ours.zero_grad(set_to_none=True)
    if budget is None:
        loss = treelit.tree_loss(ours, tree, aggregation)
        loss.backward()
        value = loss.item()
    else:
        value = treelit.tree_backward(ours, tree, aggregation, "redundancy_free", budget)
    ref = load_hf_oracle(path, dtype=torch.float64)
    expected = replay_branch_loss(ref, BRANCHES, MASKS, WEIGHTS, own_records(BRANCHES, recs), aggregation, None)
    expected.backward()
    if kind == "native":
        from treelit.models.hf import hf_to_tune_state_dict

        theirs = hf_to_tune_state_dict(hf_grads(ref, ours.config.tie_word_embeddings), ours.config)
    else:
        theirs = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    mine = {n[len(strip):]: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert mine.keys() == theirs.keys()
    assert expected.item() != 0 and max(g.norm().item() for g in theirs.values()) > 0  # it trains
    assert abs(value - expected.item()) <= 1e-10 * abs(expected.item()), (value, expected.item())
    assert max_rel_grad_diff(mine, theirs, 1e-6) <= 1e-10
    return tree


def test_routing_split_equals_per_branch_replay(tmp_path):
    """Default suite: branch 4 disagrees with branch 0 at position 2 (all later tokens split off),
    the duplicate branch 5 at position 5; native qwen3_moe against transformers per branch."""
    recs = records([(4, 2, 1), (5, 5, 0)])
    random_hf_checkpoint(tmp_path, "qwen3_moe", **TINY)
    with pytest.raises(treelit.TreeInputError, match="routing_conflict='split'"):
        TokenTree.from_branches(BRANCHES, MASKS, WEIGHTS, routed_experts=recs)  # today's behaviour: an error
    tree = compare(tmp_path, recs)
    assert tree.shared_tokens_lost == expected_lost(BRANCHES, recs) == 4 + 2  # branch 4: 3, 4, 5, 6; branch 5: 6, 7
    assert tree.branches() == BRANCHES
    # the per-branch routing the tree keeps for mode=linear is each branch's own record
    for b, r in enumerate(recs):
        np.testing.assert_array_equal(tree.token_routing[tree.branch_tokens[tree.branch_ptr[b]:tree.branch_ptr[b + 1]]], r)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["native", "hf_auto"])
@pytest.mark.parametrize("budget", [None, 7])
@pytest.mark.parametrize("last", [True, False])
@pytest.mark.parametrize("aggregation", ["token-mean", "sum"])
def test_routing_split_everywhere(kind, budget, last, aggregation, tmp_path):
    """Both model paths, partitioned, final tokens unrecorded (as samplers return them)."""
    recs = records([(4, 2, 1), (5, 5, 0), (1, 3, 1)])
    if not last:
        recs = [r[:-1] for r in recs]
    random_hf_checkpoint(tmp_path, "qwen3_moe", **TINY)
    compare(tmp_path, recs, kind, budget, aggregation)


def test_shared_tokens_lost_counts_logprob_and_routing_splits():
    """Both kinds of split add up; the row and a packed step sum the trees' counts."""
    br = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7]]
    old = [[None, -1.0, -1.0, -1.0, -1.0], [None, -1.0, -1.0, -2.0, -1.0], [None, -1.0, -1.0, -1.0]]
    recs = [routing_for(b, 1, 2, 6) for b in br]
    recs[2][1, 0] = [4, 5] if recs[2][1, 0].tolist() != [4, 5] else [0, 1]  # branch 2 splits at position 1
    plain = TokenTree.from_branches(br, routed_experts=recs[:2] + [None])  # nothing disagrees
    assert plain.shared_tokens_lost == 0 and plain.to_batch().shared_tokens_lost == 0
    lp = TokenTree.from_branches(br, old_logprobs=old, logprob_conflict="split", routed_experts=recs[:2] + [None])
    assert lp.shared_tokens_lost == 1  # branch 1's position 4 on its own copy of position 3: one more token
    both = TokenTree.from_branches(br, old_logprobs=old, logprob_conflict="split", routed_experts=recs,
                                   routing_conflict="split")
    # branch 2 leaves at position 1: its tokens 1, 2 are copies (its token 3 is its own anyway)
    assert both.shared_tokens_lost == 1 + 2
    assert both.num_tokens == 7 + 3  # the tree of the tokens alone has 7
    row = TreeBatch.pack([lp.to_batch(), both.to_batch()])
    assert row.shared_tokens_lost == 4
    from treelit.lightning.data import StepBatch

    assert StepBatch([row, plain.to_batch(), both.to_batch()], 0).shared_tokens_lost == 7


def test_routing_conflict_option_through_the_builder():
    recs = records([(4, 2, 1)])
    data = [{"branches": [{"input_ids": b, "routed_experts": r.tolist()} for b, r in zip(BRANCHES, recs)]}]
    with pytest.raises(DataError, match=r"^d.jsonl:1: branches\[4\].routed_experts\[2\]\[1\] = .*tree_builder.routing_conflict=split"):
        make_tree_builder("sequences")([Record(data[0], "d.jsonl:1")])
    (built,) = make_tree_builder("sequences", routing_conflict="split")([Record(data[0], "d.jsonl:1")])
    assert built.tree.shared_tokens_lost == 4
    with pytest.raises(ValueError, match="^tree_builder.routing_conflict must be 'error' or 'split', got 'merge'$"):
        make_tree_builder("groups", routing_conflict="merge")
