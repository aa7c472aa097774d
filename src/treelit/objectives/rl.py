"""Policy-gradient and preference objectives on trees, exact per branch.

**Token-level clipped surrogate (``ppo``, ``grpo``).** Per branch b and target token t,
with ratio ``r_t = exp(logp_t - old_t)`` and advantage ``A_b``, PPO maximises
``min(r_t A_b, clip(r_t) A_b)``; clip-higher uses ``clip(r) = clamp(r, 1 - eps_low,
1 + eps_high)``; dual clip bounds the term below by ``c A_b`` for ``A_b < 0``. The ratio
of a token is the same in every branch through it, so the sum over branches folds by
the sign of the advantage:

    sum_b c_{b,t} J_{b,t} = P_t min(r_t, clip(r_t)) + N_t g(r_t),
    P_t = sum_{A_b > 0} c_{b,t} A_b,  N_t = sum_{A_b < 0} c_{b,t} A_b,
    g(r) = max(r, clip(r))   (dual clip: min(max(r, clip(r)), c))

with ``c_{b,t}`` the branch's loss coefficient (weight x mask x aggregation scale).
``grpo`` is the same objective, fed group-relative advantages.

**Sequence-level objectives (``gspo``, ``dpo``)** use per-branch sums over the
branch's target tokens, computed on the tree as path-prefix differences
(:mod:`treelit.objectives.paths`). GSPO's ratio is ``s_b = exp(mean_t (logp_t -
old_t))`` and its per-branch term ``min(s_b A_b, clip(s_b) A_b)`` counts once per
target token of the branch under the token aggregations (so ``seq-mean-token-mean``
gives GSPO's sequence mean). DPO pairs branches through their ``pair`` and
``chosen`` fields and averages over pairs.

**KL and entropy.** ``kl_coef`` adds ``kl_coef * sum_t c_t k(logp_t, ref_t)`` with the
k1/k2/k3 estimators; ``entropy_coef`` subtracts ``entropy_coef * sum_t c_t H_t``.

Old log-probs come from the data (``old_logprobs`` per branch) or, where missing,
equal the current policy's (detached): one on-policy step. Reference log-probs come
from the data or, with ``reference=initial``, from a frozen copy of the initial model, or with
``reference=base`` from the model itself with its LoRA adapters off (one model in memory).

**Off-policy correction** (``behavior_correction=tis|mis|decoupled``, ``ppo``/``grpo``/``gspo``):
the old log-probs are then the trainer's proximal ones and the sampler's are kept as
behaviour log-probs; a per-token constant weight ``w_t`` (:mod:`treelit.objectives.behavior`)
multiplies the token's clipped surrogate, which folds as ``w_t (P_t min(r_t, clip(r_t)) +
N_t g(r_t))``. GSPO counts its sequence term once per target token, each copy weighted by
that token's ``w_t``: the branch term becomes ``(sum_t c_{b,t} w_t) J_b``. At a sequence level
(``behavior_is_level=sequence|geometric``) a branch's weight ``w_b`` is one constant for all its
tokens: it multiplies the branch's advantage in the fold, ``P_t = sum_{A_b > 0} c_{b,t} w_b A_b``,
and GSPO's branch term (:mod:`treelit.objectives.behavior_seq`).

Every objective has ``tree_loss`` (the fold) and ``linear_loss`` (the plain
per-branch formula); tests compare both with references written from the papers.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from treelit import loss as primitives  # the loss face: the decoder (torchtune) is imported on the first loss
from treelit.loss.branches import Branches, as_branches
from treelit.models.lora import adapters_disabled
from treelit.objectives.base import OBJECTIVES, Objective
from treelit.objectives.behavior import branch_behavior, check_behavior_options, tree_behavior
from treelit.objectives.behavior_seq import folded_advantages, refuse_token_advantages, tree_branch_weights
from treelit.objectives.paths import branch_target_sums
from treelit.rl.gae import check_gae_options
from treelit.tree.batch import check_aggregation
from treelit.utils.dispatch import host_floats, upload

__all__ = ["PPO", "GRPO", "GSPO", "DPO", "kl_estimate"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3)."""
    d = ref - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kind!r}")


