"""PPO with a critic on trees == per-branch PPO with GAE computed on each branch separately.

The reference below has no treelit tree or GAE code in it: each branch runs through the
model as its own causal sequence, values come from the value head on its hidden states,
GAE is written from its definition (Schulman et al. 2016: ``delta_t = r_t + gamma V_{t+1} -
V_t``, ``A_t = sum_l (gamma lam)^l delta_{t+l}``, returns ``A + V``) over the branch's action
tokens, the advantages are whitened over every action of every branch, and the loss is
PPO's clipped surrogate plus the clipped value loss ``0.5 max((V - R)^2, (clip(V) - R)^2)``.
Values and old log-probs are taken before the parameters move (as in a PPO step), so both
clips act. Loss and every parameter gradient (policy and critic) are compared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import treelit
from helpers import assert_equivalent, tiny_model
from strategies import forests
from treelit.models.context import CausalContext
from treelit.models.critic import Critic
from treelit.models.decoder import decoder_hidden, output_weight
from treelit.objectives import make_objective
from treelit.objectives.critic import (critic_linear_loss, critic_tree_loss, prepare_tree, set_tree_advantages,
                                       tree_values)
from treelit.rl.gae import whiten

GAMMA, LAM, CLIP, VCLIP, VF = 0.9, 0.8, 0.2, 0.05, 0.7


def _hidden(model, ids):
    return decoder_hidden(model, torch.tensor([ids]), torch.arange(len(ids))[None], CausalContext())[0]


def ref_branch(model, critic, ids):
    """Log-probs of tokens 1.. and the values of the states before them, one branch alone."""
    trunk = model if critic.kind == "shared" else critic.trunk
    h = _hidden(model, ids)
    logp = torch.log_softmax(h @ output_weight(model).t(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    hc = h if trunk is model else _hidden(trunk, ids)
    v = (hc[:-1] @ critic.head.weight.t())[:, 0] + critic.head.bias[0]
    return logp, v


def ref_gae(values, rewards, actions):
    """Per-branch GAE over the action positions (plain Python)."""
    adv, ret = {}, {}
    nxt_v, nxt_a = 0.0, 0.0
    pending = 0.0  # rewards of non-action tokens go to the action before them
    for t in reversed(range(len(actions))):
        pending += rewards[t]
        if not actions[t]:
            continue
        # rewards after this action up to the next action belong to it (pending), the next action's own excluded
        delta = pending + GAMMA * nxt_v - values[t]
        a = delta + GAMMA * LAM * nxt_a
        adv[t], ret[t] = a, a + values[t]
        nxt_v, nxt_a, pending = values[t], a, 0.0
    return adv, ret


def reference(model, critic, branches, masks, weights, rewards, old_lp, old_v, agg, white=True):
    """Per-branch PPO + value loss with GAE per branch; ``old_v`` the rollout values per branch."""
    gae = []
    for b, ids in enumerate(branches):
        acts = [bool(masks[b][t]) and t > 0 for t in range(len(ids))]
        gae.append(ref_gae([None] + list(old_v[b]), rewards[b], acts) if len(ids) > 1 else ({}, {}))
    flat = np.array([a for adv, _ in gae for a in adv.values()])
    mean, std = (flat.mean(), flat.std() + 1e-8) if white else (0.0, 1.0)
    n_b = [sum(1 for t in range(1, len(ids)) if masks[b][t]) for b, ids in enumerate(branches)]
    Z = {"token-mean": sum(n_b), "seq-mean-token-mean": sum(1 for n in n_b if n), "sum": 1}[agg]
    total = torch.zeros((), dtype=torch.float64)
    for b, ids in enumerate(branches):
        if not n_b[b]:
            continue
        lp, v = ref_branch(model, critic, ids)
        c = weights[b] * (1.0 / n_b[b] if agg == "seq-mean-token-mean" else 1.0)
        adv, ret = gae[b]
        for t in adv:
            A = (adv[t] - mean) / std
            r = torch.exp(lp[t - 1] - old_lp[b][t - 1])
            J = torch.minimum(r * A, r.clamp(1 - CLIP, 1 + CLIP) * A)
            vo = old_v[b][t - 1]
            vc = vo + (v[t - 1] - vo).clamp(-VCLIP, VCLIP)
            vl = 0.5 * torch.maximum((v[t - 1] - ret[t]) ** 2, (vc - ret[t]) ** 2)
            total = total + c * (-J + VF * vl)
    return total / Z


def _setup(kind, seed=0, name="qwen2_5_tiny"):
    model = tiny_model(name, seed=seed)
    trunk = tiny_model(name, seed=seed + 1) if kind == "separate" else None
    D = output_weight(model).shape[1]
    critic = Critic(kind, D, trunk, vf_coef=VF, value_clip=VCLIP, dtype=torch.float64, init_std=0.3)
    return model, critic


def _perturb(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def partitioned_loss(objective, critic, model, batch, agg, Z, budget):
    """The loss through the partition engine (gradients accumulated in ``.grad``): a shared
    critic's value loss folds into the policy's passes; a separate critic's trunk runs its own."""
    from treelit.partition.engine import PartitionStats, run_micro_batch

    shared = critic.kind == "shared"
    stats = PartitionStats()
    res = run_micro_batch(model, objective, batch, aggregation=agg, normalizer=Z, budget_tokens=budget,
                          critic=critic if shared else None, stats=stats)
    if budget < batch.num_tokens:
        assert stats.partitions > 1, (budget, batch.num_tokens)
    total = res.loss
    if not shared:
        total += run_micro_batch(critic.trunk, None, batch, aggregation=agg, normalizer=Z, budget_tokens=budget,
                                 critic=critic, critic_only=True).loss
    return torch.tensor(total, dtype=torch.float64)


