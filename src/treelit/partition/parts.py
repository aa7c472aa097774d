"""What a step part folds into the partition engine's passes (:mod:`treelit.partition.engine`).

The engine runs the objective's folded loss over a micro-batch's passes; everything else a
pass carries comes from a list of :class:`PassPart` objects, whose hooks the engine calls
without asking what they are (docs/design.md, "The step as parts"):

- :meth:`PassPart.bind`: set up for one micro-batch (False: the part sits this one out);
- :meth:`PassPart.counts_first`: a no-gradient pass must first see every token of the row
  (:meth:`PassPart.on_collect` is then called on each of its passes);
- :meth:`PassPart.on_targets`: a loss term on a pass's target tokens' hidden states (parts
  with ``reads_targets``);
- :meth:`PassPart.on_pass`: a loss term on the pass's context (e.g. its router logits);
- :meth:`PassPart.on_split_row`: the term of this rank's range of a whole row split over a
  context-parallel group (:func:`~treelit.partition.context_parallel.cp_passes`);
- :meth:`PassPart.zero`: a zero term through the part's own modules (an empty pass: under
  FSDP2 every rank calls the same sharded modules);
- :meth:`PassPart.reduce`: its sums over a context-parallel group;
- :meth:`PassPart.value` / :meth:`PassPart.metrics`: its share of the micro-batch's loss value
  (added where the engine recomputes the value from the log-probs) and its metrics.

A part with ``policy = False`` is the pass's only loss (a separate critic's trunk: the
objective is not folded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from treelit.loss.router import RouterTerms
from treelit.objectives.critic import value_pairs

__all__ = ["PassSpec", "PassPart", "ValuePass", "RouterPass", "group_sum"]


@dataclass
class PassSpec:
    """How a micro-batch's passes run: the loss aggregation and the step's normaliser, the
    token budget per chain of partitions (None: the whole row in one pass), the attention
    backend, the head's chunk and the context-parallel group (None: none)."""

    aggregation: str = "token-mean"
    normalizer: float = 1.0
    budget_tokens: Optional[int] = None
    attention: Any = "auto"
    chunk_rows: Optional[int] = None
    cp_group: Any = None


def group_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ``group`` of ``x``'s values where set (NaN: unset; NaN where no rank set it)."""
    have = ~torch.isnan(x)
    val = torch.where(have, x, torch.zeros_like(x))
    cnt = have.to(torch.float64)
    dist.all_reduce(val, group=group)
    dist.all_reduce(cnt, group=group)
    return torch.where(cnt > 0, val, torch.full_like(val, float("nan")))