def _branch_scale(n: np.ndarray, aggregation: str) -> np.ndarray:
    return np.divide(1.0, n, out=np.zeros_like(n), where=n > 0) if aggregation == "seq-mean-token-mean" else np.ones_like(n)


REFERENCES = ("data", "initial", "base")  # where the reference log-probs come from


def _number(name: str, value: Any, low: float = 0.0, high: float = math.inf, low_open: bool = False,
            high_open: bool = False) -> float:
    """``objective.<name>`` as a float inside its range, or one ValueError line naming it."""
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if not bad:
        bad = value < low or (low_open and value == low) or value > high or (high_open and value == high)
    if bad:
        span = f"{'(' if low_open else '['}{low:g}, {'inf' if high == math.inf else f'{high:g}'}{')' if high_open or high == math.inf else ']'}"
        raise ValueError(f"objective.{name} must be a number in {span}, got {value!r}")
    return float(value)


class _PolicyObjective(Objective):
    """Shared plumbing: log-probs in both forms, old/reference log-probs, KL and entropy."""

    token_advantages = False  # whether a token's term reads its own advantage (not one per branch)

    def __init__(self, kl_coef: float = 0.0, kl_estimator: str = "k3", entropy_coef: float = 0.0, reference: str = "data",
                 behavior_correction: str = "none", behavior_is_cap: Optional[float] = 2.0,
                 behavior_is_cap_low: Optional[float] = None, behavior_is_level: str = "token"):
        self.behavior = check_behavior_options(behavior_correction, behavior_is_cap, behavior_is_cap_low, behavior_is_level)
        self.behavior_correction, self.behavior_is_cap = self.behavior.kind, self.behavior.cap
        self.behavior_is_cap_low, self.behavior_is_level = self.behavior.low, self.behavior.level
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"objective.kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
        if reference not in REFERENCES:
            raise ValueError(f"objective.reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
        self.kl_coef = _number("kl_coef", kl_coef)
        self.kl_estimator = kl_estimator
        self.entropy_coef = _number("entropy_coef", entropy_coef, low=-math.inf)
        self.reference = reference
        self._ref_model = None

    # reference policy ----------------------------------------------------------------------
    def _reference_model(self, model):
        if self._ref_model is None:
            self._ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        return self._ref_model

    @contextlib.contextmanager
    def as_reference(self, model):
        """The reference model inside the context: a frozen copy of the initial model
        (``initial``) or, with ``base``, the model itself with its LoRA adapters off."""
        if self.reference == "base":
            with adapters_disabled(model):
                yield model
        else:
            yield self._reference_model(model)

    def _tree_ref(self, model, batch, sel, attention):
        if self.reference != "data":
            with torch.no_grad(), self.as_reference(model) as reference:
                _, ref, _ = primitives.tree_token_logprobs(reference, batch, attention, select=sel)
            return ref.to(torch.float64)
        if batch.token_ref_logp is None or torch.isnan(batch.token_ref_logp[sel]).any():
            raise ValueError("kl_coef > 0 needs ref_logprobs for every target token in the data, or objective.reference=initial|base")
        return batch.token_ref_logp[sel]

    def _linear_ref(self, model, br: Branches, b, lp):
        """Branch ``b``'s reference log-probs of its tokens 1.. (per branch: no tree)."""
        if self.reference != "data":
            if not hasattr(self, "_lin_ref_cache") or self._lin_ref_cache[0] is not br:
                with torch.no_grad(), self.as_reference(model) as reference:
                    refs, _ = primitives.linear_branch_logprobs(reference, br.tokens, routing=br.routing,
                                                                images=br.images)
                self._lin_ref_cache = (br, refs)
            return self._lin_ref_cache[1][b].to(torch.float64)
        if br.ref is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs in the data, or objective.reference=initial|base")
        return torch.from_numpy(br.ref[b][1:]).to(lp.device)

    # shared pieces ------------------------------------------------------------------------
    def norm_contribution(self, batch, aggregation: str) -> float:
        return batch.norm_contribution(aggregation)

    def data_needs(self):
        if getattr(self, "critic", None):  # GAE computes the advantages from rewards (treelit.objectives.critic)
            return {"advantage": False, "reward": True, "old_logprobs": True, "pairs": False,
                    "ref_logprobs": bool(self.kl_coef) and self.reference == "data",
                    "behavior_logprobs": self.behavior_correction != "none"}
        return {"advantage": True, "old_logprobs": True, "pairs": False,
                # a token's own advantage (tree_builder.advantage=tree_node) enters its term
                "token_advantage": self.token_advantages,
                "ref_logprobs": bool(self.kl_coef) and self.reference == "data",
                "behavior_logprobs": self.behavior_correction != "none"}

    # off-policy correction (treelit.objectives.behavior) -----------------------------------------
    def _tree_behavior(self, batch, sel, prox, W):
        """Token level: the weights [M] and metrics; a sequence level: None and the token and branch
        metrics (its per-branch weights fold where the advantages fold)."""
        wb, metrics = tree_behavior(batch, sel, prox, W, self.behavior)
        if self.behavior.kind != "none" and self.behavior.level != "token":
            metrics = {**metrics, **tree_branch_weights(batch, self.behavior)[1]}
        return wb, metrics

    def _branch_behavior(self, br: Branches, b: int, prox: torch.Tensor) -> Optional[torch.Tensor]:
        return branch_behavior(br, b, prox, self.behavior)

    def _branch_level(self) -> bool:
        """A sequence-level correction: one weight per branch."""
        return self.behavior.kind != "none" and self.behavior.level != "token"

    def _Z(self, batch, aggregation, normalizer) -> float:
        if normalizer is not None:
            return float(normalizer)
        return 1.0 if aggregation == "sum" else self.norm_contribution(batch, aggregation)

    @staticmethod
    def _old_or_current(old: Optional[torch.Tensor], logp: torch.Tensor) -> torch.Tensor:
        cur = logp.detach().to(torch.float64)
        if old is None:
            return cur
        return torch.where(torch.isnan(old), cur, old)

    def _regularisers(self, logp, ent, W, ref) -> Tuple[torch.Tensor, Dict[str, float]]:
        total = logp.new_zeros(())
        metrics: Dict[str, float] = {}
        Wsum = W.sum().clamp(min=1e-30)  # metrics stay tensors: read to the host once (host_floats)
        if self.kl_coef:
            kl = kl_estimate(logp, ref.to(logp.dtype), self.kl_estimator)
            total = total + self.kl_coef * (W.to(logp.dtype) * kl).sum()
            metrics["kl_ref"] = (W * kl.detach().double()).sum() / Wsum
        if self.entropy_coef:
            total = total - self.entropy_coef * (W.to(logp.dtype) * ent).sum()
        if ent is not None:
            metrics["entropy"] = (W * ent.detach().double()).sum() / Wsum
        return total, metrics

    def _check_advantages(self, batch) -> None:
        adv = batch.adv if isinstance(batch, Branches) else batch.branch_adv
        if adv is None:
            raise ValueError(f"objective={self.name} needs advantages: give 'advantage' per branch, or rewards with "
                             "tree_builder.advantage=grpo|rloo|reinforce_pp|... (TokenTree.from_branches(advantages=...))")
        missing = np.flatnonzero(np.isnan(batch.host("branch_adv") if isinstance(adv, torch.Tensor) and hasattr(batch, "host")
                                          else np.asarray(adv, dtype=np.float64)))
        if len(missing):
            raise ValueError(f"objective={self.name} needs an advantage on every branch; branch {int(missing[0])} has none")

    def tree_loss(self, model, batch, *, aggregation, normalizer, attention="auto", chunk_rows=None):
        check_aggregation(aggregation)
        self._check_advantages(batch)
        batch = primitives.prepare_batch(model, batch)
        Z = self._Z(batch, aggregation, normalizer)
        sel = batch.targets()
        need_ent = bool(self.entropy_coef)
        _, logp, ent = primitives.tree_token_logprobs(model, batch, attention, select=sel, with_entropy=need_ent, chunk_rows=chunk_rows)
        old = self._old_or_current(None if batch.token_old_logp is None else batch.token_old_logp[sel], logp)
        W = batch.token_weights(aggregation)[sel]
        main, metrics = self._tree_term(batch, sel, logp, old, aggregation)
        ref = self._tree_ref(model, batch, sel, attention) if self.kl_coef else None
        reg, m2 = self._regularisers(logp, ent, W, ref)
        total = main + reg
        return (total / Z if Z > 0 else total * 0.0), host_floats({**metrics, **m2})

    def linear_loss(self, model, branches, *, aggregation, normalizer, chunk_rows=None, max_tokens=8192):
        """Per branch, from the definitions: no tree code (see :mod:`treelit.loss.branches`)."""
        check_aggregation(aggregation)
        br = as_branches(branches)
        br.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
        self._check_advantages(br)
        Z = self._Z(br, aggregation, normalizer)
        logps, ents = primitives.linear_branch_logprobs(model, br.tokens, with_entropy=bool(self.entropy_coef),
                                             max_tokens=max_tokens, chunk_rows=chunk_rows, routing=br.routing,
                                             images=br.images)
        coef = br.weights * _branch_scale(br.n, aggregation)
        total = logps[0].new_zeros(())
        for b, lp in enumerate(logps):
            m = torch.from_numpy(br.masks[b][1:].astype(np.float64)).to(lp.device)
            if not m.any():
                continue
            old = None if br.old is None else torch.from_numpy(br.old[b][1:]).to(lp.device)
            old = self._old_or_current(old, lp)
            c = (coef[b] * m).to(lp.dtype)
            total = total + self._branch_term(b, lp, old, c, br, br.n[b], aggregation)
            if self.kl_coef:
                ref = self._linear_ref(model, br, b, lp)
                total = total + self.kl_coef * (c * kl_estimate(lp, ref.to(lp.dtype), self.kl_estimator)).sum()
            if self.entropy_coef:
                total = total - self.entropy_coef * (c * ents[b]).sum()
        return (total / Z if Z > 0 else total * 0.0), {}

    # per objective ----------------------------------------------------------------------------
    def _tree_term(self, batch, sel, logp, old, aggregation):
        raise NotImplementedError

    def _branch_term(self, b, lp, old, c, br, n_b, aggregation):
        raise NotImplementedError


@OBJECTIVES.register("ppo")
class PPO(_PolicyObjective):
    """Token-level clipped surrogate. Args: ``clip_low``/``clip_high`` (clip-higher when they
    differ), ``dual_clip`` (a constant > 1, or None), plus KL/entropy options."""

    name = "ppo"
    token_advantages = True

    def __init__(self, clip_low: float = 0.2, clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
                 gamma: float = 1.0, lam: float = 1.0, whiten_advantages: bool = True, **kw):
        super().__init__(**kw)
        # GAE with a critic (treelit.objectives.critic): discount, GAE lambda, whitening over the step
        self.gamma, self.lam = check_gae_options(gamma, lam)
        if not isinstance(whiten_advantages, bool):
            raise ValueError(f"objective.whiten_advantages={whiten_advantages!r}: must be true or false")
        self.whiten_advantages = whiten_advantages
        self.clip_low = _number("clip_low", clip_low, high=1.0, high_open=True)
        self.clip_high = _number("clip_high", clip_low if clip_high is None else clip_high)
        if dual_clip is not None and not (_number("dual_clip", dual_clip) > 1.0):
            raise ValueError(f"objective.dual_clip must be > 1, got {dual_clip}")
        self.dual_clip = None if dual_clip is None else float(dual_clip)

    def _clip(self, r):
        return r.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)

    def _tree_term(self, batch, sel, logp, old, aggregation):
        folds = folded_advantages(batch, self.behavior, aggregation) if self._branch_level() \
            else batch.advantage_weights(aggregation)  # sequence level: each branch's A_b weighted by its w_b
        P, Nn = (x[sel].to(logp.dtype) for x in folds)
        r = torch.exp(logp - old.to(logp.dtype))
        rc = self._clip(r)
        g_neg = torch.maximum(r, rc)
        if self.dual_clip is not None:
            g_neg = torch.clamp(g_neg, max=self.dual_clip)
        W = batch.token_weights(aggregation)[sel]
        wb, behav_metrics = self._tree_behavior(batch, sel, old, W)
        folded = P * torch.minimum(r, rc) + Nn * g_neg
        term = -(folded if wb is None else wb.to(logp.dtype) * folded).sum()
        clipped = ((r.detach() < 1 - self.clip_low) | (r.detach() > 1 + self.clip_high)).double()
        Wsum = W.sum().clamp(min=1e-30)  # metrics stay tensors: read to the host once (host_floats)
        adv = torch.from_numpy(batch.host("branch_adv"))  # the advantages' statistics from the row's host copy
        metrics = {
            "clip_frac": (W * clipped).sum() / Wsum,
            # KL(rollout || current) from the rollout policy's samples (PPO's diagnostic): bounded where the
            # update pushes a sampled token down, unlike the reverse estimate's exp(old - logp)
            "approx_kl": (W * kl_estimate(old.double(), logp.detach().double(), "k3")).sum() / Wsum,
            "adv_mean": float(adv.mean()),
            "adv_std": float(adv.std()) if adv.numel() > 1 else 0.0,
            "adv_min": float(adv.min()),
            "adv_max": float(adv.max()),
            **behav_metrics,
        }
        return term, metrics

    def _branch_term(self, b, lp, old, c, br, n_b, aggregation):
        r = torch.exp(lp - old.to(lp.dtype))
        token_adv = getattr(br, "token_adv", None)  # per-token advantages (GAE with a critic)
        if token_adv is not None:
            if self._branch_level():
                raise refuse_token_advantages(self.behavior)
            A = torch.from_numpy(token_adv[b][1:]).to(lp)
            J = torch.minimum(r * A, self._clip(r) * A)
            if self.dual_clip is not None:
                J = torch.where(A < 0, torch.maximum(J, self.dual_clip * A), J)
            wb = self._branch_behavior(br, b, old)
            return -(c * J).sum() if wb is None else -(c * wb.to(lp.dtype) * J).sum()
        A = float(br.adv[b])
        J = torch.minimum(r * A, self._clip(r) * A)
        if self.dual_clip is not None and A < 0:
            J = torch.maximum(J, torch.full_like(J, self.dual_clip * A))
        wb = self._branch_behavior(br, b, old)
        return -(c * J).sum() if wb is None else -(c * wb.to(lp.dtype) * J).sum()


