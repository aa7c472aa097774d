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
from treelit.tree.batch import check_aggregation, global_normalizer

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
        self.automatic_optimization = False

    def configure_optimizers(self):
        opt = self.optimizer_factory(self.model.parameters())
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}

    # one optimizer step ---------------------------------------------------------------------
    def step_normalizer(self, batch: StepBatch) -> float:
        Z = global_normalizer(batch.micro_batches, self.aggregation)
        if self.aggregation != "sum" and self.trainer is not None and self.trainer.world_size > 1:
            z = torch.tensor(Z, dtype=torch.float64, device=self.device)
            Z = float(self.trainer.strategy.reduce(z, reduce_op="sum"))
        return Z

    def micro_loss(self, mb, Z: float, mode: Optional[str] = None):
        kw = dict(aggregation=self.aggregation, normalizer=Z, chunk_rows=self.chunk_rows)
        if (mode or self.mode) == "tree":
            return self.objective.tree_loss(self.model, mb, attention=self.attention, **kw)
        return self.objective.linear_loss(self.model, mb, **kw)

    def training_step(self, batch: StepBatch, batch_idx: int):
        t0 = time.perf_counter()
        opt = self.optimizers()
        Z = self.step_normalizer(batch)
        total = 0.0
        metrics: Dict[str, float] = {}
        for mb in batch.micro_batches:
            loss, m = self.micro_loss(mb, Z)
            self.manual_backward(loss)
            total += float(loss.detach())
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / len(batch.micro_batches)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        opt.step()
        opt.zero_grad(set_to_none=True)
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()
        if self.trainer is not None and getattr(self.trainer, "datamodule", None) is not None:
            self.trainer.datamodule.consumed_steps = batch.index + 1
        dt = max(time.perf_counter() - t0, 1e-9)
        tree_tok, flat_tok = batch.tree_tokens, batch.flat_tokens
        self.log("loss", total, prog_bar=True)
        self.log_dict(
            {
                "lr": opt.param_groups[0]["lr"],
                "grad_norm": grad_norm,
                "tree_tokens": float(tree_tok),
                "flat_tokens": float(flat_tok),
                "por": 1.0 - tree_tok / max(flat_tok, 1),
                "micro_batches": float(len(batch.micro_batches)),
                "peak_mem_bytes": float(_peak_memory_bytes(self.device)),
                **metrics,
            }
        )
        self.log_dict({"tree_tok/s": tree_tok / dt, "flat_tok/s": flat_tok / dt}, prog_bar=True)
        if self.verify_every and (self.global_step % self.verify_every == 0):
            self.log_dict(self.verify(batch.micro_batches[0], Z))
        return torch.tensor(total)

    # self-verification ------------------------------------------------------------------------
    def verify(self, mb, Z: float) -> Dict[str, float]:
        """Tree vs linear on one micro-batch: relative difference of loss and gradient norm.

        Gradients are taken with ``torch.autograd.grad`` so that ``.grad`` is untouched.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]

        def run(mode):
            loss, _ = self.micro_loss(mb, Z, mode)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
            return float(loss.detach()), float(norm), grads

        lt, nt, gt = run("tree")
        ll, nl, gl = run("linear")
        diff = torch.sqrt(
            sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(gt, gl) if a is not None and b is not None)
        )
        out = {
            "verify/loss_rel_diff": abs(lt - ll) / max(abs(ll), 1e-30),
            "verify/grad_norm_rel_diff": abs(nt - nl) / max(nl, 1e-30),
            "verify/grad_rel_diff": float(diff) / max(nl, 1e-30),
        }
        log.info("self-verification at step %d: %s", self.global_step, out)
        return out
