"""``tree_builder.advantage=tree_node``: credit per node of the merged tree, exact against a
per-branch computation of the same definition (written here from the definition, no treelit
tree code): loss and every parameter gradient of the tree step equal per-branch PPO/GRPO with
those advantages, in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import assert_equivalent, tiny_model
from treelit.builders.assemble import Assembler, Limits
from treelit.builders.base import make_tree_builder
from treelit.data.records import DataError, Record
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden, output_weight
from treelit.objectives import make_objective
from treelit.tree.batch import TreeBatch

# a tree-search shape with every nasty case: a branch that is a prefix of another, a duplicate,
# several continuations of intermediate nodes, a second root (forest), a masked prompt
NASTY = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 4, 5, 6],  # duplicate
    [1, 2, 3, 4],  # a prefix of the first
    [1, 2, 3, 7, 8, 9, 10],
    [1, 2, 3, 7, 8, 0],
    [1, 2, 9, 3],
    [5, 6, 7],  # another root of the same tree
    [2, 3, 4, 5],  # a tree of its own (group "h")
]
REWARDS = [1.0, 0.0, 0.5, 1.0, -1.0, 0.25, 2.0, 0.75]
PROMPT = 2  # the first two tokens are the prompt (loss mask 0)


def _hidden(model, ids):
    return decoder_hidden(model, torch.tensor([ids]), torch.arange(len(ids))[None], CausalContext())[0]


def branch_logprobs(model, ids):
    h = _hidden(model, ids)
    return torch.log_softmax(h @ output_weight(model).t(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def ref_advantages(branches, rewards, local, glob, sqrt_leaves, old=None):
    """Per branch, per position, from the definition: L(b, i) = the branches through the prefix
    b[:i+1] (``old``: with a log-prob split, also agreeing on its old log-probs); a node is a run of
    positions with the same L; its parent node is the L of the position before the run (the whole
    group before position 0)."""
    r = np.asarray(rewards, dtype=np.float64)
    root = sum(rewards) / len(rewards)

    def same(x, y):
        return x is None or y is None or abs(x - y) <= 1e-4

    def through(b, i):
        ids = branches[b]
        return tuple(c for c, o in enumerate(branches) if len(o) > i and list(o[: i + 1]) == list(ids[: i + 1])
                     and (old is None or all(same(old[c][j], old[b][j]) for j in range(i + 1))))

    def value(s):
        return sum(r[c] for c in s) / len(s)

    out = []
    for b, ids in enumerate(branches):
        adv = []
        for i in range(len(ids)):
            s = through(b, i)
            j = i
            while j > 0 and through(b, j - 1) == s:
                j -= 1
            vp = value(through(b, j - 1)) if j > 0 else root
            a = local * (value(s) - vp) + glob * (value(s) - root)
            adv.append(a / math.sqrt(len(s)) if sqrt_leaves else a)
        out.append(adv)
    return out


def reference_loss(model, branches, masks, adv, old, objective, agg):
    """Per-branch PPO's clipped surrogate with per-token advantages, each branch alone."""
    lo, hi = objective.clip_low, objective.clip_high
    n_b = [sum(masks[b][1:]) for b in range(len(branches))]
    Z = {"token-mean": sum(n_b), "seq-mean-token-mean": sum(1 for n in n_b if n), "sum": 1}[agg]
    total = torch.zeros((), dtype=torch.float64)
    for b, ids in enumerate(branches):
        if not n_b[b]:
            continue
        lp = branch_logprobs(model, ids)
        c = 1.0 / n_b[b] if agg == "seq-mean-token-mean" else 1.0
        for t in range(1, len(ids)):
            if not masks[b][t]:
                continue
            ratio = torch.exp(lp[t - 1] - old[b][t])
            A = adv[b][t]
            total = total - c * torch.minimum(ratio * A, ratio.clamp(1 - lo, 1 + hi) * A)
    return total / Z


