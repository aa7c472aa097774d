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
import time
from typing import Any, Callable, Dict, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from treelit import models  # the package face: the compiled layers (torchtune) only with compile=true
from treelit.lightning.data import StepBatch
from treelit.lightning.executors import (Executor, Norms, StepSpec, UpdateStep, choose_executor, peak_memory_bytes,
                                         whole_row_loss)
from treelit.lightning.faults import NonFiniteStep
from treelit.lightning.nonfinite import NonFiniteChecks
from treelit.lightning.parts import SUMMED_METRICS, RolloutLogprobs, step_parts
from treelit.lightning.planner import MemoryPlanner
from treelit.loss.router import router_normalizer_contribution
from treelit.models.lora import check_lora_mode, check_reference, lora_of, trainable_state_dict
from treelit.objectives.base import Objective
from treelit.models.critic import Critic
from treelit.objectives.folding import fold_spec
from treelit.partition.context_parallel import check_cp_backend, check_cp_model
from treelit.partition.engine import PartitionStats, PassState
from treelit.partition.passes import empty_row
from treelit.tree.batch import check_aggregation
from treelit.utils.distributed import Collectives, is_sharded, shard_model

__all__ = ["TreeLitModule"]

log = logging.getLogger(__name__)


_peak_memory_bytes = peak_memory_bytes


