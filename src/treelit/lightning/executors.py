"""How a micro-batch runs: the executor, chosen once from the configuration (docs/design.md,
"The step as parts").

Four executors, each composed with the data-parallel strategy (one process, DDP, FSDP2,
HSDP: the strategy is Lightning's; the executors issue the same passes on every rank):

- :class:`WholeRow`: each micro-batch's tree in one pass (``partition=none``; ``mode=linear``,
  the per-branch baseline, runs here too);
- :class:`Partitioned`: the partition engine (:mod:`treelit.partition.engine`) under the
  planner's token budget;
- :class:`ContextParallel`: one pass per row, split over a context-parallel group;
- :class:`CPPartitioned`: the partition engine with every pass split over the group.

An executor calls the step parts (:mod:`treelit.lightning.parts`) through their hooks and never
asks what they are; :func:`choose_executor` picks, from ``partition``, ``mode`` and the
context-parallel degree, the first executor that supports every part.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from treelit.loss.tree import sft_tree_loss, tree_token_logprobs
from treelit.objectives.critic import tree_values
from treelit.partition.context_parallel import TRAFFIC, cp_logprobs, cp_passes
from treelit.partition.engine import (MicroBatchResult, PartitionStats, PassSpec, PassState, partitioned_values,
                                     policy_logprobs, run_passes)

__all__ = ["StepSpec", "Norms", "UpdateStep", "Executor", "WholeRow", "Partitioned", "ContextParallel",
           "CPPartitioned", "choose_executor", "whole_row_loss", "peak_memory_bytes"]


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak RSS (Linux: KiB)


@dataclass
class StepSpec:
    """What every micro-batch of the run shares, fixed at set-up."""

    model: torch.nn.Module
    objective: Any
    attention: Any = "auto"
    aggregation: str = "token-mean"
    chunk_rows: Optional[int] = None
    mode: str = "tree"
    cp_group: Any = None
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward

    @property
    def cp_degree(self) -> int:
        return dist.get_world_size(self.cp_group) if self.cp_group is not None else 1


@dataclass
class Norms:
    """An update's normalisers: the objective's ``Z`` and each part's own, by part name."""

    Z: float
    by_part: Dict[str, Optional[float]] = field(default_factory=dict)

    def of(self, name: str) -> Optional[float]:
        return self.by_part.get(name)


@dataclass
class UpdateStep:
    """One update's (or one no-gradient read's) running state: its normalisers, the partition
    budget, and the statistics, ranks and out-of-memory flag its micro-batches share."""

    norms: Optional[Norms] = None
    budget: Optional[int] = None
    state: PassState = field(default_factory=PassState)


def whole_row_loss(spec: StepSpec, parts: Sequence[Any], mb, norms: Norms, mode: Optional[str] = None):
    """One micro-batch's loss and metrics in one pass (tree) or per branch (``mode=linear``): the
    objective's, composed with each part's :meth:`~treelit.lightning.parts.StepPart.whole_row`
    (the first part of the list outermost). A padding micro-batch (no targets, tree mode): one
    pass through the model and each part's modules (the other ranks' collectives), loss 0."""
    mode = mode or spec.mode
    kw = dict(aggregation=spec.aggregation, normalizer=norms.Z, chunk_rows=spec.chunk_rows)
    if not mb.num_targets and mode == "tree":
        for part in parts:
            mb = part.pad(mb)
        loss = sft_tree_loss(spec.model, mb, spec.aggregation, spec.attention, normalizer=1.0)
        for part in parts:
            term = part.pad_loss(spec, mb)
            if term is not None:
                loss = loss + 0.0 * term
        return loss, {}

    def objective_loss(mb, mode, **kw):
        if mode == "tree":
            return spec.objective.tree_loss(spec.model, mb, attention=spec.attention, **kw)
        # per branch, from the records' branches (not read back from the tree)
        branches = mb.source_branches if mb.source_branches is not None else mb
        return spec.objective.linear_loss(spec.model, branches, **kw)

    fn = objective_loss
    for part in reversed(parts):
        fn = part.whole_row(spec, fn, norms)
    return fn(mb, mode, **kw)