def _records(model, branches, rewards, groups=None):
    with torch.no_grad():
        old = [[None] + branch_logprobs(model, ids).tolist() for ids in branches]
    masks = [[0] * PROMPT + [1] * (len(ids) - PROMPT) for ids in branches]
    recs = []
    for b, ids in enumerate(branches):
        recs.append({"branches": [{"input_ids": ids, "loss_mask": masks[b], "reward": rewards[b],
                                   "old_logprobs": old[b]}], "group": groups[b] if groups else "g"})
    return [Record(d, f"d.jsonl:{i + 1}", position=i) for i, d in enumerate(recs)], masks, old


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def check(objective_name="ppo", agg="token-mean", local=1.0, glob=0.5, sqrt_leaves=True, seed=0,
          branches=NASTY, rewards=REWARDS, split=None, budget=None):
    """``split``: (branch, position) whose old log-prob disagrees with the other branches' (the tree
    splits there: logprob_conflict=split); ``budget``: the partitioned step (tokens per pass)."""
    model = tiny_model("qwen2_5_tiny", seed=seed)
    objective = make_objective(objective_name)
    groups = ["g"] * len(branches)
    groups[-1] = "h"  # the last branch is a tree of its own: two trees packed in one row
    recs, masks, old = _records(model, branches, rewards, groups)
    if split is not None:
        b, t = split
        old[b][t] -= 0.5
        recs[b].data["branches"][0]["old_logprobs"] = old[b]
    builder = make_tree_builder("groups", advantage="tree_node", node_local=local, node_global=glob,
                                node_sqrt_leaves=sqrt_leaves, logprob_conflict="split" if split else "raise")
    asm = Assembler(builder, limits=Limits(needs=objective.data_needs(), objective=f"objective={objective.name}"))
    built = [t for r in recs for t in asm.add(r)] + asm.flush()
    assert len(built) == 2
    assert (built[0].tree.shared_tokens_lost > 0) == (split is not None)
    # the advantages of every (branch, token) pair are the definition's, computed per tree
    members = [[b for b, g in enumerate(groups) if g == k] for k in ("g", "h")]
    expect = {}
    for bt, idx in zip(built, members):
        ref = ref_advantages([branches[b] for b in idx], [rewards[b] for b in idx], local, glob, sqrt_leaves,
                             [old[b] for b in idx] if split else None)
        t = bt.tree
        for j, b in enumerate(idx):
            got = t.branch_token_adv[t.branch_ptr[j]: t.branch_ptr[j + 1]]
            np.testing.assert_allclose(got, ref[j], rtol=0, atol=1e-14)
            expect[b] = ref[j]
    adv = [expect[b] for b in range(len(branches))]
    assert any(abs(a) > 0 for row in adv for a in row[1:])
    batch = TreeBatch.pack([t.tree.to_batch() for t in built])
    _perturb(model, seed + 11)  # ratios leave 1, some are clipped
    Z = batch.norm_contribution(agg) if agg != "sum" else 1.0

    def tree():
        if budget is None:
            return objective.tree_loss(model, batch, aggregation=agg, normalizer=Z)[0]
        from treelit.partition.engine import PartitionStats, run_micro_batch

        stats = PartitionStats()
        res = run_micro_batch(model, objective, batch, aggregation=agg, normalizer=Z, budget_tokens=budget,
                              stats=stats)
        assert stats.partitions > 1
        return torch.tensor(res.loss, dtype=torch.float64)

    def linear():  # the framework's own per-branch path (mode=linear) on the records' branches
        return objective.linear_loss(model, batch.source_branches, aggregation=agg, normalizer=Z)[0]

    def reference():
        return reference_loss(model, branches, masks, adv, old, objective, agg)

    what = f"{objective_name} {agg} local={local} global={glob} sqrt={sqrt_leaves}"
    assert_equivalent(model, tree, reference, torch.float64, what)
    assert_equivalent(model, linear, reference, torch.float64, what + " (linear)")


def test_tree_node_advantages_equal_per_branch_definition():
    """Default suite: the nasty forest, every weight in play, two trees packed in one row."""
    check()


