"""``TreeLitModule``: one optimizer step per step batch, exact over its micro-batches.

Optimization is manual: a step's normaliser is computed over all of its
micro-batches (and, under data parallelism, summed over ranks) *before* any of them
is run, then each micro-batch is forwarded and backwarded with that normaliser, so
gradient accumulation gives exactly the gradient of the whole step. ``mode=linear``
runs the same objective per branch (the baseline); ``verify_every=N`` checks on one
micro-batch every N steps that tree mode and linear mode agree (loss and gradient
norm) and logs the relative differences.

Several processes: under DDP the passes issue no collectives and treelit sums the
gradients once per update; under FSDP2 (``ModelParallelStrategy``) the decoder is
sharded per block (:func:`~treelit.utils.distributed.shard_model`) and every pass
gathers and reduces, so every rank runs the same sequence of passes (partitioned
micro-batches are aligned with empty passes, see :mod:`treelit.partition.engine`). An
out-of-memory error on one rank is agreed on by all ranks after the update's passes,
and all retry it with the smaller budget the planner picks. A collective that fails or
times out is reported with the step it happened in.

Before each optimizer step the update is checked: a non-finite loss of some micro-batch (on
any rank) or gradient norm drops it on every rank alike; ``on_nonfinite`` says whether the run
then stops or goes on (:mod:`treelit.lightning.faults`).
"""

from __future__ import annotations

import logging
import math
import resource
import time
from typing import Any, Callable, Dict, Optional

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from treelit import models  # the package face: the compiled layers (torchtune) only with compile=true
from treelit.lightning.data import StepBatch
from treelit.lightning.faults import NonFiniteStep, hold_launched_ranks
from treelit.lightning.planner import MemoryPlanner
from treelit.loss.linear import linear_branch_logprobs
from treelit.loss.router import router_aux, router_normalizer_contribution
from treelit.loss.tree import sft_tree_loss, tree_token_logprobs
from treelit.models.factory import replay_shape
from treelit.models.lora import check_lora_mode, check_reference, lora_of, trainable_state_dict
from treelit.objectives.base import Objective
from treelit.objectives.behavior import split_behavior
from treelit.loss.branches import as_branches
from treelit.models.critic import Critic
from treelit.objectives.critic import (branch_values, check_critic_objective, critic_linear_loss, critic_padding_pass,
                                       critic_tree_loss, prepare_branches, prepare_tree, set_branch_advantages,
                                       set_tree_advantages, tree_values)
from treelit.objectives.folding import fold_spec
from treelit.partition.context_parallel import TRAFFIC, check_cp_backend, check_cp_model, cp_logprobs, cp_micro_batch
from treelit.partition.engine import (MicroBatchResult, PartitionStats, partitioned_values, policy_logprobs,
                                     run_micro_batch)
from treelit.partition.passes import empty_row
from treelit.tree.batch import check_aggregation
from treelit.rl.gae import explained_variance, value_sums, whiten
from treelit.utils.distributed import Collectives, is_sharded, shard_model, shard_module

__all__ = ["TreeLitModule"]

log = logging.getLogger(__name__)


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak RSS (Linux: KiB)