class Executor:
    """Runs micro-batches: forward and backward with every part folded in (:meth:`run`), and the
    no-gradient reads the parts ask for before an update (:meth:`logprobs`, :meth:`head_values`)."""

    name = ""
    partitioned = False  # the planner's budget applies (its out-of-memory retries are agreed over ranks)

    def __init__(self, spec: StepSpec, parts: Sequence[Any]) -> None:
        self.spec, self.parts = spec, list(parts)
        self.summed = tuple(k for part in self.parts for k in part.summed_metrics)

    @classmethod
    def runs(cls, parts: Sequence[Any]) -> bool:
        """Whether this executor can run every one of ``parts``."""
        return True

    def run(self, mb, step: UpdateStep) -> Tuple[float, Dict[str, float]]:
        """One micro-batch's forward and backward (inside each part's :meth:`~treelit.lightning.
        parts.StepPart.micro_batch`): its loss value and metrics."""
        with self._micro_batch(mb, True):
            return self._run(mb, step)

    def logprobs(self, mb, step: UpdateStep) -> torch.Tensor:
        """``[N]`` float64 log-probs of the current policy at every target token (NaN elsewhere)."""
        with self._micro_batch(mb, False):
            return self._logprobs(mb, step)

    def head_values(self, head, mb, step: UpdateStep) -> torch.Tensor:
        """``[N]`` float64 values of ``head`` (``.values(h)``, read from ``head.trunk`` or, when
        None, the policy's hidden states) at every target token, without gradient."""
        with self._micro_batch(mb, False):
            return self._head_values(head, mb, step)

    @contextlib.contextmanager
    def _micro_batch(self, mb, grad: bool):
        with contextlib.ExitStack() as stack:  # (the first part outermost)
            for part in self.parts:
                stack.enter_context(part.micro_batch(self.spec, mb, grad))
            yield

    def _run(self, mb, step: UpdateStep) -> Tuple[float, Dict[str, float]]:
        raise NotImplementedError

    def recomputes_alone(self) -> bool:
        """Whether one micro-batch's gradient can be computed again on this rank alone."""
        return True

    def _logprobs(self, mb, step: UpdateStep) -> torch.Tensor:
        raise NotImplementedError

    def _head_values(self, head, mb, step: UpdateStep) -> torch.Tensor:
        trunk = head.trunk if head.trunk is not None else self.spec.model
        return partitioned_values(trunk, head, mb, attention=self.spec.attention, comm=step.state.comm,
                                  budget_tokens=step.budget if self.partitioned else None,
                                  cp_group=self.spec.cp_group)

    def update_metrics(self, stats: PartitionStats) -> Dict[str, float]:
        return {}

    # the partition engine, with each part's pass parts and extra runs
    def _passes(self, mb, step: UpdateStep, state: PassState) -> MicroBatchResult:
        s = self.spec
        spec = PassSpec(s.aggregation, step.norms.Z, step.budget if self.partitioned else None, s.attention,
                        s.chunk_rows, s.cp_group)
        res = run_passes(s.model, s.objective, mb, spec, [p for part in self.parts for p in part.pass_parts(step.norms)],
                         state)
        for part in self.parts:
            for model, pass_parts in part.extra_runs(step.norms):
                more = run_passes(model, None, mb, spec, pass_parts,
                                  PassState(state.stats, state.comm, state.failed or res.failed))
                res = MicroBatchResult(res.loss + more.loss, {**res.metrics, **more.metrics}, res.failed or more.failed)
        return res


class WholeRow(Executor):
    name = "whole_row"

    def _run(self, mb, step: UpdateStep) -> Tuple[float, Dict[str, float]]:
        loss, m = whole_row_loss(self.spec, self.parts, mb, step.norms)
        self.spec.backward(loss)
        step.state.stats.partitions += 1
        step.state.stats.token_forwards += mb.num_tokens
        return float(loss.detach()), m

    def _logprobs(self, mb, step: UpdateStep) -> torch.Tensor:
        s = self.spec
        sel, logp, _ = tree_token_logprobs(s.model, mb, s.attention, chunk_rows=s.chunk_rows)
        old = torch.full((mb.num_tokens,), float("nan"), dtype=torch.float64, device=mb.device)
        old[sel] = logp.double()
        return old

    def _head_values(self, head, mb, step: UpdateStep) -> torch.Tensor:
        return tree_values(head, self.spec.model, mb, self.spec.attention)


class Partitioned(Executor):
    name = "partitioned"
    partitioned = True

    def _run(self, mb, step: UpdateStep) -> Tuple[float, Dict[str, float]]:
        res = self._passes(mb, step, step.state)
        step.state.failed = step.state.failed or res.failed
        return res.loss, res.metrics

    def _logprobs(self, mb, step: UpdateStep) -> torch.Tensor:
        s = self.spec
        return policy_logprobs(s.model, mb, budget_tokens=step.budget, attention=s.attention, chunk_rows=s.chunk_rows,
                               comm=step.state.comm)


