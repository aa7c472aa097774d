"""PPO with a learned value function on trees: GAE per (token, branch), both losses folded exactly.

Before the first update of a step batch, the critic's values of every target token are
computed once on the tree (no gradient; a token's value is shared by its branches), and GAE
(:mod:`treelit.rl.gae`) gives every (branch, action token) pair its advantage ``A_{b,t}`` and
return ``R_{b,t}``: :func:`prepare_tree` / :func:`prepare_branches`. Then:

* **Policy loss**: PPO's clipped surrogate with per-pair advantages. A token's ratio is
  shared by its branches, so the sum over branches folds by sign as for per-branch
  advantages (:mod:`treelit.objectives.rl`): ``P_t = sum_b c_{b,t} max(A_{b,t}, 0)``,
  ``N_t = sum_b c_{b,t} min(A_{b,t}, 0)``.
* **Value loss**: ``0.5 sum_b c_{b,t} max((V_t - R_{b,t})^2, (clip(V_t) - R_{b,t})^2)`` with
  ``clip(V) = V_old + clamp(V - V_old, -value_clip, value_clip)`` (``V_old``: the values of
  the rollout pass). ``V_t`` is computed once per tree token; the sum over its branches is a
  sum of scalars per (branch, token) pair, whose gradient autograd adds into ``V_t``.

The total is ``policy + vf_coef x value``, divided by the step normaliser like every loss.
``critic_linear_loss`` computes the same per branch, each its own causal sequence.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from treelit.loss.logprobs import token_logprobs
from treelit.loss.linear import linear_micro_batches, row_images
from treelit.loss.tree import prepare_batch, tree_hidden
from treelit.models.context import CausalContext
from treelit.models.forward import decoder_hidden, in_forward, output_weight
from treelit.objectives.folding import loss_from_logprobs, target_selection
from treelit.objectives.rl import PPO, _branch_scale, kl_estimate
from treelit.rl.gae import PairGAE, _branch_gae, branch_rewards, check_gae_options, gae_pairs
from treelit.tree.batch import check_aggregation

__all__ = ["check_critic_objective", "critic_padding_pass", "tree_values", "branch_values", "prepare_tree", "prepare_branches",
           "set_tree_advantages", "set_branch_advantages", "critic_tree_loss", "critic_linear_loss", "ValuePairs",
           "value_pairs"]

Metrics = Dict[str, float]


def check_critic_objective(objective) -> None:
    """A critic trains with ``objective=ppo`` (GAE replaces the records' advantages)."""
    if type(objective) is not PPO:
        raise ValueError(f"critic=shared|separate trains with objective=ppo (GAE advantages), not "
                         f"objective={getattr(objective, 'name', type(objective).__name__)}")
    check_gae_options(objective.gamma, objective.lam)


# values -------------------------------------------------------------------------------------
def _hidden_rows(model, batch, attention, rows):
    def run(m):
        h, _ = tree_hidden(m, batch, attention)
        return h[rows]

    return in_forward(model, run)


@torch.no_grad()
def tree_values(critic, model, batch, attention="auto") -> torch.Tensor:
    """``[N]`` float64: the value of each target token's state (NaN elsewhere), one pass."""
    batch = prepare_batch(model, batch)
    sel = target_selection(batch)
    trunk = model if critic.kind == "shared" else critic.trunk
    v = critic.values(_hidden_rows(trunk, batch, attention, batch.parent[sel]))
    out = torch.full((batch.num_tokens,), float("nan"), dtype=torch.float64, device=batch.device)
    out[sel] = v.double()
    return out


def _causal_hidden(m, toks: List[np.ndarray], idx: List[int], device, images=None):
    L = max(len(toks[i]) for i in idx)
    ids = torch.zeros(len(idx), L, dtype=torch.long)
    for r, i in enumerate(idx):
        ids[r, : len(toks[i])] = torch.from_numpy(toks[i])
    ids = ids.to(device)
    pos = torch.arange(L, device=device).expand(len(idx), L)
    lengths = torch.tensor([len(toks[i]) for i in idx], device=device)
    return decoder_hidden(m, ids, pos, CausalContext(lengths, images=row_images(images, idx))), ids


@torch.no_grad()
def branch_values(critic, model, br, max_tokens: int = 8192) -> List[np.ndarray]:
    """Per branch ``[L_b]`` float64: the value before each token (NaN at position 0), each
    branch its own causal sequence."""
    trunk = model if critic.kind == "shared" else critic.trunk
    device = next(trunk.parameters()).device
    out: List[np.ndarray] = [None] * len(br.tokens)  # type: ignore[list-item]
    for idx in linear_micro_batches([len(t) for t in br.tokens], max_tokens):
        h, _ = in_forward(trunk, lambda m: _causal_hidden(m, br.tokens, idx, device, br.images))
        for r, i in enumerate(idx):
            n = len(br.tokens[i])
            v = np.full(n, np.nan)
            v[1:] = critic.values(h[r, : n - 1]).double().cpu().numpy()
            out[i] = v
    return out


# GAE ----------------------------------------------------------------------------------------
def prepare_tree(batch, token_values: torch.Tensor, gamma: float, lam: float) -> PairGAE:
    """GAE of every (branch, token) pair of ``batch`` from its tokens' values."""
    return gae_pairs(batch.branch_ptr.cpu().numpy(), batch.branch_tokens.cpu().numpy(),
                     batch.branch_mask.cpu().numpy(), token_values.cpu().numpy(), batch.branch_fields, gamma, lam)


def prepare_branches(br, values: List[np.ndarray], gamma: float, lam: float) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per branch ``(adv [L_b], ret [L_b])`` (NaN off the actions), each branch on its own."""
    out = []
    for b, (toks, mask) in enumerate(zip(br.tokens, br.masks)):
        out.append(_branch_gae(values[b], branch_rewards(br.fields, b, len(toks)), mask.astype(bool), gamma, lam,
                               f"branch {b}: "))
    return out


def _branch_means(ptr: np.ndarray, adv: np.ndarray) -> np.ndarray:
    out = np.zeros(len(ptr) - 1)
    for b in range(len(ptr) - 1):
        a = adv[ptr[b]: ptr[b + 1]]
        a = a[~np.isnan(a)]
        out[b] = a.mean() if len(a) else 0.0
    return out


def set_tree_advantages(batch, pairs: PairGAE, adv: np.ndarray) -> None:
    """Fold the per-pair advantages ``adv [F]`` into the batch's per-token fields (what PPO's
    tree fold reads) and keep the pairs for the value loss (``batch.critic_pairs``)."""
    ptr = batch.branch_ptr.cpu().numpy()
    idx = batch.branch_tokens.cpu().numpy()
    N = batch.num_tokens
    B = len(ptr) - 1
    branch_of = np.repeat(np.arange(B), np.diff(ptr))
    target = pairs.action
    n_b = np.bincount(branch_of, weights=target, minlength=B)
    inv_n = np.divide(1.0, n_b, out=np.zeros(B), where=n_b > 0)[branch_of]
    w = batch.branch_weight.cpu().numpy()[branch_of] * target
    a = np.where(target, adv, 0.0)
    pos, neg = w * np.maximum(a, 0.0), w * np.minimum(a, 0.0)
    f64 = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)).to(batch.device)  # noqa: E731
    batch.adv_pos_sum = f64(np.bincount(idx, weights=pos, minlength=N))
    batch.adv_neg_sum = f64(np.bincount(idx, weights=neg, minlength=N))
    batch.adv_pos_mean = f64(np.bincount(idx, weights=pos * inv_n, minlength=N))
    batch.adv_neg_mean = f64(np.bincount(idx, weights=neg * inv_n, minlength=N))
    batch.branch_adv = f64(_branch_means(ptr, np.where(target, adv, np.nan))).cpu()
    batch.critic_pairs = PairGAE(pairs.action, np.where(target, adv, np.nan), pairs.ret, pairs.value)


def set_branch_advantages(br, gae: List[Tuple[np.ndarray, np.ndarray]], adv: List[np.ndarray],
                          values: List[np.ndarray]) -> None:
    """Per branch: the (whitened) advantages, returns and rollout values the per-branch losses read."""
    br.token_adv = [np.where(np.isnan(a), 0.0, a) for a in adv]
    br.token_ret = [r for _, r in gae]
    br.token_value = values
    br.adv = np.array([float(np.nanmean(a)) if (~np.isnan(a)).any() else 0.0 for a in adv])


def critic_padding_pass(critic, model, batch, attention="auto") -> torch.Tensor:
    """The critic's part of an empty pass (a rank without work, under FSDP2): its modules run,
    so their collectives match the other ranks'; the result (a sum, to be multiplied by 0)
    carries no gradient of value."""
    if critic.kind == "shared":
        w = critic.head.weight
        return critic.values(torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device)).sum()
    batch = prepare_batch(critic.trunk, batch)
    return critic.values(_hidden_rows(critic.trunk, batch, attention, torch.arange(batch.num_tokens,
                                                                                      device=batch.device))).sum()


# losses -------------------------------------------------------------------------------------
def _value_term(critic, v: torch.Tensor, old: torch.Tensor, ret: torch.Tensor, c: torch.Tensor):
    """``0.5 sum c max((v - R)^2, (clip(v) - R)^2)`` and the number of pairs where the clip acts."""
    un = (v - ret) ** 2
    if critic.value_clip is None:
        return 0.5 * (c * un).sum(), 0.0, float(c.numel())
    vc = old + (v - old).clamp(-critic.value_clip, critic.value_clip)
    cl = (vc - ret) ** 2
    clipped = (cl > un).detach()
    return 0.5 * (c * torch.maximum(un, cl)).sum(), float(clipped.double().sum()), float(c.numel())


class ValuePairs:
    """The value loss's (branch, action) pairs of a tree batch that went through
    :func:`set_tree_advantages`: each pair's tree token ``tok [P]``, rollout value ``old``,
    return ``ret`` and coefficient ``c`` (the branch's weight and aggregation scale)."""

    def __init__(self, batch, aggregation: str, device=None) -> None:
        pairs: PairGAE = getattr(batch, "critic_pairs", None)
        if pairs is None:
            raise ValueError("critic: the batch has no GAE advantages (prepare_tree / set_tree_advantages first)")
        act = np.flatnonzero(pairs.action)
        dev = batch.device if device is None else device
        self.tok = batch.branch_tokens.to(dev)[torch.from_numpy(act).to(dev)]
        ptr = batch.branch_ptr.cpu().numpy()
        branch_of = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))[act]
        n_b = np.bincount(branch_of, minlength=len(ptr) - 1).astype(np.float64)
        c = batch.branch_weight.cpu().numpy()[branch_of] * _branch_scale(n_b, aggregation)[branch_of]
        f = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)).to(dev)  # noqa: E731
        self.old, self.ret, self.c = f(pairs.value[act]), f(pairs.ret[act]), f(c)

    def loss(self, critic, v: torch.Tensor, where: torch.Tensor):
        """The value loss (unnormalised), clipped pairs and pairs over the pairs whose token has a
        value here: ``v [M]`` the values of the tokens with ``where[token] = index into v`` (-1:
        not here, e.g. a token of another partition)."""
        at = where[self.tok]
        here = at >= 0
        if not bool(here.all()):
            at = at[here]
            old, ret, c = self.old[here], self.ret[here], self.c[here]
        else:
            old, ret, c = self.old, self.ret, self.c
        vt = v[at]
        return _value_term(critic, vt, old.to(vt.dtype), ret.to(vt.dtype), c.to(vt.dtype))


