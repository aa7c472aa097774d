"""``TreeLitModule``: one optimizer step per step batch, exact over its micro-batches.

Optimization is manual: a step's normaliser is computed over all of its
micro-batches (and, under data parallelism, summed over ranks) *before* any of them
is run, then each micro-batch is forwarded and backwarded with that normaliser, so
gradient accumulation gives exactly the gradient of the whole step. ``mode=linear``
runs the same objective per branch (the baseline); ``verify_every=N`` checks on one
micro-batch every N steps that tree mode and linear mode agree (loss and gradient
norm) and logs the relative differences.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from typing import Any, Callable, Dict, Optional

import lightning.pytorch as pl
import torch

from treelit.lightning.data import StepBatch
from treelit.objectives.base import Objective
from treelit.tree.batch import check_aggregation

__all__ = ["TreeLitModule"]

log = logging.getLogger(__name__)


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak RSS (Linux: KiB)


class TreeLitModule(pl.LightningModule):
    """Args:
        model: a :class:`~treelit.models.TreeDecoder`.
        objective: an :class:`~treelit.objectives.Objective`.
        optimizer: ``params -> torch.optim.Optimizer`` (a Hydra ``_partial_``).
        scheduler: optional ``optimizer -> LRScheduler`` stepped once per optimizer step.
        attention: attention backend name or instance (``auto`` by default).
        aggregation: loss aggregation mode.
        mode: ``tree`` or ``linear`` (per-branch baseline).
        grad_clip: max gradient norm (0 disables clipping; the norm is logged anyway).
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
        grad_clip: float = 1.0,
        verify_every: int = 0,
        chunk_rows: Optional[int] = None,
        ppo_epochs: int = 1,
        ppo_minibatches: int = 1,
        old_logprobs: str = "data",
        partition: str = "none",
        budget_tokens: Optional[int] = None,
        max_oom_retries: int = 3,
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
        self.grad_clip = float(grad_clip)
        self.verify_every = int(verify_every)
        self.chunk_rows = chunk_rows
        if ppo_epochs < 1 or ppo_minibatches < 1:
            raise ValueError("ppo_epochs and ppo_minibatches must be >= 1")
        if old_logprobs not in ("data", "rollout"):
            raise ValueError(f"old_logprobs must be 'data' or 'rollout', got {old_logprobs!r}")
        self.ppo_epochs = int(ppo_epochs)
        self.ppo_minibatches = int(ppo_minibatches)
        self.old_logprobs = old_logprobs
        if partition not in ("none", "redundancy_free"):
            raise ValueError(f"partition must be 'none' or 'redundancy_free', got {partition!r}")
        if partition != "none" and objective.name != "sft":
            raise ValueError(
                f"partition={partition} runs the sft objective only (objective={objective.name}); use partition=none"
            )
        self.partition = partition
        self.budget_tokens = budget_tokens
        self.max_oom_retries = int(max_oom_retries)
        self.last_partition_stats = None
        self.automatic_optimization = False

    # multi-process -----------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): shard the decoder over the data-parallel mesh. The
        whole decoder is one FSDP unit because treelit's passes run inside its forward
        (:func:`~treelit.models.decoder.in_forward`). FSDP2 averages gradients over ranks while
        the loss is already divided by the step-global normaliser, so each backward is scaled
        by the number of ranks: the reduced gradient is the sum, i.e. the single-process one."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or getattr(self.model, "_treelit_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"]
        fully_shard(self.model, mesh=dp)
        self.model._treelit_sharded = True
        self._grad_scale = float(dp.size())  # FSDP2 averages over ranks; treelit needs the sum

    def _fsdp(self) -> bool:
        return bool(getattr(self.model, "_treelit_sharded", False))

    def on_train_start(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = getattr(self.trainer.strategy, "model", None)
        if isinstance(wrapped, DistributedDataParallel):
            # Several forward/backward passes per update (micro-batches, partitions): DDP's own
            # per-backward reduction would run too early and too often. treelit sums the
            # gradients itself once per update (sync_gradients), the same number of times on
            # every rank whatever its number of passes.
            wrapped.require_backward_grad_sync = False

    def configure_optimizers(self):
        opt = self.optimizer_factory(self.model.parameters())
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}

    # one optimizer step ---------------------------------------------------------------------
    def step_normalizer(self, micro_batches) -> float:
        if self.aggregation == "sum":
            return 1.0
        Z = float(sum(self.objective.norm_contribution(b, self.aggregation) for b in micro_batches))
        if self.aggregation != "sum" and self.trainer is not None and self.trainer.world_size > 1:
            z = torch.tensor(Z, dtype=torch.float64, device=self.device)
            Z = float(self.trainer.strategy.reduce(z, reduce_op="sum"))
        return Z

    def micro_loss(self, mb, Z: float, mode: Optional[str] = None):
        kw = dict(aggregation=self.aggregation, normalizer=Z, chunk_rows=self.chunk_rows)
        if (mode or self.mode) == "tree":
            return self.objective.tree_loss(self.model, mb, attention=self.attention, **kw)
        return self.objective.linear_loss(self.model, mb, **kw)

    @torch.no_grad()
    def record_rollout_logprobs(self, micro_batches) -> None:
        """Set each micro-batch's old log-probs to the current policy's (tree mode, no grad)."""
        from treelit.loss.tree import tree_token_logprobs

        for mb in micro_batches:
            sel, logp, _ = tree_token_logprobs(self.model, mb, self.attention, chunk_rows=self.chunk_rows)
            old = torch.full((mb.num_tokens,), float("nan"), dtype=torch.float64, device=mb.device)
            old[sel] = logp.double()
            mb.token_old_logp = old
            mb.branch_old_logp = old[mb.branch_tokens]

    def _backward(self, loss: torch.Tensor) -> None:
        if self._fsdp():
            (loss * getattr(self, "_grad_scale", 1.0)).backward()
        elif self._distributed():
            loss.backward()  # gradients are summed across ranks once per update (sync_gradients)
        else:
            self.manual_backward(loss)

    def _distributed(self) -> bool:
        return self.trainer is not None and self.trainer.world_size > 1

    def sync_gradients(self) -> None:
        """Sum gradients over ranks, once per update. The loss is already divided by the
        step-global normaliser, so the sum is exactly the single-process gradient. Every
        rank issues the same collectives whatever its number of partitions or passes."""
        if not self._distributed() or self._fsdp():
            return
        import torch.distributed as dist

        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off : off + n].view_as(p))
            off += n

    def _update(self, micro_batches) -> Dict[str, float]:
        """Forward and backward every micro-batch with the shared normaliser, then one step.
        On an out-of-memory error the gradients are cleared and the update is retried with a
        smaller partition budget: the result is that of an undisturbed update."""
        from treelit.lightning.planner import MemoryPlanner

        planner = next((c for c in (self.trainer.callbacks if self.trainer else []) if isinstance(c, MemoryPlanner)), None)
        for attempt in range(self.max_oom_retries + 1):
            try:
                return self._update_once(micro_batches)
            except torch.OutOfMemoryError:
                self.optimizers().zero_grad(set_to_none=True)
                if attempt == self.max_oom_retries or planner is None:
                    raise
                self.budget_tokens = planner.shrink(self, micro_batches)
                log.warning("out of memory: retrying the update with a budget of %s tokens", self.budget_tokens)
        raise AssertionError("unreachable")

    def _update_once(self, micro_batches) -> Dict[str, float]:
        from treelit.partition import PartitionStats, tree_backward

        opt = self.optimizers()
        Z = self.step_normalizer(micro_batches)
        total = 0.0
        metrics: Dict[str, float] = {}
        stats = PartitionStats()
        for mb in micro_batches:
            if self.partition != "none" and self.mode == "tree":
                total += tree_backward(
                    self.model, mb, self.aggregation, self.partition, self.budget_tokens, normalizer=Z,
                    attention=self.attention, chunk_rows=self.chunk_rows, stats=stats,
                )
                continue
            loss, m = self.micro_loss(mb, Z)
            self._backward(loss)
            total += float(loss.detach())
            stats.partitions += 1
            stats.token_forwards += mb.num_tokens
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / len(micro_batches)
        self.last_partition_stats = stats
        self.sync_gradients()
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()
        extra = {"partitions": float(stats.partitions), "token_forwards": float(stats.token_forwards)}
        if self.budget_tokens is not None:
            extra["budget_tokens"] = float(self.budget_tokens)
        return {"loss": total, "grad_norm": grad_norm, **extra, **metrics}

    def training_step(self, batch: StepBatch, batch_idx: int):
        t0 = time.perf_counter()
        micro = batch.micro_batches
        if self.old_logprobs == "rollout":
            self.record_rollout_logprobs(micro)
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
        self.log("loss", loss, prog_bar=True)
        self.log_dict(
            {
                "lr": self.optimizers().param_groups[0]["lr"],
                "tree_tokens": float(tree_tok),
                "flat_tokens": float(flat_tok),
                "por": 1.0 - tree_tok / max(flat_tok, 1),
                "micro_batches": float(len(micro)),
                "load_imbalance": float(batch.load_imbalance),
                "peak_mem_bytes": float(_peak_memory_bytes(self.device)),
                **{k: v for k, v in last.items() if k != "loss"},
            }
        )
        self.log_dict({"tree_tok/s": tree_tok / dt, "flat_tok/s": flat_tok / dt}, prog_bar=True)
        if self.verify_every and (self.global_step % self.verify_every == 0):
            self.log_dict(self.verify(micro[0], self.step_normalizer(micro)))
        return torch.tensor(loss)

    # self-verification ------------------------------------------------------------------------
    def verify(self, mb, Z: float) -> Dict[str, float]:
        """Tree vs linear on one micro-batch: relative difference of loss and gradient norm.

        Gradients are taken with ``torch.autograd.grad`` so that ``.grad`` is untouched.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]

        def run(mode):
            t0 = time.perf_counter()
            loss, _ = self.micro_loss(mb, Z, mode)
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
        log.info("self-verification at step %d: %s", self.global_step, out)
        return out
