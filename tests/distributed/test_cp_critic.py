"""PPO with a critic under context parallelism: each pass's row split over C gloo processes,
the critic's values taken with the row split the same way, each rank folding the value loss of
the (branch, action) pairs whose tokens it holds; shared and separate critics, unpartitioned and
partitioned. The ranks' gradients (policy, value head, a separate critic's model) summed equal
one unpartitioned process's in float64, and so do the loss and the critic's metrics."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import launch
from helpers import grad_floor, max_rel_grad_diff, negligible_grad, tiny_model
from treelit.models.critic import Critic
from treelit.models.decoder import output_weight
from treelit.objectives import make_objective
from treelit.objectives.critic import critic_tree_loss, prepare_tree, set_tree_advantages, tree_values
from treelit.loss.tree import tree_token_logprobs
from treelit.partition.engine import PartitionStats, partitioned_values, run_micro_batch
from treelit.rl.gae import whiten

import treelit

# one-token segments, a duplicate and a prefix branch, rewards at several depths
BRANCHES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 10], [1, 2, 3], [1, 2, 3, 9, 10], [1, 0],
            [1, 2, 3, 4, 5, 6, 10, 2, 4], [7, 8, 9, 6]]
MASKS = [[0, 1, 1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1], [0, 1, 0, 1, 1], [1, 1],
         [0, 1, 1, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1]]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 1.0, 1.5, 0.8]
REWARDS = [1.0, -0.5, 0.3, 2.0, -1.0, 0.7, 0.2]


def _case(kind, name):
    """Model, critic and a tree batch with GAE advantages (values of the rollout taken before
    the parameters move; then moved, so that both clips act)."""
    model = tiny_model(name, seed=0)
    trunk = tiny_model(name, seed=1) if kind == "separate" else None
    critic = Critic(kind, output_weight(model).shape[1], trunk, vf_coef=0.7, value_clip=0.05, dtype=torch.float64,
                    init_std=0.3)
    rewards = [[0.0] * (len(b) - 1) + [r] for b, r in zip(BRANCHES, REWARDS)]
    rewards[5][3] = 0.4  # on a tool-output token: credited to the action before it
    tree = treelit.TokenTree.from_branches(BRANCHES, MASKS, WEIGHTS,
                                           branch_fields={"reward": REWARDS, "token_rewards": rewards})
    batch = tree.to_batch()
    with torch.no_grad():
        lp = tree_token_logprobs(model, batch, "sdpa_dense")
    old = torch.full((batch.num_tokens,), float("nan"), dtype=torch.float64)
    old[lp[0]] = lp[1].double()
    batch.token_old_logp, batch.branch_old_logp = old, old[batch.branch_tokens]
    values = tree_values(critic, model, batch, "sdpa_dense")
    pairs = prepare_tree(batch, values, 0.9, 0.8)
    act = pairs.adv[pairs.action]
    (adv,) = whiten([pairs.adv], (len(act), act.sum(), (act * act).sum()))
    set_tree_advantages(batch, pairs, adv)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in list(model.parameters()) + list(critic.parameters()):
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    objective = make_objective("ppo", clip_low=0.2, gamma=0.9, lam=0.8)
    return model, critic, batch, objective, values


def _params(model, critic):
    return list(model.parameters()) + list(critic.parameters())


def _engine(model, critic, batch, objective, budget, cp_group=None, stats=None):
    """The loss (policy + value) and metrics through the partition engine (``.grad`` accumulated)."""
    Z = batch.norm_contribution("token-mean")
    shared = critic.kind == "shared"
    res = run_micro_batch(model, objective, batch, aggregation="token-mean", normalizer=Z, budget_tokens=budget,
                          attention="sdpa_dense", critic=critic if shared else None, cp_group=cp_group, stats=stats)
    if shared:
        return res.loss, res.metrics
    crit = run_micro_batch(critic.trunk, None, batch, aggregation="token-mean", normalizer=Z, budget_tokens=budget,
                           attention="sdpa_dense", critic=critic, critic_only=True, cp_group=cp_group, stats=stats)
    return res.loss + crit.loss, {**res.metrics, **crit.metrics}


def _worker(rank, world, kind, name, budget):
    model, critic, batch, objective, _ = _case(kind, name)
    trunk = model if kind == "shared" else critic.trunk
    v = partitioned_values(trunk, critic, batch, budget_tokens=budget, attention="sdpa_dense",
                           cp_group=dist.group.WORLD)
    stats = PartitionStats()
    loss, metrics = _engine(model, critic, batch, objective, budget, dist.group.WORLD, stats)
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in _params(model, critic)]
    for g in grads:
        dist.all_reduce(g)
    passes = torch.tensor([float(stats.partitions)])
    dist.all_reduce(passes, op=dist.ReduceOp.MAX)
    return {"values": v, "loss": loss, "metrics": metrics, "grads": grads, "passes": float(passes)}


def compare(kind, name, C, budget):
    got = launch(_worker, C, kind, name, budget, deadline=400)
    model, critic, batch, objective, _ = _case(kind, name)
    values = tree_values(critic, model, batch, "sdpa_dense")  # (of the moved parameters, as the ranks')
    assert torch.equal(torch.isnan(got["values"]), torch.isnan(values))
    have = ~torch.isnan(values)
    torch.testing.assert_close(got["values"][have], values[have], rtol=1e-12, atol=1e-12)
    Z = batch.norm_contribution("token-mean")
    loss, metrics = critic_tree_loss(objective, critic, model, batch, aggregation="token-mean", normalizer=Z,
                                     attention="sdpa_dense")
    loss.backward()
    loss = loss.detach()
    want = [p.grad if p.grad is not None else torch.zeros_like(p) for p in _params(model, critic)]
    assert abs(got["loss"] - float(loss)) <= 1e-9 * abs(float(loss)), (got["loss"], float(loss))
    assert metrics["critic/value_loss"] > 0 and 0 < metrics["critic/clip_fraction"] < 1, metrics
    assert set(metrics) <= set(got["metrics"]), (sorted(metrics), sorted(got["metrics"]))
    for k in metrics:
        assert got["metrics"][k] == pytest.approx(metrics[k], rel=1e-9, abs=1e-12), k
    head = len(list(model.parameters()))
    assert want[head].abs().max() > 0 and want[0].abs().max() > 0, "the case must train policy and critic"
    names = [str(i) for i in range(len(want))]
    err = max_rel_grad_diff(dict(zip(names, got["grads"])), dict(zip(names, want)), grad_floor(torch.float64),
                            negligible_grad(torch.float64))
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"
    if budget is not None:
        assert got["passes"] > 1, "the budget must cut the row into several passes"


@pytest.mark.parametrize("kind,budget", [("shared", None), ("separate", 6)])
def test_cp_critic_equals_one_process(kind, budget):
    """C = 2: a shared critic on the whole row split over the ranks; a separate critic's own model
    over partitions of 6 tokens per rank (chains of 12; the tree has more)."""
    compare(kind, "qwen2_5_tiny", 2, budget)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shared", "separate"])
@pytest.mark.parametrize("C,budget", [(2, 6), (2, None), (4, None), (4, 3)])
def test_cp_critic_degrees_and_budgets(kind, C, budget):
    if (kind, C, budget) in (("shared", 2, None), ("separate", 2, 6)):
        pytest.skip("in the default suite")
    compare(kind, "qwen2_5_tiny", C, budget)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shared", "separate"])
@pytest.mark.parametrize("budget", [None, 6])
def test_cp_critic_hybrid(kind, budget):
    """Attention + Gated DeltaNet + Mamba2: states cross the ranks in the values pass and in the
    gradient passes alike."""
    compare(kind, "hybrid_tiny", 2, budget)