class _ContextParallelMetrics(Executor):
    def recomputes_alone(self) -> bool:
        return False  # (a row split over ranks: not recomputed whole)

    def update_metrics(self, stats: PartitionStats) -> Dict[str, float]:
        """What context parallelism cost this update, for each rank of this rank's group:
        ``cp/received_bytes/rank{r}`` (the bytes it received: path K/V, recurrent states and
        convolution inputs, their gradients, and partitioned passes' all-reduced boundary states
        and ancestor K/V assemblies, since the last update's figure: this step's values and
        rollout passes included) and
        ``cp/peak_bytes/rank{r}`` (its peak memory, as ``peak_mem_bytes``), their maxima, and
        ``cp/imbalance`` (the passes' most loaded rank's cost over the mean, minus 1)."""
        device = next(self.spec.model.parameters()).device
        mine = torch.tensor([float(TRAFFIC.take()), float(peak_memory_bytes(device))], dtype=torch.float64,
                            device=device)
        every = [torch.zeros_like(mine) for _ in range(self.spec.cp_degree)]
        dist.all_gather(every, mine, group=self.spec.cp_group)
        out = {"cp/imbalance": stats.cp_imbalance}
        for r, t in enumerate(every):
            out[f"cp/received_bytes/rank{r}"] = float(t[0])
            out[f"cp/peak_bytes/rank{r}"] = float(t[1])
        out["cp/received_bytes_max"] = max(float(t[0]) for t in every)
        out["cp/peak_bytes_max"] = max(float(t[1]) for t in every)
        return out


class ContextParallel(_ContextParallelMetrics):
    """One pass per row split over the group: the parts that fold into such a pass
    (``StepPart.split_row``) run here; the others make :func:`choose_executor` pick
    :class:`CPPartitioned`."""

    name = "context_parallel"

    @classmethod
    def runs(cls, parts: Sequence[Any]) -> bool:
        return all(part.split_row for part in parts)

    def _run(self, mb, step: UpdateStep) -> Tuple[float, Dict[str, float]]:
        s = self.spec
        spec = PassSpec(s.aggregation, step.norms.Z, None, s.attention, s.chunk_rows, s.cp_group)
        loss_value, m, plan = cp_passes(s.model, s.objective, mb, spec,
                                        [p for part in self.parts for p in part.pass_parts(step.norms)])
        loss_value /= s.cp_degree  # every rank of the group holds the whole loss; the step sums over ranks
        stats = step.state.stats
        stats.cp_max_cost += float(plan.work.max())
        stats.cp_mean_cost += float(plan.work.mean())
        stats.cp_score_pairs = max(stats.cp_score_pairs, plan.size * len(plan.path))
        stats.partitions += 1
        stats.token_forwards += plan.size
        return loss_value, m

    def _logprobs(self, mb, step: UpdateStep) -> torch.Tensor:
        s = self.spec
        return cp_logprobs(s.model, mb, s.cp_group, attention=s.attention, chunk_rows=s.chunk_rows)


class CPPartitioned(_ContextParallelMetrics):
    """The partition engine over a context-parallel group: partitioned (``partition`` on) or one
    pass per row (parts :class:`ContextParallel` cannot run)."""

    name = "cp_partitioned"

    def __init__(self, spec: StepSpec, parts: Sequence[Any], partitioned: bool) -> None:
        super().__init__(spec, parts)
        self.partitioned = partitioned

    def _run(self, mb, step: UpdateStep) -> Tuple[float, Dict[str, float]]:
        C = self.spec.cp_degree
        res = self._passes(mb, step, PassState(step.state.stats, step.state.comm))
        # (every rank of the group holds the whole loss, and the whole of each summed metric: the step sums over ranks)
        m = {k: v / C if k in self.summed else v for k, v in res.metrics.items()}
        return res.loss / C, m

    def _logprobs(self, mb, step: UpdateStep) -> torch.Tensor:
        s = self.spec
        if not self.partitioned:
            return cp_logprobs(s.model, mb, s.cp_group, attention=s.attention, chunk_rows=s.chunk_rows)
        return policy_logprobs(s.model, mb, budget_tokens=step.budget, attention=s.attention, chunk_rows=s.chunk_rows,
                               comm=step.state.comm, cp_group=s.cp_group)


def choose_executor(spec: StepSpec, parts: Sequence[Any], partition: str) -> Executor:
    """The executor of ``partition`` (``none`` / ``redundancy_free``), ``spec.mode`` and the
    context-parallel degree that runs every one of ``parts``."""
    partitioned = partition != "none"
    if spec.cp_degree > 1:
        if spec.mode == "tree" and (partitioned or not ContextParallel.runs(parts)):
            return CPPartitioned(spec, parts, partitioned)
        return ContextParallel(spec, parts)
    if partitioned and spec.mode == "tree":
        return Partitioned(spec, parts)
    return WholeRow(spec, parts)


def executor_names() -> List[str]:
    return [c.name for c in (WholeRow, Partitioned, ContextParallel, CPPartitioned)]