def _is_collective_error(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(k in text for k in ("timed out", "timeout", "gloo", "nccl",
                                                                      "connection closed", "connection reset"))


SUMMED_METRICS = ("critic/value_loss",)  # shares of the step's value (each divided by the step's normaliser)


def add_micro_batch_metrics(acc: Dict[str, float], m: Dict[str, Any], n: int) -> None:
    """Fold one of ``n`` micro-batches' metrics into ``acc``: means over the micro-batches, except
    extremes (``*_max`` / ``*_min``, e.g. ``behavior/ratio_max``, ``adv_min``), which stay extremes,
    and the shares of a step total (:data:`SUMMED_METRICS`), which add up."""
    for k, v in m.items():
        v = float(v)
        if k in SUMMED_METRICS:
            acc[k] = acc.get(k, 0.0) + v
        elif k.endswith("_max"):
            acc[k] = max(acc.get(k, v), v)
        elif k.endswith("_min"):
            acc[k] = min(acc.get(k, v), v)
        else:
            acc[k] = acc.get(k, 0.0) + v / n


class TreeLitModule(pl.LightningModule):
    """Args:
        model: a :class:`~treelit.models.TreeDecoder`.
        objective: an :class:`~treelit.objectives.Objective`.
        optimizer: ``params -> torch.optim.Optimizer`` (a Hydra ``_partial_``).
        scheduler: optional ``optimizer -> LRScheduler`` stepped once per optimizer step.
        attention: attention backend name or instance (``auto`` by default).
        aggregation: loss aggregation mode.
        mode: ``tree`` or ``linear`` (per-branch baseline).
        grad_clip: max gradient norm (0 or None disables clipping; the norm is logged anyway).
        verify_every: every N steps compare tree and linear mode on one micro-batch (0: never).
        chunk_rows: rows per log-prob chunk.
        ppo_epochs: optimizer passes over each step batch (a rollout batch).
        ppo_minibatches: the step batch's micro-batches are split into this many mini-batches,
            one optimizer update each (per PPO epoch).
        old_logprobs: ``data`` (from the records; where missing, the current policy's) or
            ``rollout`` (recomputed in tree mode without gradient before the first update of
            each step batch, so later PPO epochs see true ratios).
        partition: ``none`` or ``redundancy_free`` (trees cut into partitions whose chains fit
            ``budget_tokens``; the :class:`~treelit.lightning.planner.MemoryPlanner` callback
            sets the budget from free memory before each step).
        max_oom_retries: on an out-of-memory error the step is retried with a smaller budget
            (the planner shrinks it) this many times.
        on_nonfinite: ``stop`` or ``skip_step``: what a non-finite loss or gradient norm does
            to the run (the update is never applied; see :meth:`_drop_nonfinite`).
        max_skipped_steps: with ``skip_step``, the run stops when this many consecutive
            updates were dropped.
        critic: a :class:`~treelit.models.critic.Critic` (``objective=ppo``): values and GAE
            advantages are computed before the first update of each step batch
            (:meth:`record_values`) and the value loss joins the policy loss.
        compile: ``False``, ``True`` (inductor) or a ``torch.compile`` backend name: the model's
            layers run compiled (:func:`~treelit.models.compiled.compile_layers`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Optional[Callable[..., Any]] = None,
        attention: Any = "auto",
        aggregation: str = "token-mean",
        mode: str = "tree",
        grad_clip: Optional[float] = 1.0,
        verify_every: int = 0,
        chunk_rows: Optional[int] = None,
        ppo_epochs: int = 1,
        ppo_minibatches: int = 1,
        old_logprobs: str = "data",
        partition: str = "none",
        budget_tokens: Optional[int] = None,
        max_oom_retries: int = 3,
        on_nonfinite: str = "stop",
        max_skipped_steps: int = 10,
        critic: Optional[Critic] = None,
        compile: Any = False,
    ) -> None:
        super().__init__()
        if mode not in ("tree", "linear"):
            raise ValueError(f"mode must be 'tree' or 'linear', got {mode!r}")
        self.model = model
        self.objective = objective
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.attention = attention
        self.aggregation = check_aggregation(aggregation)
        self.mode = mode
        self.grad_clip = 0.0 if grad_clip is None else float(grad_clip)
        self.verify_every = int(verify_every)
        self.chunk_rows = chunk_rows
        if ppo_epochs < 1 or ppo_minibatches < 1:
            raise ValueError("ppo_epochs and ppo_minibatches must be >= 1")
        if old_logprobs not in ("data", "rollout"):
            raise ValueError(f"old_logprobs must be 'data' or 'rollout', got {old_logprobs!r}")
        correction = getattr(objective, "behavior_correction", "none")
        if correction != "none" and old_logprobs != "rollout":
            raise ValueError(f"objective.behavior_correction={correction} compares the sampler's log-probs with the "
                             "trainer's recomputed (proximal) ones: set old_logprobs=rollout")
        self.ppo_epochs = int(ppo_epochs)
        self.ppo_minibatches = int(ppo_minibatches)
        self.old_logprobs = old_logprobs
        if partition not in ("none", "redundancy_free"):
            raise ValueError(f"partition must be 'none' or 'redundancy_free', got {partition!r}")
        if partition != "none":
            fold_spec(objective)  # an objective that cannot run partitioned fails here, before training
            check_cp_backend(attention, f"partition={partition}", "a partition's ancestors in earlier passes")
        self.partition = partition
        check_lora_mode(model, mode)
        check_reference(model, objective)
        if compile not in (False, None):
            models.compile_layers(model, compile)
        self.budget_tokens = budget_tokens
        self.max_oom_retries = int(max_oom_retries)
        if on_nonfinite not in ("stop", "skip_step"):
            raise ValueError(f"on_nonfinite={on_nonfinite} is not a choice: use stop or skip_step")
        if int(max_skipped_steps) < 1:
            raise ValueError(f"max_skipped_steps={max_skipped_steps} must be at least 1")
        self.on_nonfinite = on_nonfinite
        self.max_skipped_steps = int(max_skipped_steps)
        if critic is not None:
            check_critic_objective(objective)
        self.critic = critic
        self._critic_metrics: Dict[str, float] = {}
        self.skipped_steps = 0  # updates dropped as non-finite, in all (checkpointed)
        self.consecutive_skips = 0  # ... since the last applied one (checkpointed)
        self._micro_losses: list = []  # (micro-batch, loss) of the last attempt, for the check
        self._where: Dict[int, tuple] = {}  # id(micro-batch) -> (position, count, its trees)
        self.last_partition_stats = None
        self.automatic_optimization = False

    # multi-process -----------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): shard the decoder per block over the data-parallel
        mesh (:func:`~treelit.utils.distributed.shard_model`; gradients are summed over ranks,
        which with the step-global normaliser is the single-process gradient). A frozen
        reference model (``reference=initial``) is copied before sharding and sharded too."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or is_sharded(self.model):
            return
        if self._cp_degree() > 1:
            check_cp_model(self.model)
            if self.critic is not None and self.critic.trunk is not None:
                check_cp_model(self.critic.trunk)
            check_cp_backend(self.attention)
        if self.mode != "tree" or self.verify_every:
            raise ValueError("under FSDP2 every rank must run the same passes: mode=linear and verify_every "
                             "(per-branch passes whose number differs between ranks) need trainer=cpu or trainer=ddp_cpu/ddp")
        dp = mesh["data_parallel"]
        policy = getattr(self, "fsdp_mp_policy", None)  # library use; under Lightning, the strategy's
        if policy is None and self._trainer is not None:
            policy = getattr(self.trainer.strategy, "treelit_mp_policy", None)
        if hasattr(self.objective, "_reference_model") and getattr(self.objective, "reference", None) == "initial":
            shard_model(self.objective._reference_model(self.model), dp, mp_policy=policy)
        shard_model(self.model, dp, mp_policy=policy)
        if self.critic is not None:  # the critic's own model per block like the policy; the head as one unit
            if self.critic.trunk is not None:
                shard_model(self.critic.trunk, dp, mp_policy=policy)
            shard_module(self.critic.head, dp, mp_policy=policy)

    def _fsdp(self) -> bool:
        return is_sharded(self.model)

    def _cp_degree(self) -> int:
        """C of context parallelism (the ranks of a group split each tree's row), 1 when off."""
        group = getattr(self, "_cp_group", None)
        return dist.get_world_size(group) if group is not None else 1

    def _comm(self) -> Collectives:
        """The data-parallel ranks (the trainer's; without one, the initialised process group)."""
        if self._trainer is not None:
            return Collectives(self.trainer.world_size, self.device)
        return Collectives(device=self.device)

    # LoRA checkpoints: the trained parameters only -------------------------------------------
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        """With LoRA adapters a checkpoint holds the adapters and ``modules_to_save`` (and, through
        the optimizer, their state): the frozen base comes from ``model.hf_checkpoint`` again."""
        if lora_of(self.model) is not None and isinstance(checkpoint.get("state_dict"), dict):
            checkpoint["state_dict"] = trainable_state_dict(self.model, checkpoint["state_dict"])
            checkpoint["treelit_lora"] = dict(lora_of(self.model))
        checkpoint["treelit_nonfinite"] = {"skipped": self.skipped_steps, "consecutive": self.consecutive_skips}

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        counts = checkpoint.get("treelit_nonfinite") or {}
        self.skipped_steps = int(counts.get("skipped", 0))
        self.consecutive_skips = int(counts.get("consecutive", 0))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A LoRA model loads its adapters (every one must be there) and leaves its base as built."""
        if lora_of(self.model) is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        own = self.state_dict()
        wanted = set(trainable_state_dict(self.model, own))
        missing, unknown = sorted(wanted - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unknown:
            what = f"no {missing[0]}" if missing else f"{unknown[0]}, which this model does not have"
            raise ValueError(f"resume_from: the checkpoint does not match this model's LoRA adapters ({what}): "
                             "resume with the run's own model.lora options")
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def on_train_start(self) -> None:
        wrapped = getattr(self.trainer.strategy, "model", None)
        if isinstance(wrapped, DistributedDataParallel):
            # Several forward/backward passes per update (micro-batches, partitions): DDP's own
            # per-backward reduction would run too early and too often. treelit sums the
            # gradients itself once per update (sync_gradients), the same number of times on
            # every rank whatever its number of passes.
            wrapped.require_backward_grad_sync = False

    def configure_optimizers(self):
        # the trained parameters only: a frozen base (LoRA) gets no optimizer state
        policy = [p for p in self.model.parameters() if p.requires_grad]
        if self.critic is None:
            opt = self.optimizer_factory(policy)
        else:  # the critic's parameters are a group of their own (critic.lr; null: the optimizer's)
            group = {"params": [p for p in self.critic.parameters() if p.requires_grad], "name": "critic"}
            if self.critic.lr is not None:
                group["lr"] = self.critic.lr
            opt = self.optimizer_factory([{"params": policy, "name": "policy"}, group])
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}

    # one optimizer step ---------------------------------------------------------------------
    def step_normalizer(self, micro_batches) -> float:
        if self.aggregation == "sum":
            return 1.0
        # padding micro-batches (no targets) contribute nothing, whatever fields an objective reads
        Z = float(sum(self.objective.norm_contribution(b, self.aggregation) for b in micro_batches if b.num_targets))
        return self._comm().sum(Z) / self._cp_degree()  # a context-parallel group's ranks hold the same trees

    def router_normalizer(self, micro_batches) -> float:
        """The step's router-loss normaliser for a mixture-of-experts model (see
        :mod:`treelit.loss.router`): micro-batches (``micro_batch``) or branches (``sequence``)
        over the step's micro-batches with targets, summed over ranks (a context-parallel group's
        ranks hold the same trees: counted once)."""
        R = float(sum(router_normalizer_contribution(self.model, b) for b in micro_batches if b.num_targets))
        return self._comm().sum(R) / self._cp_degree()

    def micro_loss(self, mb, Z: float, mode: Optional[str] = None, R: Optional[float] = None):
        kw = dict(aggregation=self.aggregation, normalizer=Z, chunk_rows=self.chunk_rows)
        if not mb.num_targets and (mode or self.mode) == "tree":
            # a padding micro-batch: one pass through the model (the other ranks' collectives), loss 0
            mb = self._unrouted(mb)
            loss = sft_tree_loss(self.model, mb, self.aggregation, self.attention, normalizer=1.0)
            if self.critic is not None:  # ... and through the critic (its sharded parts are collectives too)
                loss = loss + 0.0 * critic_padding_pass(self.critic, self.model, mb, self.attention)
            return loss, {}
        with router_aux(self.model, R) as aux:  # MoE models: + coef x router loss (both modes alike)
            if self.critic is not None and (mode or self.mode) == "tree":
                loss, metrics = critic_tree_loss(self.objective, self.critic, self.model, mb, attention=self.attention,
                                                 **kw)
            elif self.critic is not None:
                branches = mb.source_branches if mb.source_branches is not None else mb
                loss, metrics = critic_linear_loss(self.objective, self.critic, self.model, branches, **kw)
            elif (mode or self.mode) == "tree":
                loss, metrics = self.objective.tree_loss(self.model, mb, attention=self.attention, **kw)
            else:  # per branch, from the records' branches (not read back from the tree)
                branches = mb.source_branches if mb.source_branches is not None else mb
                loss, metrics = self.objective.linear_loss(self.model, branches, **kw)
            if aux is not None:
                loss = loss + aux.loss()
                metrics = {**metrics, **aux.metrics()}
        return loss, metrics

    @torch.no_grad()
    def record_rollout_logprobs(self, micro_batches) -> None:
        """Set each micro-batch's old log-probs to the current policy's (no grad; in tree mode on
        the tree, partitioned like training when ``partition`` is on; in linear mode branch by
        branch on the records' branches). The other form of the micro-batch gets the same values
        (they are the rollout's inputs, not what is being compared)."""
        keep_behavior = getattr(self.objective, "behavior_correction", "none") != "none"
        for mb in micro_batches:
            br = mb.source_branches
            if keep_behavior:  # the records' (sampler's) log-probs stay as behaviour log-probs
                split_behavior(mb)
                if br is not None:
                    split_behavior(br)
            if self.mode == "linear" and br is not None:
                lps, _ = linear_branch_logprobs(self.model, br.tokens, chunk_rows=self.chunk_rows, routing=br.routing)
                br.old = [np.concatenate([[np.nan], lp.double().cpu().numpy()]) for lp in lps]
                flat = torch.from_numpy(np.concatenate(br.old)).to(mb.device)
                mb.branch_old_logp = flat
                old = torch.full((mb.num_tokens,), float("nan"), dtype=torch.float64, device=mb.device)
                old[mb.branch_tokens] = flat
                mb.token_old_logp = old
                continue
            if self._cp_degree() > 1 and self.partition != "none":
                old = policy_logprobs(self.model, mb, budget_tokens=self.budget_tokens, attention=self.attention,
                                      chunk_rows=self.chunk_rows, comm=self._comm(), cp_group=self._cp_group)
            elif self._cp_degree() > 1:
                old = cp_logprobs(self.model, mb, self._cp_group, attention=self.attention, chunk_rows=self.chunk_rows)
            elif self.partition != "none":
                old = policy_logprobs(self.model, mb, budget_tokens=self.budget_tokens, attention=self.attention,
                                      chunk_rows=self.chunk_rows, comm=self._comm())
            else:
                sel, logp, _ = tree_token_logprobs(self.model, mb, self.attention, chunk_rows=self.chunk_rows)
                old = torch.full((mb.num_tokens,), float("nan"), dtype=torch.float64, device=mb.device)
                old[sel] = logp.double()
            mb.token_old_logp = old
            mb.branch_old_logp = old[mb.branch_tokens]
            if br is not None:
                ptr = mb.branch_ptr.cpu().numpy()
                flat = mb.branch_old_logp.cpu().numpy()
                br.old = [flat[ptr[b]: ptr[b + 1]] for b in range(len(ptr) - 1)]

    @torch.no_grad()
    def record_values(self, micro_batches) -> None:
        """Values and GAE advantages of the step batch, before its first update: the critic's
        values of every target token (one tree pass per micro-batch, or per branch in
        ``mode=linear``), GAE per (branch, action) pair, whitened over the whole step (every
        micro-batch, every rank) with ``objective.whiten_advantages``. Sets what the losses read
        and the step's ``critic/explained_variance``, ``critic/values_mean`` and
        ``critic/returns_mean`` (over the action pairs of every rank)."""
        obj, comm = self.objective, self._comm()
        linear = self.mode == "linear" or bool(self.verify_every)
        trees, lins = [], []
        cp = self._cp_degree() > 1
        for mb in micro_batches:
            if not mb.num_targets and not self._fsdp():
                continue  # (under FSDP2 a padding micro-batch's pass keeps the other ranks' collectives company)
            if self.mode == "tree" and (self.partition != "none" or cp):
                trunk = self.model if self.critic.kind == "shared" else self.critic.trunk
                v = partitioned_values(trunk, self.critic, mb, attention=self.attention, comm=comm,
                                       budget_tokens=self.budget_tokens if self.partition != "none" else None,
                                       cp_group=getattr(self, "_cp_group", None))
            elif self.mode == "tree":
                v = tree_values(self.critic, self.model, mb, self.attention)
            if not mb.num_targets:
                continue
            if self.mode == "tree":
                trees.append((mb, prepare_tree(mb, v, obj.gamma, obj.lam)))
            if linear:
                if mb.source_branches is None:
                    mb.source_branches = as_branches(mb)
                br = mb.source_branches
                vals = branch_values(self.critic, self.model, br)
                lins.append((br, prepare_branches(br, vals, obj.gamma, obj.lam), vals))

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
        self._critic_metrics = {"critic/explained_variance": explained_variance(sums),
                                "critic/values_mean": float(sums[1] - sums[3]) / n,
                                "critic/returns_mean": float(sums[1]) / n}

    def _backward(self, loss: torch.Tensor) -> None:
        if self._fsdp():
            loss.backward()  # FSDP2 sums the gradients over ranks (divide factor 1)
        elif self._distributed() or self._trainer is None:
            loss.backward()  # gradients are summed across ranks once per update (sync_gradients)
        else:
            self.manual_backward(loss)

    def _distributed(self) -> bool:
        return self._comm().distributed

    def sync_gradients(self) -> None:
        """Sum gradients over ranks, once per update. The loss is already divided by the
        step-global normaliser, so the sum is exactly the single-process gradient. Every
        rank issues the same collectives whatever its number of partitions or passes."""
        if not self._distributed() or self._fsdp():
            return
        params = self._trained_parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # buckets of ~16 MiB: few collectives, and never a second copy of all the gradients
        limit = max(1, (16 << 20) // max(1, params[0].element_size())) if params else 1
        bucket: list = []
        size = 0
        for i, p in enumerate(params):
            bucket.append(p)
            size += p.numel()
            if size >= limit or i == len(params) - 1:
                flat = torch.cat([q.grad.reshape(-1) for q in bucket]) if len(bucket) > 1 else bucket[0].grad
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                if len(bucket) > 1:
                    off = 0
                    for q in bucket:
                        q.grad.copy_(flat[off : off + q.numel()].view_as(q))
                        off += q.numel()
                bucket, size = [], 0

    def _trained_parameters(self) -> list:
        """The parameters the optimizer steps: the policy's trained ones, then the critic's."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.critic is not None:
            params += [p for p in self.critic.parameters() if p.requires_grad]
        return params

    def _zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.zero_grad(set_to_none=True)

    def _clip_groups(self) -> list:
        """Parameter groups whose gradient norm is clipped on its own: the policy (with a shared
        critic's head, which trains on the same loss) and a separate critic."""
        policy = [p for p in self.model.parameters() if p.grad is not None]
        if self.critic is None:
            return [policy]
        critic = [p for p in self.critic.parameters() if p.grad is not None]
        return [policy + critic] if self.critic.kind == "shared" else [policy, critic]

    def _update(self, micro_batches) -> Dict[str, float]:
        """Forward and backward every micro-batch with the shared normaliser, then one step."""
        planner = next((c for c in (self.trainer.callbacks if self._trainer is not None else [])
                        if isinstance(c, MemoryPlanner)), None)
        out = self.compute_gradients(micro_batches, planner)
        opt = self.optimizers()
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norms = []
        for params in self._clip_groups():
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        grad_norm = norms[0]
        if len(norms) > 1:
            out = {**out, "critic/grad_norm": norms[1]}
            if not math.isfinite(norms[1]):
                grad_norm = norms[1]  # a non-finite critic gradient drops the update like the policy's
        if self._drop_nonfinite(micro_batches, grad_norm):
            opt.zero_grad(set_to_none=True)
            return {**out, "grad_norm": grad_norm}
        opt.step()
        opt.zero_grad(set_to_none=True)
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()
        self.consecutive_skips = 0
        return {**out, "grad_norm": grad_norm}

    # non-finite updates --------------------------------------------------------------------------
    def _drop_nonfinite(self, micro_batches, grad_norm: float) -> bool:
        """True when this update must not be applied: the loss of a micro-batch (on any rank) or
        the gradient norm is not finite. One all-reduce; every rank gets the same answer. The
        caller then clears the gradients and takes no optimizer or scheduler step (the optimizer
        state stays as it was). ``on_nonfinite=stop``, or a run of ``max_skipped_steps`` dropped
        updates, raises :class:`~treelit.lightning.faults.NonFiniteStep` with one line naming the
        step, the micro-batch and its trees; ``skip_step`` logs the dropped update and goes on."""
        mine = [(mb, v) for mb, v in self._micro_losses if not math.isfinite(v)]
        comm = self._comm()
        if not comm.max(float(bool(mine) or not math.isfinite(grad_norm))):
            return False
        report = self._nonfinite_report(micro_batches, mine, grad_norm, comm)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.on_nonfinite == "stop":
            hold_launched_ranks(self._trainer)
            raise NonFiniteStep(f"{report}; the update was not applied and nothing was saved (on_nonfinite=stop; "
                                "on_nonfinite=skip_step drops such updates and goes on)")
        if self.consecutive_skips >= self.max_skipped_steps:
            self._log_skipped_now()  # the step's own log never comes: the last dropped update counts too
            hold_launched_ranks(self._trainer)
            raise NonFiniteStep(f"{report}; {self.consecutive_skips} updates in a row were dropped "
                                f"(max_skipped_steps={self.max_skipped_steps}): stopping, nothing of them applied")
        if comm.rank == 0:
            log.warning("%s; the update was dropped (on_nonfinite=skip_step: %d in a row, %d in all)", report,
                        self.consecutive_skips, self.skipped_steps)
        return True

    def _log_skipped_now(self) -> None:
        """``train/skipped_steps`` straight to the loggers (rank 0), at this step's index."""
        if self._trainer is None or not self.trainer.is_global_zero:
            return
        for lg in self.trainer.loggers:
            lg.log_metrics({"train/skipped_steps": float(self.skipped_steps)}, step=max(self.global_step - 1, 0))
            lg.save()

    def _nonfinite_report(self, micro_batches, mine, grad_norm: float, comm: Collectives) -> str:
        """One line, the same on every rank: the step, what was not finite, and each micro-batch
        that made it so with its trees (``id (file:line)``), on every rank. When every loss is
        finite but the gradient norm is not, each micro-batch's gradient is computed again on its
        own to find those whose gradient is not finite (every rank runs the same passes)."""
        what = [] if math.isfinite(grad_norm) else [f"gradient norm {grad_norm}"]
        if comm.max(float(bool(mine))):
            what.insert(0, "loss")
            parts = [self._describe(mb, f"loss {v}", comm) for mb, v in mine]
        else:
            parts = [self._describe(mb, "its gradient alone is not finite", comm)
                     for mb in self._nonfinite_gradients(micro_batches, comm)]
        text = "; ".join(parts)
        every = comm.gather_lists(list(text.encode("utf-8"))) if comm.distributed else [list(text.encode("utf-8"))]
        found = "; ".join(p for p in (bytes(b).decode("utf-8", "replace") for b in every) if p)
        data = getattr(self, "_data_step", None)
        step = f"step {self.global_step + 1}"
        if data is not None and data != self.global_step:
            step += f" (data step {data + 1})"
        return f"{step}: non-finite {' and '.join(what)} - " + (found or "no single micro-batch reproduces it alone")

    def _describe(self, mb, why: str, comm: Collectives) -> str:
        pos, count, trees = self._where.get(id(mb), (None, None, None))
        where = f"micro-batch {pos + 1} of {count}" if pos is not None else "a micro-batch"
        if comm.distributed:
            where += f" on rank {comm.rank}"
        if trees is None:
            return f"{where} ({why})"
        if not trees:
            return f"{where} ({why}): an empty pass"
        return f"{where} ({why}): tree{'s' if len(trees) != 1 else ''} {', '.join(trees)}"

    def _nonfinite_gradients(self, micro_batches, comm: Collectives) -> list:
        """The micro-batches whose gradient, computed on its own, is not finite (the gradients
        are cleared before and after). Under FSDP2 a gradient is the ranks' sum: a micro-batch
        position found there names that position on every rank."""
        Z, R = getattr(self, "_normalizers", (1.0, None))
        found = []
        if getattr(self, "_cp_group", None) is not None:  # a row split over ranks: not recomputed whole
            return found
        for mb in micro_batches:
            self._zero_grad()
            if self.partition != "none" and self.mode == "tree":
                self._partitioned(mb, Z, comm, R)
            else:
                loss, _ = self.micro_loss(mb, Z, R=R)
                self._backward(loss)
            bad = any(not bool(torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all())
                      for g in (p.grad for p in self._trained_parameters()) if g is not None)
            if (comm.max(float(bad)) if self._fsdp() else bad):
                found.append(mb)
        self._zero_grad()
        return found

    def _partitioned(self, mb, Z: float, comm: Collectives, R: Optional[float], stats=None, failed: bool = False,
                     cp_group=None):
        """One micro-batch through the partition engine: the policy (with a shared critic's value
        loss folded into its passes), then a separate critic's trunk with its value loss.
        ``cp_group``: each pass split over its ranks (context parallelism; with ``partition=none``
        the whole row is one pass)."""
        shared = self.critic is not None and self.critic.kind == "shared"
        budget = self.budget_tokens if self.partition != "none" else None
        res = run_micro_batch(self.model, self.objective, mb, aggregation=self.aggregation, normalizer=Z,
                              budget_tokens=budget, attention=self.attention, chunk_rows=self.chunk_rows,
                              stats=stats, comm=comm, failed=failed, router_normalizer=R,
                              critic=self.critic if shared else None, cp_group=cp_group)
        if self.critic is None or shared:
            return res
        crit = run_micro_batch(self.critic.trunk, None, mb, aggregation=self.aggregation, normalizer=Z,
                               budget_tokens=budget, attention=self.attention, stats=stats, comm=comm,
                               failed=failed or res.failed, critic=self.critic, critic_only=True, cp_group=cp_group)
        return MicroBatchResult(res.loss + crit.loss, {**res.metrics, **crit.metrics}, res.failed or crit.failed)

    def compute_gradients(self, micro_batches, planner=None) -> Dict[str, float]:
        """The update's gradients in ``.grad`` (summed over ranks; sharded under FSDP2) and its
        loss and metrics. On an out-of-memory error (on any rank: the ranks agree after the
        passes) the gradients are cleared and every rank retries with the smaller partition
        budget the ``planner`` picks: the result is that of an undisturbed update."""
        Z = self.step_normalizer(micro_batches)
        R = self.router_normalizer(micro_batches)
        self._normalizers = (Z, R)
        comm = self._comm()
        for attempt in range(self.max_oom_retries + 1):
            out = self._accumulate(micro_batches, Z, comm, R)
            if out is not None:
                return out
            self._zero_grad()
            if attempt == self.max_oom_retries or planner is None:
                raise torch.OutOfMemoryError(
                    f"out of memory at step {self.global_step} with a partition budget of {self.budget_tokens} tokens"
                    + ("" if planner is None else f" after {attempt} retries") + " (callbacks=planner retries with smaller budgets)"
                )
            self.budget_tokens = planner.shrink(self, micro_batches)
            log.warning("out of memory: retrying the update with a budget of %s tokens", self.budget_tokens)
        raise AssertionError("unreachable")

    def _accumulate(self, micro_batches, Z: float, comm: Collectives, R: Optional[float] = None
                    ) -> Optional[Dict[str, float]]:
        """One attempt; None when some rank ran out of memory (gradients then unusable)."""
        total = 0.0
        metrics: Dict[str, float] = {}
        stats = PartitionStats()
        failed = False
        self._micro_losses = []
        cp = self._cp_degree()
        for mb in micro_batches:
            if cp > 1 and self.mode == "tree" and (self.partition != "none" or self.critic is not None):
                res = self._partitioned(mb, Z, comm, R, stats=stats, cp_group=self._cp_group)
                loss_value, m = res.loss / cp, res.metrics  # (every rank of the group holds the whole loss)
                if "critic/value_loss" in m:  # (... and the whole value loss: the step sums over ranks)
                    m = {**m, "critic/value_loss": m["critic/value_loss"] / cp}
            elif cp > 1:
                loss_value, m, plan = cp_micro_batch(self.model, self.objective, mb, self._cp_group,
                                                     aggregation=self.aggregation, normalizer=Z,
                                                     attention=self.attention, chunk_rows=self.chunk_rows,
                                                     router_normalizer=R)
                loss_value /= cp  # every rank of the group holds the whole loss; the step sums over ranks
                stats.cp_max_cost += float(plan.work.max())
                stats.cp_mean_cost += float(plan.work.mean())
                stats.cp_score_pairs = max(stats.cp_score_pairs, plan.size * len(plan.path))
                stats.partitions += 1
                stats.token_forwards += plan.size
            elif self.partition != "none" and self.mode == "tree":
                res = self._partitioned(mb, Z, comm, R, stats=stats, failed=failed)
                failed = failed or res.failed
                loss_value, m = res.loss, res.metrics
            else:
                loss, m = self.micro_loss(mb, Z, R=R)
                self._backward(loss)
                loss_value = float(loss.detach())
                stats.partitions += 1
                stats.token_forwards += mb.num_tokens
            total += loss_value
            self._micro_losses.append((mb, float(loss_value)))
            add_micro_batch_metrics(metrics, m, len(micro_batches))
        if self.partition != "none" and comm.max(float(failed)) > 0:
            return None
        self.last_partition_stats = stats
        self.sync_gradients()
        extra = {"partitions": float(stats.partitions), "token_forwards": float(stats.token_forwards),
                 "extra_forwards": float(stats.extra_forwards), "empty_passes": float(stats.empty_passes)}
        if self.budget_tokens is not None:
            extra["budget_tokens"] = float(self.budget_tokens)
        if cp > 1:
            extra.update(self._cp_metrics(stats))
        return {"loss": total, **extra, **metrics}

    def _cp_metrics(self, stats: PartitionStats) -> Dict[str, float]:
        """What context parallelism cost this update, for each rank of this rank's group:
        ``cp/received_bytes/rank{r}`` (the bytes it received: path K/V, recurrent states and
        convolution inputs, their gradients, and partitioned passes' all-reduced boundary states
        and ancestor K/V assemblies, since the last update's figure: this step's values and
        rollout passes included) and
        ``cp/peak_bytes/rank{r}`` (its peak memory, as ``peak_mem_bytes``), their maxima, and
        ``cp/imbalance`` (the passes' most loaded rank's cost over the mean, minus 1)."""
        mine = torch.tensor([float(TRAFFIC.take()), float(_peak_memory_bytes(self.device))], dtype=torch.float64,
                            device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self._cp_degree())]
        dist.all_gather(every, mine, group=self._cp_group)
        out = {"cp/imbalance": stats.cp_imbalance}
        for r, t in enumerate(every):
            out[f"cp/received_bytes/rank{r}"] = float(t[0])
            out[f"cp/peak_bytes/rank{r}"] = float(t[1])
        out["cp/received_bytes_max"] = max(float(t[0]) for t in every)
        out["cp/peak_bytes_max"] = max(float(t[1]) for t in every)
        return out

    def training_step(self, batch: StepBatch, batch_idx: int):
        try:
            return self._training_step(batch)
        except NonFiniteStep:
            raise
        except Exception as exc:  # name the step when a collective fails or times out
            if not self._distributed() or not _is_collective_error(exc):
                raise
            comm = self._comm()
            raise RuntimeError(
                f"step {self.global_step} (data step {batch.index}), rank {comm.rank} of {comm.world}: a "
                f"collective failed or timed out - the ranks issued different collectives, or one rank stopped "
                f"(see the other ranks' errors). {type(exc).__name__}: {exc}"
            ) from exc

    def _same_count_on_every_rank(self, micro_batches):
        """Under FSDP2 every pass is a collective: ranks run the same number of micro-batches
        (a rank with fewer gets empty ones, whatever the data module gave it)."""
        comm = self._comm()
        if not (comm.distributed and self._fsdp()):
            return list(micro_batches)
        n = int(comm.max(len(micro_batches)))
        return list(micro_batches) + [self._unrouted(empty_row(self.device)) for _ in range(n - len(micro_batches))]

    def _unrouted(self, mb):
        """A padding pass under MoE routing replay: an empty record (its tokens route live)."""
        shape = replay_shape(self.model)
        if shape is not None and mb.token_routing is None:
            mb.token_routing = torch.full((mb.num_tokens, shape[0], shape[2]), -1, dtype=torch.long, device=mb.device)
        return mb

    def _reward_metrics(self, batch: StepBatch) -> Dict[str, float]:
        """``reward/mean``, ``reward/min``, ``reward/max`` of the step's branches that carry a reward,
        over every rank (nothing when no branch of the step has one)."""
        rewards = [float(r) for mb in batch.micro_batches
                   for r in (getattr(mb, "branch_fields", {}) or {}).get("reward") or () if r is not None]
        comm = self._comm()
        n = comm.sum(len(rewards))
        if not n:
            return {}
        return {"reward/mean": comm.sum(sum(rewards)) / n,
                "reward/min": comm.min(min(rewards) if rewards else float("inf")),
                "reward/max": comm.max(max(rewards) if rewards else float("-inf"))}

    def _training_step(self, batch: StepBatch):
        t0 = time.perf_counter()
        micro = self._same_count_on_every_rank(batch.micro_batches)
        origins = list(batch.origins) if batch.origins is not None else [None] * len(batch.micro_batches)
        origins += [[] for _ in range(len(micro) - len(origins))]  # the empty passes added above
        self._where = {id(mb): (i, len(micro), o) for i, (mb, o) in enumerate(zip(micro, origins))}
        self._data_step = batch.index
        if self.old_logprobs == "rollout":
            self.record_rollout_logprobs(micro)
        if self.critic is not None:
            self.record_values(micro)
        k = min(self.ppo_minibatches, len(micro))
        bounds = [round(i * len(micro) / k) for i in range(k + 1)]
        groups = [micro[bounds[i] : bounds[i + 1]] for i in range(k)]
        updates = [self._update(g) for _ in range(self.ppo_epochs) for g in groups]
        if self.trainer is not None and getattr(self.trainer, "datamodule", None) is not None:
            self.trainer.datamodule.consumed_steps = batch.index + 1
        dt = max(time.perf_counter() - t0, 1e-9)
        last = updates[-1]
        tree_tok, flat_tok = batch.tree_tokens, batch.flat_tokens
        loss = sum(u["loss"] for u in updates[: len(groups)])  # the step's loss before any update
        loss = self._comm().sum(loss)  # each rank holds its trees' share (divided by the global Z)
        # One step axis, the optimizer step's: this step's metrics at the index of its last optimizer
        # step (k - 1 for step k), where the callbacks log too. Lightning's default axis counts data
        # steps, which ppo_epochs / ppo_minibatches > 1 turn into several optimizer steps each.
        self.log_dict({"step": float(self.global_step - 1), "epoch": float(self.current_epoch)})
        self.log("loss", loss, prog_bar=True)
        self.log_dict(
            {
                "lr": self.optimizers().param_groups[0]["lr"],
                "tree_tokens": float(tree_tok),
                "flat_tokens": float(flat_tok),
                "por": 1.0 - tree_tok / max(flat_tok, 1),
                # tokens no longer shared because branches disagreed on their old log-probs or routing
                "tree/shared_tokens_lost": float(getattr(batch, "shared_tokens_lost", 0)),
                "micro_batches": float(len(micro)),
                "load_imbalance": float(batch.load_imbalance),
                "peak_mem_bytes": float(_peak_memory_bytes(self.device)),
                **{k: v for k, v in last.items() if k not in ("loss",) + SUMMED_METRICS},
            }
        )
        if self.critic is not None:  # the value loss of the step's first update, summed over the ranks
            first = [u.get("critic/value_loss", 0.0) for u in updates[: len(groups)]]
            self.log_dict({"critic/value_loss": self._comm().sum(sum(first)), **self._critic_metrics})
        self.log_dict({"tree_tok/s": tree_tok / dt, "flat_tok/s": flat_tok / dt}, prog_bar=True)
        if self.on_nonfinite == "skip_step":
            self.log("train/skipped_steps", float(self.skipped_steps))
        if getattr(self.objective, "name", "sft") != "sft":  # (every rank: the same collectives)
            self.log_dict(self._reward_metrics(batch))
        data_metrics = getattr(getattr(self.trainer, "datamodule", None), "step_metrics", None) if self._trainer else None
        if data_metrics:  # e.g. rollout staleness (treelit.lightning.staleness)
            self.log_dict(data_metrics)
        if self.verify_every and (self.global_step % self.verify_every == 0):
            self.log_dict(self.verify(micro[0], self.step_normalizer(micro), self.router_normalizer(micro)))
        return torch.tensor(loss)

    # self-verification ------------------------------------------------------------------------
    def verify(self, mb, Z: float, R: Optional[float] = None) -> Dict[str, float]:
        """Tree vs linear on one micro-batch: relative difference of loss and gradient norm.

        Gradients are taken with ``torch.autograd.grad`` so that ``.grad`` is untouched.
        """
        params = self._trained_parameters()

        def run(mode):
            t0 = time.perf_counter()
            loss, _ = self.micro_loss(mb, Z, mode, R)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
            return float(loss.detach()), float(norm), grads, time.perf_counter() - t0

        lt, nt, gt, tt = run("tree")
        ll, nl, gl, tl = run("linear")
        diff = torch.sqrt(
            sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(gt, gl) if a is not None and b is not None)
        )
        out = {
            "verify/loss_rel_diff": abs(lt - ll) / max(abs(ll), 1e-30),
            "verify/grad_norm_rel_diff": abs(nt - nl) / max(nl, 1e-30),
            "verify/grad_rel_diff": float(diff) / max(nl, 1e-30),
            "verify/speedup": tl / max(tt, 1e-9),  # measured: linear / tree forward+backward time
        }
        log.info("self-verification at step %d: loss rel diff %.1e, gradient rel diff %.1e, gradient-norm rel diff "
                 "%.1e (tree vs per-branch; %.2fx faster)", self.global_step, out["verify/loss_rel_diff"],
                 out["verify/grad_rel_diff"], out["verify/grad_norm_rel_diff"], out["verify/speedup"])
        return out