@pytest.mark.slow
@pytest.mark.parametrize("objective_name", ["ppo", "grpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "sum"])
@pytest.mark.parametrize("local,glob,sqrt_leaves", [(1.0, 0.0, False), (0.0, 1.0, False), (1.0, 1.0, True),
                                                    (0.5, -0.25, True)])
def test_tree_node_all_objectives_and_weights(objective_name, agg, local, glob, sqrt_leaves):
    check(objective_name, agg, local, glob, sqrt_leaves, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_tree_node_random_tree_search_shapes(seed):
    """Several continuations sampled from each intermediate node, random rewards."""
    rng = np.random.default_rng(seed)
    branches = []
    for _ in range(6):
        base = list(branches[rng.integers(len(branches))]) if branches and rng.random() < 0.7 else [1, 2]
        cut = int(rng.integers(2, len(base) + 1))
        branches.append(base[:cut] + [int(x) for x in rng.integers(0, 11, size=int(rng.integers(0, 4)))])
    branches = [b if len(b) > PROMPT else b + [5] for b in branches]
    branches.append([3, 4, 5])
    rewards = [float(x) for x in rng.normal(size=len(branches))]
    check("grpo", "token-mean", 1.0, 1.0, True, seed=seed, branches=branches, rewards=rewards)


@pytest.mark.slow
@pytest.mark.parametrize("split", [(4, 3), (1, 5), (2, 2)])
def test_tree_node_follows_log_prob_splits(split):
    """A branch that disagrees on an old log-prob leaves the shared nodes there (its own copies)."""
    check("ppo", "token-mean", 1.0, 0.5, True, split=split)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [7, 9])
def test_tree_node_partitioned(budget):
    check("grpo", "seq-mean-token-mean", 1.0, 1.0, True, budget=budget)


# bad values: one line naming the option or the record's file:line and field ---------------------
@pytest.mark.parametrize("opts,msg", [
    ({"node_local": "x"}, "tree_builder.node_local must be a finite number"),
    ({"node_global": float("inf")}, "tree_builder.node_global must be a finite number"),
    ({"node_sqrt_leaves": "yes"}, "tree_builder.node_sqrt_leaves must be true or false"),
    ({"node_local": 0, "node_global": 0}, "both 0"),
    ({"eps": 0.1}, "tree_builder.eps: advantage=tree_node takes no estimator options"),
])
def test_bad_options_are_one_line(opts, msg):
    with pytest.raises(ValueError, match=msg) as e:
        make_tree_builder("sequences", advantage="tree_node", **opts)
    assert "\n" not in str(e.value)


def _assemble(data, objective="ppo", **needs):
    b = make_tree_builder("sequences", advantage="tree_node")
    obj = make_objective(objective)
    asm = Assembler(b, limits=Limits(needs={**obj.data_needs(), **needs}, objective=f"objective={obj.name}"))
    recs = [Record(d, f"d.jsonl:{i + 1}", position=i) for i, d in enumerate(data)]
    return [t for r in recs for t in asm.add(r)] + asm.flush()


def test_missing_reward_and_given_advantage_are_named():
    with pytest.raises(DataError, match=r"^d.jsonl:1: branches\[1\].reward: tree_builder.advantage=tree_node needs"):
        _assemble([{"branches": [{"input_ids": [1, 2], "reward": 1.0}, {"input_ids": [1, 3]}]}])
    with pytest.raises(DataError, match=r"^d.jsonl:1: branches\[0\].advantage: tree_builder.advantage=tree_node"):
        _assemble([{"branches": [{"input_ids": [1, 2], "reward": 1.0, "advantage": 0.5}]}])


def test_sequence_level_objective_and_critic_are_refused():
    with pytest.raises(DataError, match="objective=gspo weighs each branch by one advantage"):
        _assemble([{"branches": [{"input_ids": [1, 2], "reward": 1.0}]}], objective="gspo")
    with pytest.raises(DataError, match="with a critic computes GAE advantages"):
        _assemble([{"branches": [{"input_ids": [1, 2], "reward": 1.0}]}], reward=True, advantage=False)


def test_rows_with_and_without_node_credit_pack():
    """A row without per-token advantages (e.g. the padding pass's) conforms to one with them: its
    branches' own advantage on every token (0 without), so both pack and read back per branch."""
    from treelit.lightning.data import conform_batches
    from treelit.loss.branches import as_branches
    from treelit.tree.token_tree import TokenTree

    recs = [Record({"branches": [{"input_ids": [1, 2, 3], "reward": 1.0}, {"input_ids": [1, 2, 4], "reward": 0.0}]},
                   "d.jsonl:1", position=0)]
    (built,) = make_tree_builder("sequences", advantage="tree_node")(recs)
    plain = TokenTree.from_branches([[5, 6, 7]], advantages=[0.25]).to_batch()
    empty = TokenTree.from_branches([[0, 0]], loss_masks=[[0, 0]]).to_batch()
    rows = conform_batches([built.tree.to_batch(), plain, empty])
    row = TreeBatch.pack(rows)
    br = as_branches(row)
    np.testing.assert_array_equal(np.concatenate(br.token_adv), [0.0, 0.0, 0.5, 0.0, 0.0, -0.5, 0.25, 0.25, 0.25, 0, 0])