def value_pairs(batch, aggregation: str, device=None) -> ValuePairs:
    return ValuePairs(batch, aggregation, device)


def critic_tree_loss(objective, critic, model, batch, *, aggregation: str, normalizer: float, attention="auto",
                     chunk_rows: Optional[int] = None) -> Tuple[torch.Tensor, Metrics]:
    """The micro-batch's ``policy + vf_coef x value`` loss on the tree (divided by ``normalizer``);
    the batch went through :func:`set_tree_advantages`."""
    check_aggregation(aggregation)
    source = batch  # (a batch moved to the model's device is a copy without ``critic_pairs``)
    batch = prepare_batch(model, batch)
    terms = value_pairs(source, aggregation, batch.device)
    sel = target_selection(batch)
    rows = batch.parent[sel]
    need_ent = bool(objective.entropy_coef)
    shared = critic.kind == "shared"

    def run(m):
        h, _ = tree_hidden(m, batch, attention)
        lp, ent = token_logprobs(h[rows], output_weight(m), batch.input_ids[sel], chunk_rows=chunk_rows,
                                 with_entropy=need_ent)
        return lp, ent, (critic.values(h[rows]) if shared else None)

    logp, ent, v = in_forward(model, run)
    if not shared:
        v = critic.values(_hidden_rows(critic.trunk, batch, attention, rows))
    ref = None
    if objective.kl_coef and objective.reference != "data":
        ref = torch.full((batch.num_tokens,), float("nan"), dtype=torch.float64, device=batch.device)
        ref[sel] = objective._tree_ref(model, batch, sel, attention)
    policy, metrics = loss_from_logprobs(objective, batch, sel, logp, ent, aggregation=aggregation,
                                         normalizer=normalizer, ref=ref)
    # the value loss over (branch, action) pairs: the value of pair f is its token's
    dev = batch.device
    where = torch.full((batch.num_tokens,), -1, dtype=torch.long, device=dev)
    where[sel] = torch.arange(len(sel), device=dev)
    value, n_clip, n_pairs = terms.loss(critic, v, where)
    Z = float(normalizer)
    value = value / Z if Z > 0 else value * 0.0
    metrics = {**metrics, "critic/value_loss": float(value.detach()),
               "critic/clip_fraction": n_clip / max(n_pairs, 1.0)}
    return policy + critic.vf_coef * value, metrics