@OBJECTIVES.register("grpo")
class GRPO(PPO):
    """PPO's clipped surrogate with group-relative advantages (set by the data's advantage
    estimator, ``grpo`` by default); defaults to clip-higher (0.2 / 0.28)."""

    name = "grpo"

    def __init__(self, clip_low: float = 0.2, clip_high: Optional[float] = 0.28, **kw):
        super().__init__(clip_low=clip_low, clip_high=clip_high, **kw)


@OBJECTIVES.register("gspo")
class GSPO(_PolicyObjective):
    """Sequence-level ratio ``exp(mean of the branch's token log-ratios)``, clipped."""

    name = "gspo"

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4, **kw):
        super().__init__(**kw)
        self.clip_low = _number("clip_low", clip_low, high=1.0, high_open=True)
        self.clip_high = _number("clip_high", clip_high)

    def _seq_term(self, s, A):
        return torch.minimum(s * A, s.clamp(1 - self.clip_low, 1 + self.clip_high) * A)

    def _tree_term(self, batch, sel, logp, old, aggregation):
        d = torch.zeros(batch.num_tokens, dtype=logp.dtype, device=logp.device)
        d = d.index_put((sel,), logp - old.to(logp.dtype))
        S = branch_target_sums(batch, d)
        n = _targets_per_branch(batch)
        bw = batch.host("branch_weight")
        keep_np = np.flatnonzero(n > 0)
        # one upload: the kept branches, their target counts and weights (float64 holds the indices exactly)
        plan = upload(np.stack([keep_np.astype(np.float64), n[keep_np], (bw * (n * _branch_scale(n, aggregation)))[keep_np],
                                (bw * _branch_scale(n, aggregation))[keep_np]]), logp.device)
        keep = plan[0].long()
        s = torch.exp(S[keep] / plan[1].to(S))
        A = batch.branch_adv[keep].to(S.dtype)
        J = self._seq_term(s, A)
        k_keep = plan[2].to(S)
        wb, behav_metrics = self._tree_behavior(batch, sel, old, batch.token_weights(aggregation)[sel])
        if self._branch_level():  # the branch's one weight w_b on all its copies of J
            k_keep = k_keep * tree_branch_weights(batch, self.behavior)[0][keep].to(S)
        elif wb is not None:  # each of the branch's per-token copies of J weighted by its token's w_t
            x = torch.zeros(batch.num_tokens, dtype=torch.float64, device=logp.device).index_put((sel,), wb)
            sums = branch_target_sums(batch, x).to(S)
            k_keep = plan[3].to(S) * sums[keep]
        term = -(k_keep * J).sum()
        return term, {"seq_ratio_mean": s.detach().mean() if keep.numel() else 1.0, **behav_metrics}

    def _branch_term(self, b, lp, old, c, br, n_b, aggregation):
        mask = torch.from_numpy(br.masks[b][1:].astype(np.float64)).to(lp.device)
        s = torch.exp(((lp - old.to(lp.dtype)) * mask).sum() / n_b)
        A = torch.tensor(float(br.adv[b]), dtype=lp.dtype)
        wb = self._branch_behavior(br, b, old)
        return -(c.sum() if wb is None else (c * wb.to(lp.dtype)).sum()) * self._seq_term(s, A)