def check(kind, branches, masks, weights, rewards, agg="token-mean", seed=0, white=True, name="qwen2_5_tiny",
          budget=None):
    model, critic = _setup(kind, seed, name)
    both = torch.nn.ModuleDict({"policy": model, "critic": critic})
    # the rollout: old log-probs and values before the update, per branch (reference side)
    with torch.no_grad():
        ref_old = [ref_branch(model, critic, ids) if len(ids) > 1 else (torch.zeros(0), torch.zeros(0))
                   for ids in branches]
    old_lp = [lp.detach() for lp, _ in ref_old]
    old_v = [v.detach().tolist() for _, v in ref_old]
    tree = treelit.TokenTree.from_branches(
        branches, masks, weights, branch_fields={"reward": [r[-1] for r in rewards],
                                                 "token_rewards": [list(r) for r in rewards]},
        old_logprobs=[[None] + lp.tolist() for lp in old_lp])
    batch = tree.to_batch()
    values = tree_values(critic, model, batch)
    if budget is not None:  # the partitioned no-gradient value pass gives the same values
        from treelit.partition.engine import partitioned_values

        trunk = model if kind == "shared" else critic.trunk
        pv = partitioned_values(trunk, critic, batch, budget_tokens=budget)
        assert torch.equal(torch.isnan(pv), torch.isnan(values))
        torch.testing.assert_close(pv[~torch.isnan(pv)], values[~torch.isnan(values)], rtol=1e-12, atol=1e-12)
    pairs = prepare_tree(batch, values, GAMMA, LAM)
    act = pairs.adv[pairs.action]
    (adv,) = whiten([pairs.adv], (len(act), act.sum(), (act * act).sum())) if white else (pairs.adv,)
    set_tree_advantages(batch, pairs, adv)
    _perturb(both, seed + 7)  # the update moves the parameters: ratios and values leave the rollout's
    objective = make_objective("ppo", clip_low=CLIP, gamma=GAMMA, lam=LAM)
    Z = batch.norm_contribution(agg) if agg != "sum" else 1.0
    if budget is not None:
        tree_fn = lambda: partitioned_loss(objective, critic, model, batch, agg, Z, budget)  # noqa: E731
    else:
        tree_fn = lambda: critic_tree_loss(objective, critic, model, batch, aggregation=agg, normalizer=Z)[0]  # noqa: E731
    assert_equivalent(
        both,
        tree_fn,
        lambda: reference(model, critic, branches, masks, weights, rewards, old_lp, old_v, agg, white),
        torch.float64, f"critic={kind} {agg} budget={budget}", forest=(branches, masks, weights))
    return model, critic, batch