def critic_linear_loss(objective, critic, model, br, *, aggregation: str, normalizer: float,
                       chunk_rows: Optional[int] = None, max_tokens: int = 8192) -> Tuple[torch.Tensor, Metrics]:
    """The same loss per branch: each branch its own causal sequence, log-probs and values from
    one pass (two with a separate critic), GAE from :func:`set_branch_advantages`."""
    check_aggregation(aggregation)
    if getattr(br, "token_adv", None) is None:
        raise ValueError("critic: the branches have no GAE advantages (set_branch_advantages first)")
    br.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
    Z = float(normalizer)
    device = next(model.parameters()).device
    shared = critic.kind == "shared"
    coef = br.weights * _branch_scale(br.n, aggregation)
    total = None
    v_total = None
    n_clip = n_pairs = 0.0
    for idx in linear_micro_batches([len(t) for t in br.tokens], max_tokens):
        def run(m):
            h, ids = _causal_hidden(m, br.tokens, idx, device, br.images)
            out = []
            for r, i in enumerate(idx):
                n = len(br.tokens[i])
                lp, ent = token_logprobs(h[r, : n - 1], output_weight(m), ids[r, 1:n], chunk_rows=chunk_rows,
                                         with_entropy=bool(objective.entropy_coef))
                out.append((lp, ent, critic.values(h[r, : n - 1]) if shared else None))
            return out

        res = in_forward(model, run)
        if not shared:
            hc, _ = in_forward(critic.trunk, lambda m: _causal_hidden(m, br.tokens, idx, device, br.images))
            res = [(lp, ent, critic.values(hc[r, : len(br.tokens[i]) - 1])) for r, ((lp, ent, _), i)
                   in enumerate(zip(res, idx))]
        for (lp, ent, v), b in zip(res, idx):
            m = torch.from_numpy(br.masks[b][1:].astype(np.float64)).to(device)
            if not m.any():
                continue
            old = None if br.old is None else torch.from_numpy(br.old[b][1:]).to(device)
            old = objective._old_or_current(old, lp)
            c = (coef[b] * m).to(lp.dtype)
            term = objective._branch_term(b, lp, old, c, br, br.n[b], aggregation)
            if objective.kl_coef:
                ref = objective._linear_ref(model, br, b, lp)
                term = term + objective.kl_coef * (c * kl_estimate(lp, ref.to(lp.dtype), objective.kl_estimator)).sum()
            if objective.entropy_coef:
                term = term - objective.entropy_coef * (c * ent).sum()
            total = term if total is None else total + term
            act = torch.from_numpy(np.flatnonzero(br.masks[b][1:])).to(device)
            f = lambda x: torch.from_numpy(np.ascontiguousarray(x[1:], dtype=np.float64)).to(device, v.dtype)[act]  # noqa: E731
            val, k, n = _value_term(critic, v[act], f(br.token_value[b]), f(br.token_ret[b]),
                                    torch.full((len(act),), float(coef[b]), dtype=v.dtype, device=device))
            v_total = val if v_total is None else v_total + val
            n_clip += k
            n_pairs += n
    if total is None:
        zero = next(model.parameters()).sum() * 0.0
        return zero, {}
    policy = total / Z if Z > 0 else total * 0.0
    value = v_total / Z if Z > 0 else v_total * 0.0
    return policy + critic.vf_coef * value, {"critic/value_loss": float(value.detach()),
                                             "critic/clip_fraction": n_clip / max(n_pairs, 1.0)}