@OBJECTIVES.register("dpo")
class DPO(_PolicyObjective):
    """Direct preference optimisation over (chosen, rejected) branch pairs.

    Branches carry ``pair`` (a pair id) and ``chosen`` (true/false); each pair has one of
    each. Sequence log-probs sum the branch's target tokens. ``loss``: ``sigmoid`` or
    ``ipo``. The step normaliser is the number of pairs (``sum``: 1); a pair's weight is
    its chosen branch's weight. ``kl_coef`` and ``entropy_coef`` are refused: DPO's
    ``beta`` is its tie to the reference policy, and a silent no-op option would mislead.
    """

    name = "dpo"

    def __init__(self, beta: float = 0.1, loss: str = "sigmoid", reference: str = "data", **kw):
        if loss not in ("sigmoid", "ipo"):
            raise ValueError(f"objective.loss must be 'sigmoid' or 'ipo', got {loss!r}")
        for opt in ("kl_coef", "entropy_coef"):
            if kw.get(opt):
                raise ValueError(
                    f"objective=dpo does not take objective.{opt} (got {kw[opt]!r}): DPO's loss already keeps the "
                    "policy near the reference through objective.beta, and a per-token KL or entropy term is not part "
                    f"of it; remove {opt}, or use objective=ppo/grpo/gspo for a KL-penalised or entropy-regularised loss"
                )
        unknown = sorted(set(kw) - {"kl_coef", "entropy_coef", "kl_estimator"})
        if unknown:
            raise TypeError(f"objective=dpo got unknown options {unknown}; it takes beta, loss, reference")
        super().__init__(reference=reference)
        self.beta = _number("beta", beta, low_open=True)
        self.loss = loss

    def norm_contribution(self, batch, aggregation: str) -> float:
        return 0.0 if aggregation == "sum" else float(len(_pairs(batch)))  # a TreeBatch or Branches

    def data_needs(self):
        return {"advantage": False, "old_logprobs": False, "pairs": True, "ref_logprobs": self.reference == "data"}

    def _pair_loss(self, h):
        if self.loss == "sigmoid":
            return -F.logsigmoid(self.beta * h)
        return (h - 1.0 / (2.0 * self.beta)) ** 2

    def _ref_seq(self, model, batch, attention):
        """Per-branch reference sequence log-probs from the tree row ``batch``."""
        if self.reference != "data":
            with torch.no_grad(), self.as_reference(model) as reference:
                sel, lp, _ = primitives.tree_token_logprobs(reference, batch, attention)
            x = torch.zeros(batch.num_tokens, dtype=torch.float64).index_put((sel,), lp.double())
            return branch_target_sums(batch, x)
        if batch.branch_ref_logp is None:
            raise ValueError("dpo needs ref_logprobs in the data, or objective.reference=initial|base")
        return _branch_sums_host(batch, batch.branch_ref_logp)

    def _ref_seq_linear(self, model, br: Branches):
        """Per-branch reference sequence log-probs, branch by branch (no tree)."""
        if self.reference != "data":
            with torch.no_grad(), self.as_reference(model) as reference:
                lps, _ = primitives.linear_branch_logprobs(reference, br.tokens, routing=br.routing, images=br.images)
            return torch.stack([(lp.double().cpu() * torch.from_numpy(m[1:].astype(np.float64))).sum()
                                for lp, m in zip(lps, br.masks)])
        if br.ref is None:
            raise ValueError("dpo needs ref_logprobs in the data, or objective.reference=initial|base")
        out = []
        for b, (r, m) in enumerate(zip(br.ref, br.masks)):
            vals = r[1:][m[1:]]
            if np.isnan(vals).any():
                raise ValueError("reference log-probs are missing for some target tokens")
            out.append(float(vals.sum()))
        return torch.tensor(out, dtype=torch.float64)

    def _loss_from_seq(self, pi, ref, pairs, weights, Z):
        total = pi.new_zeros(())
        for c, r in pairs:
            h = (pi[c] - ref[c].to(pi)) - (pi[r] - ref[r].to(pi))
            total = total + float(weights[c]) * self._pair_loss(h)
        return total / Z if Z > 0 else total * 0.0

    def tree_loss(self, model, batch, *, aggregation, normalizer, attention="auto", chunk_rows=None):
        check_aggregation(aggregation)
        batch = primitives.prepare_batch(model, batch)
        sel, logp, _ = primitives.tree_token_logprobs(model, batch, attention, chunk_rows=chunk_rows)
        x = torch.zeros(batch.num_tokens, dtype=logp.dtype, device=logp.device).index_put((sel,), logp)
        pi = branch_target_sums(batch, x)
        ref = self._ref_seq(model, batch, attention)
        Z = self._Z(batch, aggregation, normalizer)
        return self._loss_from_seq(pi, ref, _pairs(batch), batch.branch_weight, Z), {}

    def linear_loss(self, model, branches, *, aggregation, normalizer, chunk_rows=None, max_tokens=8192):
        """Per branch, from the definition: no tree code (see :mod:`treelit.loss.branches`)."""
        check_aggregation(aggregation)
        br = as_branches(branches)
        br.validate_for_model(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None))
        lps, _ = primitives.linear_branch_logprobs(model, br.tokens, max_tokens=max_tokens, chunk_rows=chunk_rows,
                                                    routing=br.routing, images=br.images)
        pi = torch.stack([(lp * torch.from_numpy(m[1:].astype(np.float64)).to(lp)).sum() for lp, m in zip(lps, br.masks)])
        ref = self._ref_seq_linear(model, br)
        return self._loss_from_seq(pi, ref, br.pairs(), br.weights, self._Z(br, aggregation, normalizer)), {}