def _rewards(branches, draw_seed):
    rng = np.random.default_rng(draw_seed)
    return [list(rng.normal(size=len(b)) * (rng.random(len(b)) < 0.3)) + [] for b in branches]


def test_shared_critic_equals_per_branch_gae():
    """Default suite: a forest with every nasty case, rewards at several depths."""
    branches = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3], [1, 2, 3, 7, 8], [1, 9], [1, 2, 3, 4, 5, 6, 10, 2]]
    masks = [[0, 1, 1, 1, 0, 1], [0, 0, 1, 1, 1], [0, 1, 1], [0, 1, 0, 1, 1], [1, 1], [0, 1, 1, 0, 1, 1, 1, 1]]
    weights = [1.0, 0.5, 2.0, 1.0, 1.0, 1.5]
    rewards = [[0.0] * (len(b) - 1) + [r] for b, r in zip(branches, [1.0, -0.5, 0.3, 2.0, -1.0, 0.7])]
    rewards[5][4] = 0.4  # a reward on a tool-output token (mask 0): credited to the action before it
    check("shared", branches, masks, weights, rewards)


@pytest.mark.parametrize("kind", ["shared", pytest.param("separate", marks=pytest.mark.slow)])
def test_partitioned_critic_equals_per_branch_gae(kind):
    """Partitions of 8 tokens (the longest branch; the tree has 17): values, policy and value
    losses folded per pass, every gradient equal to per-branch PPO with GAE."""
    branches = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3], [1, 2, 3, 7, 8], [1, 9], [1, 2, 3, 4, 5, 6, 10, 2]]
    masks = [[0, 1, 1, 1, 0, 1], [0, 0, 1, 1, 1], [0, 1, 1], [0, 1, 0, 1, 1], [1, 1], [0, 1, 1, 0, 1, 1, 1, 1]]
    rewards = [[0.0] * (len(b) - 1) + [r] for b, r in zip(branches, [1.0, -0.5, 0.3, 2.0, -1.0, 0.7])]
    check(kind, branches, masks, [1.0, 0.5, 2.0, 1.0, 1.0, 1.5], rewards, budget=8)


def test_separate_critic_equals_per_branch_gae():
    branches = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [1, 2, 3]]
    masks = [[0, 1, 1, 1, 1], [0, 1, 0, 1], [0, 1, 1, 1, 1, 1], [0, 0, 1]]
    rewards = [[0.0] * (len(b) - 1) + [r] for b, r in zip(branches, [1.0, 0.0, -1.0, 0.5])]
    check("separate", branches, masks, [1.0] * 4, rewards, agg="seq-mean-token-mean")


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(forests(max_branches=6, max_len=9), st.sampled_from(["shared", "separate"]),
       st.sampled_from(["token-mean", "seq-mean-token-mean", "sum"]), st.integers(0, 10**6),
       st.sampled_from([None, 0, 3]))
@example(([[1, 2], [1, 2, 3], [1, 4], [1, 2, 3]], [[1, 1], [0, 1, 1], [0, 1], [0, 0, 1]], [1.0, 1.0, 0.5, 1.0]),
         "shared", "token-mean", 3, 0)  # one-token segments, a prefix branch, a duplicate with another mask
def test_critic_on_random_forests(forest, kind, agg, seed, budget):
    """Random forests, unpartitioned and in partitions of the longest branch's length (+ 3)."""
    branches, masks, weights = forest
    rewards = _rewards(branches, seed)
    for r, m in zip(rewards, masks):
        r[-1] += 1.0  # a reward at every branch end, others at random depths
        first = next((t for t in range(1, len(m)) if m[t]), len(m))
        r[:first] = [0.0] * min(first, len(r))  # none before the branch's first action (refused)
    # raw GAE advantages (a forest with one action would whiten its only advantage to 0)
    budget = None if budget is None else max(len(b) for b in branches) + budget
    check(kind, branches, masks, weights, rewards, agg=agg, seed=seed % 5, white=False, budget=budget)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shared", "separate"])