def _is_collective_error(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(k in text for k in ("timed out", "timeout", "gloo", "nccl",
                                                                      "connection closed", "connection reset"))


# SUMMED_METRICS (treelit.lightning.parts): shares of the step's value (each divided by the step's normaliser)


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


class TreeLitModule(NonFiniteChecks, pl.LightningModule):
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
            advantages are computed before the first update of each step batch and the value
            loss joins the policy loss (:class:`~treelit.lightning.parts.ValueHead`).
        compile: ``False``, ``True`` (inductor) or a ``torch.compile`` backend name: the model's
            layers run compiled (:func:`~treelit.models.compiled.compile_layers`).

    The step runs each micro-batch through one executor, chosen once from the configuration
    (:attr:`executor`, :mod:`treelit.lightning.executors`), which calls the run's step parts
    (:attr:`parts`, :mod:`treelit.lightning.parts`): the step itself names no feature.
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
        self.critic = critic  # (a submodule: its parameters are the module's, checkpoints included)
        self.parts = step_parts(model, objective, critic=critic, old_logprobs=old_logprobs,
                                linear_values=mode == "linear" or bool(verify_every))
        self._executor: Optional[Executor] = None
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
        self._executor = None
        _ = self.executor  # chosen here, once (the strategy has set the context-parallel group)
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or is_sharded(self.model):
            return
        if self._cp_degree() > 1:
            check_cp_model(self.model)
        for part in self.parts:
            part.configure(self._cp_degree())
        if self._cp_degree() > 1:
            check_cp_backend(self.attention)
        if self.mode != "tree" or self.verify_every:
            raise ValueError("under FSDP2 every rank must run the same passes: mode=linear and verify_every "
                             "(per-branch passes whose number differs between ranks) need trainer=cpu or trainer=ddp_cpu/ddp")
        dp = mesh["data_parallel"]
        policy = getattr(self, "fsdp_mp_policy", None)  # library use; under Lightning, the strategy's
        if policy is None and self._trainer is not None:
            policy = getattr(self.trainer.strategy, "treelit_mp_policy", None)
        shard_model(self.model, dp, mp_policy=policy)
        for part in self.parts:  # (a frozen reference copy, a critic's own model and head)
            part.shard(dp, policy)

    @property
    def executor(self) -> Executor:
        """How each micro-batch runs (:func:`~treelit.lightning.executors.choose_executor`),
        chosen once: at set-up (:meth:`configure_model`) or, in library use, at the first step."""
        if self._executor is None or self._executor.spec.cp_group is not getattr(self, "_cp_group", None):
            spec = StepSpec(self.model, self.objective, self.attention, self.aggregation, self.chunk_rows, self.mode,
                            getattr(self, "_cp_group", None), self._backward)
            self._executor = choose_executor(spec, self.parts, self.partition)
        return self._executor

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
        groups = [g for part in self.parts for g in part.param_groups()]  # e.g. the critic's, with its lr
        opt = self.optimizer_factory([{"params": policy, "name": "policy"}, *groups] if groups else policy)
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

    def normalizers(self, micro_batches) -> Norms:
        """The update's normalisers: the objective's and each part's that has one (e.g. the
        router loss's: :meth:`router_normalizer`), summed over ranks."""
        comm, cp = self._comm(), self._cp_degree()
        by_part = {}
        for part in self.parts:
            if part.normalized:
                share = float(sum(part.normalizer(b) for b in micro_batches if b.num_targets))
                by_part[part.name] = comm.sum(share) / cp
        return Norms(self.step_normalizer(micro_batches), by_part)

    def _norms(self, Z, R: Optional[float] = None) -> Norms:
        """``Z`` as :class:`Norms` (a float ``Z`` and ``R``: the objective's and the parts' one)."""
        if isinstance(Z, Norms):
            return Z
        return Norms(Z, {part.name: R for part in self.parts if part.normalized})

    def micro_loss(self, mb, Z, mode: Optional[str] = None, R: Optional[float] = None):
        """One micro-batch's whole-row loss (tree, or per branch with ``mode=linear``) and metrics."""
        return whole_row_loss(self.executor.spec, self.parts, mb, self._norms(Z, R), mode)

    def _read_step(self) -> UpdateStep:
        """An :class:`UpdateStep` for the no-gradient reads before an update."""
        return UpdateStep(None, self.budget_tokens, PassState(PartitionStats(), self._comm()))

    @torch.no_grad()
    def record_rollout_logprobs(self, micro_batches) -> None:
        """Set each micro-batch's old log-probs to the current policy's
        (:class:`~treelit.lightning.parts.RolloutLogprobs`)."""
        RolloutLogprobs(self.objective).before_updates(self.executor, micro_batches, self._read_step())

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
        """The parameters the optimizer steps: the policy's trained ones, then the parts' (a critic's)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for part in self.parts:
            params += [p for m in part.modules() for p in m.parameters() if p.requires_grad]
        return params

    def _zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for part in self.parts:
            for m in part.modules():
                m.zero_grad(set_to_none=True)

    def _clip_groups(self) -> list:
        """``(name, parameters)`` groups whose gradient norm is clipped on its own: the policy's
        (with what trains on the same loss, e.g. a shared critic's head), then the parts' own
        (e.g. a separate critic)."""
        groups = [("policy", [p for p in self.model.parameters() if p.grad is not None])]
        for part in self.parts:
            groups = part.clip_groups(groups)
        return groups

    def _update(self, micro_batches) -> Dict[str, float]:
        """Forward and backward every micro-batch with the shared normaliser, then one step."""
        planner = next((c for c in (self.trainer.callbacks if self._trainer is not None else [])
                        if isinstance(c, MemoryPlanner)), None)
        out = self.compute_gradients(micro_batches, planner)
        opt = self.optimizers()
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norms = []
        for name, params in self._clip_groups():
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
            norms.append((name, float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)))
        grad_norm = norms[0][1]
        for name, norm in norms[1:]:
            out = {**out, f"{name}/grad_norm": norm}
            if not math.isfinite(norm):
                grad_norm = norm  # a non-finite gradient of a group of its own drops the update like the policy's
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

    def compute_gradients(self, micro_batches, planner=None) -> Dict[str, float]:
        """The update's gradients in ``.grad`` (summed over ranks; sharded under FSDP2) and its
        loss and metrics. On an out-of-memory error (on any rank: the ranks agree after the
        passes) the gradients are cleared and every rank retries with the smaller partition
        budget the ``planner`` picks: the result is that of an undisturbed update."""
        norms = self.normalizers(micro_batches)
        self._normalizers = norms
        comm = self._comm()
        for attempt in range(self.max_oom_retries + 1):
            out = self._accumulate(micro_batches, norms, comm)
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

    def _accumulate(self, micro_batches, norms: Norms, comm: Collectives) -> Optional[Dict[str, float]]:
        """One attempt; None when some rank ran out of memory (gradients then unusable)."""
        total = 0.0
        metrics: Dict[str, float] = {}
        step = UpdateStep(norms, self.budget_tokens, PassState(PartitionStats(), comm))
        self._micro_losses = []
        for mb in micro_batches:
            loss_value, m = self.executor.run(mb, step)
            total += loss_value
            self._micro_losses.append((mb, float(loss_value)))
            add_micro_batch_metrics(metrics, m, len(micro_batches))
        if self.executor.partitioned and comm.max(float(step.state.failed)) > 0:
            return None
        stats = step.state.stats
        self.last_partition_stats = stats
        self.sync_gradients()
        extra = {"partitions": float(stats.partitions), "token_forwards": float(stats.token_forwards),
                 "extra_forwards": float(stats.extra_forwards), "empty_passes": float(stats.empty_passes)}
        if self.budget_tokens is not None:
            extra["budget_tokens"] = float(self.budget_tokens)
        extra.update(self.executor.update_metrics(stats))  # (context parallelism: its traffic and balance)
        return {"loss": total, **extra, **metrics}

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
        return list(micro_batches) + [self._padding(empty_row(self.device)) for _ in range(n - len(micro_batches))]

    def _padding(self, mb):
        """A padding pass, as each part wants it (e.g. an empty routing record under replay)."""
        for part in self.parts:
            mb = part.pad(mb)
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
        for part in self.parts:  # before the first update (e.g. rollout log-probs, a critic's values)
            part.before_updates(self.executor, micro, self._read_step())
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
                "peak_mem_bytes": float(peak_memory_bytes(self.device)),
                **{k: v for k, v in last.items() if k not in ("loss",) + SUMMED_METRICS},
            }
        )
        for part in self.parts:  # (from the step's first updates; e.g. the value loss summed over the ranks)
            part_metrics = part.step_metrics(updates[: len(groups)], self._comm())
            if part_metrics:
                self.log_dict(part_metrics)
        self.log_dict({"tree_tok/s": tree_tok / dt, "flat_tok/s": flat_tok / dt}, prog_bar=True)
        if self.on_nonfinite == "skip_step":
            self.log("train/skipped_steps", float(self.skipped_steps))
        if getattr(self.objective, "name", "sft") != "sft":  # (every rank: the same collectives)
            self.log_dict(self._reward_metrics(batch))
        data_metrics = getattr(getattr(self.trainer, "datamodule", None), "step_metrics", None) if self._trainer else None
        if data_metrics:  # e.g. rollout staleness (treelit.lightning.staleness)
            self.log_dict(data_metrics)
        if self.verify_every and (self.global_step % self.verify_every == 0):
            self.log_dict(self.verify(micro[0], self.normalizers(micro)))
        return torch.tensor(loss)

    # self-verification ------------------------------------------------------------------------
    def verify(self, mb, Z, R: Optional[float] = None) -> Dict[str, float]:
        """Tree vs linear on one micro-batch: relative difference of loss and gradient norm
        (``Z``: the step's :class:`~treelit.lightning.executors.Norms`, or the objective's
        normaliser with ``R`` the parts' one, the router loss's).

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