# helpers -------------------------------------------------------------------------------------


def _targets_per_branch(batch) -> np.ndarray:
    ptr = batch.host("branch_ptr")
    mask = batch.host("branch_mask").copy()
    mask[ptr[:-1]] = False
    return np.add.reduceat(mask.astype(np.float64), ptr[:-1]) if len(mask) else np.zeros(0)


def _branch_sums_host(batch, flat: torch.Tensor) -> torch.Tensor:
    """Per-branch sums over target positions of a flat [F] per-branch-token array."""
    ptr = batch.branch_ptr.numpy()
    mask = batch.branch_mask.numpy().copy()
    mask[ptr[:-1]] = False
    vals = np.where(mask, np.nan_to_num(flat.numpy()), 0.0)
    if np.isnan(flat.numpy()[mask]).any():
        raise ValueError("reference log-probs are missing for some target tokens")
    return torch.from_numpy(np.add.reduceat(vals, ptr[:-1]))


def _pairs(batch) -> List[Tuple[int, int]]:
    if isinstance(batch, Branches):
        return batch.pairs()
    cached = getattr(batch, "_dpo_pairs", None)
    if cached is not None:
        return cached
    pair = batch.branch_fields.get("pair")
    chosen = batch.branch_fields.get("chosen")
    if pair is None or chosen is None:
        raise ValueError("dpo needs branch fields 'pair' and 'chosen' (one chosen and one rejected branch per pair)")
    by_pair: Dict[object, List[int]] = {}
    for b, (p, c) in enumerate(zip(pair, chosen)):
        if p is None:
            continue
        by_pair.setdefault((int(batch.branch_tree[b]), p), []).append(b)
    out = []
    for key, members in by_pair.items():
        flags = [bool(chosen[b]) for b in members]
        if len(members) != 2 or sorted(flags) != [False, True]:
            raise ValueError(f"dpo pair {key[1]!r} must have exactly one chosen and one rejected branch, got {len(members)}")
        c = members[flags.index(True)]
        r = members[flags.index(False)]
        out.append((c, r))
    batch._dpo_pairs = out
    return out
