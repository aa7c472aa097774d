"""The training step's parts: one object per capability that touches the step, with the hooks
the loop (:class:`~treelit.lightning.module.TreeLitModule`) and the executors
(:mod:`treelit.lightning.executors`) call (docs/design.md, "The step as parts").

A part declares what it ``adds`` to a pass and what it ``needs`` from one (documentation and
the composition table; the executors read :attr:`StepPart.split_row` only), and fills the
hooks it needs:

- set-up: :meth:`~StepPart.configure` (checks, FSDP2 sharding of its own modules),
  :meth:`~StepPart.modules` (trained modules besides the policy), :meth:`~StepPart.param_groups`,
  :meth:`~StepPart.clip_groups`;
- before a step batch's first update: :meth:`~StepPart.before_updates`;
- per update: :meth:`~StepPart.normalizer` (its step normaliser's share of a micro-batch);
- per micro-batch: :meth:`~StepPart.micro_batch` (a context around each micro-batch's passes
  and no-gradient reads, e.g. the image encoder's tower forward before and backward after),
  :meth:`~StepPart.whole_row` (composed around the whole-row loss),
  :meth:`~StepPart.pass_parts` / :meth:`~StepPart.extra_runs` (the partition engine's),
  :meth:`~StepPart.pad` / :meth:`~StepPart.pad_loss` (a padding pass);
- per step: :meth:`~StepPart.step_metrics`.

:func:`step_parts` lists a run's parts from its configuration. A new capability adds a part
here (or in a module of its own: the image encoder, :mod:`treelit.lightning.image_part`; the
base class is :mod:`treelit.lightning.step_part`'s); the executors and the module do not change.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import numpy as np
import torch

from treelit.loss.branches import as_branches
from treelit.loss.linear import linear_branch_logprobs
from treelit.loss.router import RouterTerms, router_aux, router_normalizer_contribution
from treelit.loss.tree import sft_tree_loss
from treelit.models.factory import replay_shape
from treelit.objectives.behavior import split_behavior
from treelit.objectives.critic import (branch_values, check_critic_objective, critic_linear_loss, critic_padding_pass,
                                       critic_tree_loss, prepare_branches, prepare_tree, set_branch_advantages,
                                       set_tree_advantages)
from treelit.partition.context_parallel import check_cp_model
from treelit.partition.parts import PassPart, RouterPass, ValuePass
from treelit.rl.gae import explained_variance, value_sums, whiten
from treelit.lightning.image_part import ImageEncoder, has_vision_tower
from treelit.lightning.step_part import LossFn, StepPart
from treelit.utils.distributed import is_sharded, shard_model, shard_module

__all__ = ["StepPart", "ImageEncoder", "RolloutLogprobs", "ReferenceModel", "ValueHead", "RouterLoss", "RoutingReplay", "step_parts",
           "SUMMED_METRICS"]

class RolloutLogprobs(StepPart):
    """``old_logprobs=rollout``: each micro-batch's old log-probs, the current policy's, before
    the first update (no gradient; in tree mode through the executor, partitioned like
    training; in linear mode branch by branch on the records' branches). The other form of the
    micro-batch gets the same values (they are the rollout's inputs, not what is compared)."""

    name = "rollout_logprobs"
    adds = ("old log-probs",)
    needs = ("a no-gradient pass",)

    def __init__(self, objective) -> None:
        self.keep_behavior = getattr(objective, "behavior_correction", "none") != "none"

    @torch.no_grad()
    def before_updates(self, executor, micro, step) -> None:
        spec = executor.spec
        for mb in micro:
            br = mb.source_branches
            if self.keep_behavior:  # the records' (sampler's) log-probs stay as behaviour log-probs
                split_behavior(mb)
                if br is not None:
                    split_behavior(br)
            if spec.mode == "linear" and br is not None:
                lps, _ = linear_branch_logprobs(spec.model, br.tokens, chunk_rows=spec.chunk_rows, routing=br.routing,
                                              images=br.images)
                br.old = [np.concatenate([[np.nan], lp.double().cpu().numpy()]) for lp in lps]
                flat = torch.from_numpy(np.concatenate(br.old)).to(mb.device)
                mb.branch_old_logp = flat
                old = torch.full((mb.num_tokens,), float("nan"), dtype=torch.float64, device=mb.device)
                old[mb.branch_tokens] = flat
                mb.token_old_logp = old
                continue
            old = executor.logprobs(mb, step)
            mb.token_old_logp = old
            mb.branch_old_logp = old[mb.branch_tokens]
            if br is not None:
                ptr = mb.branch_ptr.cpu().numpy()
                flat = mb.branch_old_logp.cpu().numpy()
                br.old = [flat[ptr[b]: ptr[b + 1]] for b in range(len(ptr) - 1)]


class ReferenceModel(StepPart):
    """``reference=initial``: the frozen copy of the initial model, sharded like the policy
    (the reference log-probs themselves are the objective's: ``FoldSpec.reference_model``);
    ``reference=base`` (LoRA): the policy itself with its adapters off, a second forward of the
    sharded policy, its only hook the padding pass's."""

    name = "reference"
    adds = ("reference log-probs",)
    needs = ("a no-gradient pass of the reference model",)

    def __init__(self, objective, model) -> None:
        self.objective, self.model = objective, model
        self._images = None  # the reference's own tower's encoder (a vision model)

    @property
    def _copy(self) -> bool:
        return self.objective.reference == "initial"

    def configure(self, cp_degree: int) -> None:
        if self._copy:
            self.objective._reference_model(self.model)  # the copy: of the initial model, before it is sharded

    def micro_batch(self, spec, mb, grad: bool):
        """A vision model's copy has a tower of its own: its images are encoded once per
        micro-batch by an encoder of that tower (frozen: no backward), like the policy's, so that
        under FSDP2 / HSDP every rank calls the sharded copy's tower alike (a rank without images
        runs the blank image) and a partitioned row encodes each image once, not once per pass."""
        if not self._copy:  # (base: the policy's own tower, encoded by the policy's encoder)
            return contextlib.nullcontext()
        reference = self.objective._reference_model(self.model)
        if not grad or not has_vision_tower(reference):  # (the reference log-probs: in the gradient passes only)
            return contextlib.nullcontext()
        if self._images is None:
            self._images = ImageEncoder(reference)
        return self._images.micro_batch(spec, mb, grad)

    def shard(self, dp_mesh, mp_policy) -> None:
        if self._copy:  # (base: the policy, sharded as the policy)
            shard_model(self.objective._reference_model(self.model), dp_mesh, mp_policy=mp_policy)

    def pad_loss(self, spec, mb):
        """A padding micro-batch (no targets) runs the sharded reference's forward too: the other
        ranks' micro-batches run it for their reference log-probs (its all-gathers): the copy's,
        or with ``base`` a second forward of the policy, its adapters off."""
        if not (self.objective.name == "dpo" or self.objective.kl_coef):  # (no reference pass: none to match)
            return None
        sharded = self.objective._reference_model(self.model) if self._copy else self.model
        if not is_sharded(sharded):
            return None
        with torch.no_grad(), self.objective.as_reference(self.model) as reference:
            return sft_tree_loss(reference, mb, spec.aggregation, spec.attention, normalizer=1.0)


class ValueHead(StepPart):
    """PPO's critic (:class:`~treelit.models.critic.Critic`), shared or separate: values and GAE
    advantages before the first update of each step batch (:meth:`before_updates`), then its
    value loss joins the policy's, read from the policy's hidden states (shared) or from its own
    trunk's, run after the policy's passes (separate)."""

    name = "critic"
    adds = ("value loss", "advantages")
    needs = ("hidden states of the target rows",)
    split_row = False  # (under context parallelism the value loss runs through the partition engine)
    summed_metrics = ("critic/value_loss",)

    def __init__(self, critic, model, objective, linear_values: bool) -> None:
        check_critic_objective(objective)
        self.critic, self.model, self.objective = critic, model, objective
        self.shared = critic.kind == "shared"
        self.linear_values = linear_values  # per-branch values too (mode=linear, verify_every)
        self._metrics: Dict[str, float] = {}

    def configure(self, cp_degree: int) -> None:
        if cp_degree > 1 and self.critic.trunk is not None:
            check_cp_model(self.critic.trunk)

    def shard(self, dp_mesh, mp_policy) -> None:  # its own model per block like the policy; the head as one unit
        if self.critic.trunk is not None:
            shard_model(self.critic.trunk, dp_mesh, mp_policy=mp_policy)
        shard_module(self.critic.head, dp_mesh, mp_policy=mp_policy)

    def modules(self) -> List[torch.nn.Module]:
        return [self.critic]

    def param_groups(self) -> List[Dict[str, Any]]:
        """The critic's parameters, a group of their own (``critic.lr``; null: the optimizer's)."""
        group = {"params": [p for p in self.critic.parameters() if p.requires_grad], "name": "critic"}
        if self.critic.lr is not None:
            group["lr"] = self.critic.lr
        return [group]

    def clip_groups(self, groups):
        """A shared critic's head trains on the policy's loss (clipped with it); a separate critic
        is clipped on its own."""
        mine = [p for p in self.critic.parameters() if p.grad is not None]
        if self.shared:
            (name, params), *rest = groups
            return [(name, params + mine), *rest]
        return groups + [("critic", mine)]

    def whole_row(self, spec, inner: LossFn, norms) -> LossFn:
        critic, objective = self.critic, self.objective

        def loss(mb, mode, **kw):  # the policy's loss and the value loss from one pass (shared)
            if mode == "tree":
                return critic_tree_loss(objective, critic, spec.model, mb, attention=spec.attention, **kw)
            branches = mb.source_branches if mb.source_branches is not None else mb
            return critic_linear_loss(objective, critic, spec.model, branches, **kw)

        return loss

    def pass_parts(self, norms) -> List[PassPart]:
        return [ValuePass(self.critic)] if self.shared else []

    def extra_runs(self, norms):
        return [] if self.shared else [(self.critic.trunk, [ValuePass(self.critic, policy=False)])]

    def pad_loss(self, spec, mb) -> torch.Tensor:  # (its sharded parts are collectives too)
        return critic_padding_pass(self.critic, spec.model, mb, spec.attention)

    @torch.no_grad()
    def before_updates(self, executor, micro, step) -> None:
        """Values and GAE advantages of the step batch: the critic's values of every target
        token (through the executor, or per branch in ``mode=linear``), GAE per (branch, action)
        pair, whitened over the whole step (every micro-batch, every rank) with
        ``objective.whiten_advantages``; the step's ``critic/explained_variance``,
        ``critic/values_mean`` and ``critic/returns_mean`` (over the action pairs of every rank)."""
        obj, comm, spec = self.objective, step.state.comm, executor.spec
        tree = spec.mode == "tree"
        trees, lins = [], []
        for mb in micro:
            if not mb.num_targets and not is_sharded(spec.model):
                continue  # (under FSDP2 a padding micro-batch's pass keeps the other ranks' collectives company)
            if tree:
                v = executor.head_values(self.critic, mb, step)
            if not mb.num_targets:
                continue
            if tree:
                trees.append((mb, prepare_tree(mb, v, obj.gamma, obj.lam)))
            if self.linear_values:
                if mb.source_branches is None:
                    mb.source_branches = as_branches(mb)
                br = mb.source_branches
                vals = branch_values(self.critic, spec.model, br)
                lins.append((br, prepare_branches(br, vals, obj.gamma, obj.lam), vals))
        self._metrics = _advantages(obj, comm, trees, lins)

    def step_metrics(self, first_updates, comm) -> Dict[str, float]:
        """The value loss of the step's first update, summed over the ranks, and the values' metrics."""
        first = [u.get("critic/value_loss", 0.0) for u in first_updates]
        return {"critic/value_loss": comm.sum(sum(first)), **self._metrics}


def _advantages(obj, comm, trees, lins) -> Dict[str, float]:
    def totals(advs):
        flat = np.concatenate([a[~np.isnan(a)] for a in advs]) if advs else np.zeros(0)
        return comm.sum_vector([len(flat), flat.sum(), (flat * flat).sum()])

    def white(advs):
        return whiten(advs, totals(advs)) if obj.whiten_advantages else advs

    for (mb, pairs), adv in zip(trees, white([p.adv for _, p in trees])):
        set_tree_advantages(mb, pairs, adv)
    if lins:
        advs = [a for _, gae, _ in lins for a, _ in gae]
        it = iter(white(advs))
        for br, gae, vals in lins:
            set_branch_advantages(br, gae, [next(it) for _ in gae], vals)
    if trees:
        vs = np.concatenate([p.value[p.action] for _, p in trees])
        rs = np.concatenate([p.ret[p.action] for _, p in trees])
    else:
        vs = np.concatenate([v[1:][br.masks[b][1:]] for br, _, vals in lins for b, v in enumerate(vals)]) \
            if lins else np.zeros(0)
        rs = np.concatenate([r[1:][br.masks[b][1:]] for br, gae, _ in lins for b, (_, r) in enumerate(gae)]) \
            if lins else np.zeros(0)
    sums = comm.sum_vector(value_sums(vs, rs))
    n = max(float(sums[0]), 1.0)
    return {"critic/explained_variance": explained_variance(sums),
            "critic/values_mean": float(sums[1] - sums[3]) / n,
            "critic/returns_mean": float(sums[1]) / n}


class RouterLoss(StepPart):
    """A mixture-of-experts model's router load-balancing loss (:mod:`treelit.loss.router`),
    normalised over the step: ``coef x`` each pass's tokens' share."""

    name = "router"
    adds = ("router loss",)
    needs = ("token routing of every row token",)
    normalized = True

    def __init__(self, model) -> None:
        self.model = model

    def normalizer(self, mb) -> float:
        return router_normalizer_contribution(self.model, mb)

    def whole_row(self, spec, inner: LossFn, norms) -> LossFn:
        def loss(mb, mode, **kw):  # (both modes alike)
            with router_aux(spec.model, norms.of(self.name)) as aux:
                value, metrics = inner(mb, mode, **kw)
                if aux is not None:
                    value = value + aux.loss()
                    metrics = {**metrics, **aux.metrics()}
            return value, metrics

        return loss

    def pass_parts(self, norms) -> List[PassPart]:
        return [RouterPass(norms.of(self.name))]


class RoutingReplay(StepPart):
    """MoE routing replay: a padding pass (no record) gets an empty routing record (its tokens
    route live)."""

    name = "routing_replay"
    adds = ("recorded token routing",)
    needs = ("token routing per row",)

    def __init__(self, model) -> None:
        self.shape = replay_shape(model)

    def pad(self, mb):
        if mb.token_routing is None:
            s = self.shape
            mb.token_routing = torch.full((mb.num_tokens, s[0], s[2]), -1, dtype=torch.long, device=mb.device)
        return mb


SUMMED_METRICS = ValueHead.summed_metrics


def step_parts(model, objective, *, critic=None, old_logprobs: str = "data", linear_values: bool = False
               ) -> List[StepPart]:
    """The parts of a run, in the order their hooks run (the first part's whole-row loss
    outermost; the pass parts in this order)."""
    parts: List[StepPart] = []
    if has_vision_tower(model):  # first: its micro-batch context holds the others'
        parts.append(ImageEncoder(model))
    if old_logprobs == "rollout":
        parts.append(RolloutLogprobs(objective))
    if hasattr(objective, "_reference_model") and getattr(objective, "reference", None) in ("initial", "base"):
        parts.append(ReferenceModel(objective, model))
    if RouterTerms.enabled(model):
        parts.append(RouterLoss(model))
    if critic is not None:
        parts.append(ValueHead(critic, model, objective, linear_values))
        if critic.trunk is not None and has_vision_tower(critic.trunk):  # a separate critic sees the images
            parts.append(ImageEncoder(critic.trunk))
    if replay_shape(model) is not None:
        parts.append(RoutingReplay(model))
    return parts