class PassPart:
    """The hooks the engine calls; a part overrides those it needs."""

    policy = True  # False: the objective is not folded into the passes, this part's terms alone
    reads_targets = False  # True: :meth:`on_targets` is called with the target tokens' hidden states

    def bind(self, run) -> bool:
        """Set up for ``run``'s micro-batch (a ``treelit.partition.engine`` run); False: unused."""
        return True

    def counts_first(self, run) -> bool:
        return False

    def on_collect(self, run, ctx, tokens: torch.Tensor) -> None:
        """A no-gradient pass over row tokens ``tokens`` (its context ``ctx``)."""

    def collected(self, group) -> None:
        """The no-gradient passes are done (``group``: the context-parallel group, or None)."""

    def on_targets(self, run, hs: torch.Tensor, tok: torch.Tensor) -> Optional[torch.Tensor]:
        """A term on the hidden states ``hs`` of the pass's target tokens ``tok``."""
        return None

    def on_pass(self, run, ctx, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """A term on the pass over row tokens ``tokens`` (its context ``ctx``)."""
        return None

    def on_split_row(self, ctx, tokens: torch.Tensor, group) -> torch.Tensor:
        """Context parallelism without partitions: the term of this rank's range ``tokens`` of
        the whole row (its pass ``ctx``); the value and metrics are then the row's on every rank
        (:func:`~treelit.partition.context_parallel.cp_passes`)."""
        raise NotImplementedError(f"{type(self).__name__} does not fold into a context-parallel pass over a whole row")

    def zero(self, h: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    def reduce(self, group, device) -> None:
        """Sum this part's sums over the context-parallel ``group``."""

    def value(self) -> float:
        return 0.0

    def metrics(self) -> Dict[str, float]:
        return {}


class ValuePass(PassPart):
    """A critic's value loss, ``vf_coef x`` each pass's pairs' share divided by the step
    normaliser, read from the pass's hidden states: the policy's (a shared critic) or, with
    ``policy=False`` and the run's model the critic's trunk, a separate critic's. The batch
    went through :func:`~treelit.objectives.critic.set_tree_advantages`."""

    reads_targets = True

    def __init__(self, critic, policy: bool = True) -> None:
        self.critic, self.policy = critic, policy
        self.terms = None
        self.value_sum, self.n_clip, self.n_pairs = 0.0, 0.0, 0.0

    def bind(self, run) -> bool:
        if run.spec.fused_sft or not run.spec.token_separable:
            raise ValueError("a critic's value loss folds into token-separable objectives only (objective=ppo)")
        # (a padding micro-batch, without targets, has no pairs: its passes fold nothing)
        self.terms = value_pairs(run.batch, run.aggregation, run.batch.device) if run.sel.numel() else None
        return True

    def on_targets(self, run, hs: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        where = torch.full((run.N,), -1, dtype=torch.long, device=tok.device)
        where[tok] = torch.arange(len(tok), device=tok.device)
        value, n_clip, n_pairs = self.terms.loss(self.critic, self.critic.values(hs), where)
        value = value / run.Z if run.Z > 0 else value * 0.0
        self.value_sum += float(value.detach())
        self.n_clip += n_clip
        self.n_pairs += n_pairs
        return self.critic.vf_coef * value

    def zero(self, h: torch.Tensor) -> torch.Tensor:
        return self.critic.values(h[:1] * 0).sum()

    def reduce(self, group, device) -> None:  # each rank's pairs' value loss: the row's
        sums = torch.tensor([self.value_sum, self.n_clip, self.n_pairs], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        self.value_sum, self.n_clip, self.n_pairs = (float(x) for x in sums)

    def value(self) -> float:
        return self.critic.vf_coef * self.value_sum if self.policy else 0.0

    def metrics(self) -> Dict[str, float]:
        return {"critic/value_loss": self.value_sum, "critic/clip_fraction": self.n_clip / max(self.n_pairs, 1.0)}


class RouterPass(PassPart):
    """A mixture-of-experts model's router loss, each pass's tokens' share (``normalizer``: the
    step's, see :mod:`treelit.loss.router`); a row cut into several passes (or split over a
    context-parallel group) first takes every token's routing in a no-gradient pass."""

    def __init__(self, normalizer: Optional[float] = None) -> None:
        self.normalizer = normalizer
        self.terms: Optional[RouterTerms] = None

    def bind(self, run) -> bool:
        if not (RouterTerms.enabled(run.model) and run.sel.numel()):
            return False
        self.terms = RouterTerms(run.model, run.batch, self.normalizer)
        return True

    def counts_first(self, run) -> bool:
        return len(run.rp.parts) > 1 or run.cp_group is not None

    def on_collect(self, run, ctx, tokens: torch.Tensor) -> None:
        if run.cp_group is not None:  # this rank's range of the pass
            self.terms.add_counts(ctx, ctx.cp_tokens, ctx.cp_tokens if not ctx.cp_pass.size else None)
        else:
            self.terms.add_counts(ctx, tokens)

    def collected(self, group) -> None:
        if group is not None:  # each rank filled the routing counts of its ranges
            dist.all_reduce(self.terms.counts, group=group)
            dist.all_reduce(self.terms.layer_load, group=group)

    def on_pass(self, run, ctx, tokens: torch.Tensor) -> torch.Tensor:
        if run.cp_group is not None:  # (the counts: from the routing pass)
            return self.terms.pass_loss(ctx, ctx.cp_tokens, rows=ctx.cp_tokens if not ctx.cp_pass.size else None)
        return self.terms.pass_loss(ctx, tokens, whole_row=len(run.rp.parts) == 1)

    def on_split_row(self, ctx, tokens: torch.Tensor, group) -> torch.Tensor:
        return self.terms.split_row_loss(ctx, tokens, group)

    def reduce(self, group, device) -> None:  # each rank's passes' router terms: the row's
        self.terms.value = group_sum(torch.tensor([self.terms.value], dtype=torch.float64, device=device), group).item()

    def value(self) -> float:
        t = self.terms
        return t.coef * t.scale * t.value

    def metrics(self) -> Dict[str, float]:
        return self.terms.metrics()