@pytest.mark.parametrize("budget", [None, 6])
def test_critic_on_a_hybrid_model(kind, budget):
    """Attention + Gated DeltaNet + Mamba2 (state routed across segments and partitions): the same equality."""
    branches = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3], [1, 9, 4]]
    masks = [[0, 1, 1, 1, 0, 1], [0, 0, 1, 1, 1], [0, 1, 1], [0, 1, 1]]
    rewards = [[0.0] * (len(b) - 1) + [r] for b, r in zip(branches, [1.0, -0.5, 0.3, 2.0])]
    check(kind, branches, masks, [1.0, 0.5, 2.0, 1.0], rewards, name="hybrid_tiny", budget=budget)


def test_linear_path_equals_tree_path():
    """The trainer's per-branch path (mode=linear, verify_every) gives the tree's loss and gradients."""
    from treelit.objectives.critic import branch_values, prepare_branches, set_branch_advantages

    branches = [[1, 2, 3, 4], [1, 2, 5, 6, 7], [1, 2, 3]]
    masks = [[0, 1, 1, 1], [0, 1, 1, 0, 1], [0, 1, 1]]
    rewards = [1.0, -1.0, 0.5]
    model, critic = _setup("shared")
    both = torch.nn.ModuleDict({"policy": model, "critic": critic})
    tree = treelit.TokenTree.from_branches(branches, masks, branch_fields={"reward": rewards})
    batch = tree.to_batch()
    br = treelit.Branches.build(branches, masks, branch_fields={"reward": rewards})
    pairs = prepare_tree(batch, tree_values(critic, model, batch), GAMMA, LAM)
    vals = branch_values(critic, model, br)
    gae = prepare_branches(br, vals, GAMMA, LAM)
    act = pairs.adv[pairs.action]
    tot = (len(act), act.sum(), (act * act).sum())
    (adv,) = whiten([pairs.adv], tot)
    set_tree_advantages(batch, pairs, adv)
    set_branch_advantages(br, gae, whiten([a for a, _ in gae], tot), vals)
    _perturb(both, 3)
    objective = make_objective("ppo", gamma=GAMMA, lam=LAM)
    Z = float(batch.num_targets)
    assert_equivalent(both, lambda: critic_tree_loss(objective, critic, model, batch, aggregation="token-mean",
                                                     normalizer=Z)[0],
                      lambda: critic_linear_loss(objective, critic, model, br, aggregation="token-mean",
                                                 normalizer=Z)[0], torch.float64, "linear path")


@pytest.mark.parametrize("gamma,lam,bad", [(1.5, 0.9, "gamma"), (0.9, -0.1, "lam"), (float("nan"), 0.9, "gamma")])
def test_gamma_and_lam_outside_the_unit_interval_are_refused(gamma, lam, bad):
    with pytest.raises(ValueError, match=f"objective.{bad}=.*must be a number in \\[0, 1\\]"):
        make_objective("ppo", gamma=gamma, lam=lam)


def test_branch_without_reward_is_named():
    model, critic = _setup("shared")
    batch = treelit.TokenTree.from_branches([[1, 2, 3], [1, 2, 4]], branch_fields={"reward": [1.0, None]}).to_batch()
    with pytest.raises(ValueError, match="branch 1 has no reward"):
        prepare_tree(batch, tree_values(critic, model, batch), GAMMA, LAM)


def test_reward_before_the_first_action_is_refused():
    """A reward on a prompt token, before any action of its branch, is named (not dropped)."""
    model, critic = _setup("shared")
    batch = treelit.TokenTree.from_branches(
        [[1, 2, 3, 4], [1, 2, 5]], [[0, 0, 1, 1], [0, 1, 1]],
        branch_fields={"reward": [1.0, 1.0], "token_rewards": [[0.0, 0.5, 0.0, 1.0], None]}).to_batch()
    with pytest.raises(ValueError, match=r"branch 0: a reward \(0.5\) at token 1, before the branch's first action"):
        prepare_tree(batch, tree_values(critic, model, batch), GAMMA, LAM)
