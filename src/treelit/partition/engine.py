"""One micro-batch's forward and backward, partitioned, for any objective, on any number of ranks.

Phases, each over the same partition plan (the whole row when it fits the budget):

1. *reference* (objectives with a frozen reference model): no-gradient log-probs of the
   targets under the reference model;
2. *log-probs* (sequence-level objectives, see :mod:`treelit.objectives.folding`):
   no-gradient log-probs (and entropies) of every target under the policy, from which the
   loss value and ``dL/dlogp`` are computed. Its forwards are reported apart
   (``PartitionStats.extra_forwards``);
3. *gradient*: the partitions forwarded depth first, each folding its own targets'
   loss terms (token-separable objectives) or the surrogate ``sum g_t logp_t``, and
   backwarded deepest first with the gradients of their K/V and states relayed.

Besides the objective, the passes fold a list of *pass parts* (:mod:`treelit.partition.parts`:
a critic's value loss, the router loss, ...) through their hooks, without asking what they
are (:func:`run_passes`; docs/design.md, "The step as parts").

Under FSDP2 every pass issues collectives, so ranks exchange their pass words and run
one aligned schedule with empty passes in the gaps (:mod:`treelit.partition.schedule`);
forward-only phases run the largest count of forwards. Under DDP and on one process
the passes issue no collectives and run as planned.

Out of memory: a block that runs out of memory marks the pass failed (see
:mod:`treelit.utils.blocks`); the rest of the micro-batch still issues every collective
with empty passes, and :attr:`MicroBatchResult.failed` tells the caller, who agrees with
the other ranks and retries the update with a smaller budget. Without FSDP an
out-of-memory error anywhere in a pass is caught the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from treelit.loss.logprobs import token_logprobs, weighted_nll
from treelit.models.forward import in_forward, output_weight
from treelit.objectives.folding import FoldSpec, fold_spec, loss_from_logprobs, target_selection
from treelit.partition import p2p
from treelit.partition.parts import PassPart, PassSpec, RouterPass, ValuePass, group_sum
from treelit.partition.context_parallel import (cp_captures, cp_chunk_rows, cp_forward_pass, cp_relay, cp_split,
                                                cp_state_captures, has_recurrent_layers)
from treelit.partition.passes import Captures, RowPlan, captures_of, empty_row, forward_partition, whole_row_plan
from treelit.partition.plan import plan_partitions
from treelit.partition.results import MicroBatchResult, PartitionStats, PassState
from treelit.partition.schedule import FORWARD, align, align_forwards, decode, dfs_word, encode
from treelit.tree.batch import TreeBatch
from treelit.utils.blocks import OOMGuard
from treelit.utils.distributed import Collectives, is_sharded

__all__ = ["PartitionStats", "MicroBatchResult", "PassSpec", "PassState", "run_passes", "run_micro_batch",
           "policy_logprobs", "partitioned_values"]


@dataclass
class _Live:
    index: int  # partition index (-1: an empty pass)
    loss: torch.Tensor
    produced: List[torch.Tensor]
    leaves: List[torch.Tensor]


class _Run:
    """Shared state of one micro-batch: model, batch, plan, heads, buffers, failure."""

    def __init__(self, model, objective, batch: TreeBatch, plan, spec: FoldSpec, passes: PassSpec,
                 state: PassState) -> None:
        self.model, self.objective, self.batch, self.spec = model, objective, batch, spec
        self.rp = RowPlan(batch, plan)
        self.aggregation, self.Z = passes.aggregation, float(passes.normalizer)
        self.attention, self.chunk_rows = passes.attention, passes.chunk_rows
        self.stats, self.comm = state.stats, state.comm
        self.sharded = is_sharded(model)
        self.aligned = self.sharded and self.comm.distributed
        self.failed = state.failed
        self.N = batch.num_tokens
        self.sel = target_selection(batch)
        self.ref: Optional[torch.Tensor] = None  # [N] reference log-probs (reference-model objectives)
        self.collected: List[Any] = []
        self._empty: Optional[TreeBatch] = None
        self.parts: List[PassPart] = []  # what the passes fold besides the objective (treelit.partition.parts)
        self.policy = True  # False: the objective is not folded (e.g. a separate critic's trunk)
        self.cp_group = None  # context parallelism: each pass's row split over this group's ranks
        self.cp_rows: Dict[int, Any] = {}  # partition -> the rows its captures hold (under CP)
        # recurrent layers (native, or a transformers hybrid's tree kernels): their boundary states travel too
        self.cp_recurrent = has_recurrent_layers(model)

    # one pass -----------------------------------------------------------------------------
    def forward_pass(self, m, i, sub, tokens, captured, emb_buf=None, guard=None):
        """``(h, ctx, rows, tok)``: partition ``i``'s hidden states and its targets (hidden-state
        rows, full-row tokens); under context parallelism this rank's range of the pass and the
        targets it holds. ``sub, tokens``: the partition's row (:meth:`RowPlan.row`)."""
        rp = self.rp
        if self.cp_group is None:
            h, ctx = forward_partition(m, sub, self.attention, rp.external(i, captured), bool(rp.children[i]),
                                       rp.boundary[i], embedding_grad_accumulator=emb_buf, oom_guard=guard)
            rows, tok = rp.targets(i, sub, tokens)
            self.stats.max_pass_targets = max(self.stats.max_pass_targets, int((self.batch.target_count[tok] > 0).sum()))
            return h, ctx, rows, tok
        C, rank = self.cp_size
        plan = cp_split(sub, C, rank, m)
        self.stats.cp_max_cost += float(plan.work.max())
        self.stats.cp_mean_cost += float(plan.work.mean())
        self.stats.cp_score_pairs = max(self.stats.cp_score_pairs, plan.size * len(plan.path))
        h, ctx = cp_forward_pass(m, sub, plan, self.cp_group, self.attention,
                                 rp.external(i, captured, self.cp_rows), capture=bool(rp.children[i]),
                                 boundary=rp.boundary[i], embedding_grad_accumulator=emb_buf)
        ctx.cp_pass, ctx.cp_tokens = plan, tokens[plan.start:plan.end]
        rows, tok = rp.targets(i, sub, tokens)
        keep = (rows >= plan.start) & (rows < plan.end)
        self.stats.max_pass_targets = max(self.stats.max_pass_targets, int((self.batch.target_count[tok[keep]] > 0).sum()))
        return h, ctx, rows[keep] - plan.start, tok[keep]

    def captures(self, i, ctx, grad: bool):
        """Partition ``i``'s captures for the passes below: ``(Captures, produced, leaves)``."""
        if self.cp_group is None:
            return captures_of(ctx, grad=grad)
        if i not in self.cp_rows:
            self.cp_rows[i] = self.rp.needed(i)
        kv, produced, leaves = cp_captures(ctx, ctx.cp_pass, self.cp_rows[i], self.cp_group, grad)
        states: Dict[int, Dict[str, torch.Tensor]] = {}
        if self.cp_recurrent:
            states, more, more_leaves = cp_state_captures(ctx, ctx.cp_pass, self.rp.boundary[i], self.cp_group, grad)
            produced, leaves = produced + more, leaves + more_leaves
        return Captures(kv, states), produced, leaves

    def empty(self) -> TreeBatch:
        if self._empty is None:
            self._empty = empty_row(self.batch.device, self.batch)
        return self._empty

    # forward-only phases ----------------------------------------------------------------
    def collect(self, model, with_entropy: bool, counting: Sequence[PassPart] = (), logprobs: bool = True,
                value_head=None):
        """No-gradient log-probs (and entropies) ``[N]`` of every target token under ``model``;
        ``counting``: parts that see every pass too (:meth:`PassPart.on_collect`; ``logprobs=False``:
        those alone); with ``value_head`` (a Critic), its values instead of log-probs."""
        N, dev = self.N, self.batch.device
        lp = torch.full((N,), float("nan"), dtype=torch.float64, device=dev)
        en = torch.full((N,), float("nan"), dtype=torch.float64, device=dev) if with_entropy else None
        rp = self.rp
        order = list(range(len(rp.parts)))
        n_fwd = len(order) if not self.failed else 0
        total = align_forwards([c[0] for c in self.comm.gather_lists([n_fwd])]) if self.aligned else n_fwd
        captured: Dict[int, Captures] = {}
        chain: List[int] = []
        with torch.no_grad():
            for step in range(total):
                if self.failed and not self.aligned:
                    break
                if step >= n_fwd or self.failed:
                    self._empty_forward(model, value_head)
                    continue
                i = order[step]
                while chain and chain[-1] != rp.parts[i].parent:
                    captured.pop(chain.pop(), None)
                sub, tokens = rp.row(i)
                guard = OOMGuard()

                def run(m, i=i, sub=sub, tokens=tokens, guard=guard):
                    h, ctx, rows, tok = self.forward_pass(m, i, sub, tokens, captured, guard=guard)
                    for part in counting:
                        part.on_collect(self, ctx, tokens)
                    if not logprobs:
                        return tokens[:0], h[:0, 0], None, ctx
                    keep = self.batch.target_count[tok] > 0
                    if value_head is not None:
                        return tok[keep], value_head.values(h[rows[keep]]), None, ctx
                    logp, ent = token_logprobs(h[rows[keep]], output_weight(m), self.batch.input_ids[tok[keep]],
                                               chunk_rows=self.chunk_rows, with_entropy=with_entropy)
                    return tok[keep], logp, ent, ctx

                try:
                    tok, logp, ent, ctx = in_forward(model, run)
                except torch.OutOfMemoryError:
                    if self.sharded:
                        raise
                    self.failed = True
                    continue
                if guard.failed:
                    self.failed = True
                    continue
                lp[tok] = logp.double()
                if en is not None:
                    en[tok] = ent.double()
                if self.cp_group is None or rp.children[i]:
                    captured[i] = self.captures(i, ctx, grad=False)[0]
                chain.append(i)
                self.stats.extra_forwards += rp.parts[i].size if self.cp_group is None else ctx.cp_pass.size
        if self.cp_group is not None:  # each rank filled the targets (and the parts' counts) of its ranges
            lp, en = _group_sum(lp, self.cp_group), (_group_sum(en, self.cp_group) if en is not None else None)
        for part in counting:
            part.collected(self.cp_group)
        return lp, en

    def _empty_forward(self, model, head=None):
        """An empty pass (its loss is 0; under a gradient it keeps a tiny graph); ``head``: the
        critic of a values pass."""
        row = self.empty()

        def run(m):
            h, _ = forward_partition(m, row, self.attention, None, False, None)
            return self._zero(m, h, head)

        loss = in_forward(model, run)
        self.stats.empty_passes += 1
        return loss

    def _zero(self, m, h, head=None) -> torch.Tensor:
        """A zero loss through ``h`` and the output head (a pass without targets), and through the
        critic's head when one runs (``head``: the critic of a values pass): under FSDP2 every rank
        calls the same sharded modules the same number of times."""
        zero = h.sum() + output_weight(m).sum()
        if head is not None:
            zero = zero + head.values(h[:1] * 0).sum()
        else:
            zero = _plus(zero, [part.zero(h) for part in self.parts])
        return zero * 0

    # the gradient phase -------------------------------------------------------------------
    def head_loss(self, m, h, rows, tok, emb_buf, out_buf, grads):
        """This partition's share of the loss (a tensor to backward) and its detached log-probs."""
        b = self.batch
        if not self.sel.numel():  # no targets in this micro-batch (a padding one): a zero loss
            return self._zero(m, h), None
        if self.spec.fused_sft:
            w = b.token_weights(self.aggregation)[tok]
            keep = w != 0
            coef = (w[keep] / self.Z if self.Z > 0 else torch.zeros_like(w[keep])).to(h.dtype)
            loss = weighted_nll(h[rows[keep]], output_weight(m), b.input_ids[tok[keep]], coef,
                                chunk_rows=self.chunk_rows, weight_grad_accumulator=out_buf)
            targeted = [part for part in self.parts if part.reads_targets]
            if targeted:  # (the parts' terms on the target tokens)
                keep = b.target_count[tok] > 0
                loss = _plus(loss, [part.on_targets(self, h[rows[keep]], tok[keep]) for part in targeted])
            return loss, None
        keep = b.target_count[tok] > 0
        tok = tok[keep]
        terms = [part.on_targets(self, h[rows[keep]], tok) for part in self.parts if part.reads_targets]
        if not self.policy:  # e.g. a separate critic's trunk: the parts' terms only
            return _plus(None, terms), None
        logp, ent = token_logprobs(h[rows[keep]], output_weight(m), b.input_ids[tok], chunk_rows=self.chunk_rows,
                                   with_entropy=self.spec.needs_entropy)
        if grads is not None:  # the surrogate of a sequence-level loss
            g_lp, g_ent = grads
            loss = (g_lp[tok].to(logp.dtype) * logp).sum()
            if g_ent is not None:
                loss = loss + (g_ent[tok].to(ent.dtype) * ent).sum()
        else:
            loss, _ = loss_from_logprobs(self.objective, b, tok, logp, ent, aggregation=self.aggregation,
                                         normalizer=self.Z, ref=self.ref)
        loss = _plus(loss, terms)
        return loss, (tok, logp.detach(), None if ent is None else ent.detach())

    def gradient_phase(self, grads) -> float:
        rp, model = self.rp, self.model
        word = dfs_word(rp.parents)
        if self.aligned:
            words = [decode(w) for w in self.comm.gather_lists(encode(word))]
            ops = align(words)[self.comm.rank]
        else:
            ops = word
        emb, W_out = model.tok_embeddings.weight, None
        use_buffers = not self.sharded
        emb_buf = _accumulator(emb) if use_buffers else None
        out_buf = None
        if use_buffers and self.spec.fused_sft:
            W_out = output_weight(model)
            out_buf = emb_buf if W_out is emb and emb_buf is not None else _accumulator(W_out)
        captured: Dict[int, Captures] = {}
        chain: List[_Live] = []
        empties: List[_Live] = []
        total = 0.0
        for kind, i in ops:
            if self.failed and not self.aligned:
                break  # no collectives to keep company: drop the rest
            if kind == FORWARD:
                if i < 0 or self.failed:
                    live = _Live(-1 if i < 0 else i, self._empty_forward(model), [], [])
                    (empties if i < 0 else chain).append(live)
                    continue
                live, value = self._forward_real(i, captured, emb_buf, out_buf, grads)
                if live is None:  # out of memory (caught): the rest runs empty
                    chain.append(_Live(i, self._empty_forward(model), [], []))
                    continue
                chain.append(live)
                total += value
            else:
                live = empties.pop() if i < 0 else chain.pop()
                if i >= 0 and live.index != i:
                    raise AssertionError(f"pass schedule out of order: backward of {i}, chain top {live.index}")
                self._finish(live)
                # (the pass's graph, and what its nodes keep beyond their saved tensors, goes now,
                # not when the next pass's forward has replaced it)
                del live
                captured.pop(i, None)
        for param, buf in ((emb, emb_buf), (W_out, out_buf if out_buf is not emb_buf else None)):
            if buf is not None and param is not None and not self.failed and buf is not param.grad:
                param.grad = buf if param.grad is None else param.grad.add_(buf)
        return total

    def _forward_real(self, i, captured, emb_buf, out_buf, grads):
        rp = self.rp
        sub, tokens = rp.row(i)
        guard = OOMGuard()

        def run(m):
            h, ctx, rows, tok = self.forward_pass(m, i, sub, tokens, captured, emb_buf, guard)
            if guard.failed:
                return self._zero(m, h), None, ctx
            loss, got = self.head_loss(m, h, rows, tok, emb_buf, out_buf, grads)
            if self.cp_group is not None:  # every layer's backward runs (the path rows travel in it)
                loss = loss + 0.0 * h.sum()
            loss = _plus(loss, [part.on_pass(self, ctx, tokens) for part in self.parts])
            return loss, got, ctx

        try:
            loss, got, ctx = in_forward(self.model, run)
        except torch.OutOfMemoryError:
            if self.sharded:
                raise
            self.failed = True
            return None, 0.0
        if guard.failed:
            self.failed = True
            return _Live(i, loss, [], []), 0.0
        if got is not None:
            self.collected.append(got)
        cap, produced, leaves = self.captures(i, ctx, grad=True) if rp.children[i] else (Captures({}, {}), [], [])
        captured[i] = cap
        size = rp.parts[i].size if self.cp_group is None else ctx.cp_pass.size
        self.stats.partitions += 1
        self.stats.token_forwards += size
        self.stats.per_partition.append(size)
        return _Live(i, loss, produced, leaves), float(loss.detach())

    def _finish(self, live: _Live) -> None:
        tensors, grads = [live.loss], [torch.ones_like(live.loss)]
        if self.cp_group is not None:
            more, g = cp_relay(live.produced, live.leaves, self.cp_group)
            try:
                torch.autograd.backward(tensors + more, grads + g)
            except BaseException:  # (the sends it left in flight: waited on, bounded, not left to a later pass)
                p2p.abandon()
                raise
            return
        for t, leaf in zip(live.produced, live.leaves):
            # (a tensor computed from frozen parameters only, e.g. layer 0's keys under LoRA on q/v, has no graph)
            if leaf.grad is not None and t.requires_grad:
                tensors.append(t)
                grads.append(leaf.grad)
        try:
            torch.autograd.backward(tensors, grads)
        except torch.OutOfMemoryError:
            if self.sharded:
                raise
            self.failed = True


def run_micro_batch(
    model,
    objective,
    batch: TreeBatch,
    *,
    aggregation: str,
    normalizer: float,
    budget_tokens: Optional[int] = None,
    attention: Any = "auto",
    chunk_rows: Optional[int] = None,
    stats: Optional[PartitionStats] = None,
    comm: Optional[Collectives] = None,
    failed: bool = False,
    router_normalizer: Optional[float] = None,
    critic=None,
    critic_only: bool = False,
    cp_group=None,
) -> MicroBatchResult:
    """The keyword face of :func:`run_passes` (library use and tests; the training step builds
    its :class:`PassSpec` and parts once, :mod:`treelit.lightning.executors`).

    Forward and backward ``batch`` (accumulating ``.grad``) under ``budget_tokens`` tokens
    per chain of partitions (None: one pass). ``normalizer``: the step-global Z.
    ``failed``: an earlier micro-batch of this update ran out of memory (this one then runs
    empty passes only, keeping the collectives of the other ranks company).
    A mixture-of-experts model whose router loss is on adds it (``router_normalizer``: its
    step normaliser, see :mod:`treelit.loss.router`), folded per pass; a row cut into several
    passes first takes every token's routing in a no-gradient pass (``extra_forwards``).
    ``critic`` (a :class:`~treelit.models.critic.Critic`; the batch went through
    :func:`~treelit.objectives.critic.set_tree_advantages`): its value loss is folded into each
    pass, read from ``model``'s hidden states: the policy's (a shared critic) or, with
    ``critic_only`` and ``model`` the critic's trunk, a separate critic's (``objective`` unused).
    ``cp_group`` (context parallelism, attention models): every pass's row is split over the
    group's C ranks (:mod:`treelit.partition.context_parallel`), which hold the same ``batch``;
    ``budget_tokens`` is then per rank, so a chain of partitions may hold ``C x budget_tokens``
    tokens. The ranks' gradients sum to the one-process gradient; the loss and metrics returned
    are the whole micro-batch's on every rank."""
    parts: List[PassPart] = [] if critic_only else [RouterPass(router_normalizer)]
    if critic is not None:
        parts.append(ValuePass(critic, policy=not critic_only))
    spec = PassSpec(aggregation, normalizer, budget_tokens, attention, chunk_rows, cp_group)
    state = PassState(stats if stats is not None else PartitionStats(), comm if comm is not None else Collectives(1),
                      failed)
    return run_passes(model, objective, batch, spec, parts, state)


def run_passes(model, objective, batch: TreeBatch, spec: PassSpec, parts: Sequence[PassPart] = (),
               state: Optional[PassState] = None) -> MicroBatchResult:
    """Forward and backward ``batch`` (accumulating ``.grad``) as ``spec`` says, folding the
    objective's loss and each of ``parts``' terms (:mod:`treelit.partition.parts`) into its
    passes. ``objective`` is unused when a part says it is the pass's only loss
    (``PassPart.policy``). See :func:`run_micro_batch` for the phases and their options."""
    state = state if state is not None else PassState()
    stats, cp_group = state.stats, spec.cp_group
    policy = all(part.policy for part in parts)
    fold = fold_spec(objective) if policy else FoldSpec(True, False, False, False)
    N = batch.num_tokens
    stats.tree_tokens += N
    stats.budget = spec.budget_tokens
    C = dist.get_world_size(cp_group) if cp_group is not None else 1
    plan = _plan(batch, spec.budget_tokens, cp_group)
    stats.max_chain_tokens = max(stats.max_chain_tokens, -(-plan.max_chain_tokens // C))  # per rank (about)
    run = _Run(model, objective, batch, plan, fold, spec, state)
    _join(run, cp_group)
    run.policy = policy
    run.parts = [part for part in parts if part.bind(run)]
    # (e.g. the router loss: every token's routing first; under context parallelism every rank's ranges, summed)
    counting = [part for part in run.parts if part.counts_first(run)]
    if fold.reference_model:
        with objective.as_reference(model) as reference:
            run.ref, _ = run.collect(reference, with_entropy=False)
    grads = None
    metrics: Dict[str, float] = {}
    value = None
    if counting and fold.token_separable:
        run.collect(model, with_entropy=False, counting=counting, logprobs=False)
    if not fold.token_separable:
        lp, en = run.collect(model, with_entropy=fold.needs_entropy, counting=counting)
        grads, value, metrics = _sequence_grads(run, lp, en, spec)
    total = run.gradient_phase(grads)
    recomputed = False
    if run.cp_group is not None:
        for part in run.parts:
            part.reduce(run.cp_group, batch.device)
    if value is None and run.cp_group is not None:
        value = _group_sum(torch.tensor([total], dtype=torch.float64, device=batch.device), run.cp_group).item()
        if not fold.fused_sft and run.sel.numel() and run.policy:  # every rank's log-probs, for the metrics
            recomputed = True
            value, metrics = _recomputed(run, *_gather_collected(run, fold.needs_entropy), spec)
    elif value is None:
        value = total
        if not fold.fused_sft and run.collected and not run.failed and run.sel.numel():
            recomputed = True
            # the value and metrics from all targets at once (the same arithmetic as tree mode)
            tok = torch.cat([c[0] for c in run.collected])
            logp = torch.cat([c[1] for c in run.collected])
            ent = torch.cat([c[2] for c in run.collected]) if fold.needs_entropy else None
            value, metrics = _recomputed(run, tok, logp, ent, spec)
    elif not fold.token_separable:
        value = _with_parts(run, value)  # (the surrogate passes' terms are in ``total`` only)
    if not run.policy:  # (``value``: the passes' total, summed over a context-parallel group)
        metrics = {}
    for part in run.parts:
        metrics = {**metrics, **part.metrics()}
    return MicroBatchResult(value, metrics, run.failed)


def _sequence_grads(run: "_Run", lp, en, spec: PassSpec):
    """A sequence-level objective's ``(dL/dlogp, dL/dentropy)``, loss value and metrics from the
    no-gradient log-probs ``lp`` and entropies ``en`` of every target."""
    batch, N = run.batch, run.N
    if not run.sel.numel():  # nothing to train (a padding micro-batch)
        return (torch.zeros(N, dtype=torch.float64, device=batch.device), None), 0.0, {}
    if run.failed:
        return (torch.zeros(N, dtype=torch.float64, device=batch.device), None), None, {}
    sel = run.sel
    leaf_lp = lp[sel].to(_dtype(run.model)).requires_grad_()
    leaf_en = en[sel].to(_dtype(run.model)).requires_grad_() if en is not None else None
    with torch.enable_grad():
        loss, metrics = loss_from_logprobs(run.objective, batch, sel, leaf_lp, leaf_en, aggregation=spec.aggregation,
                                           normalizer=spec.normalizer, ref=run.ref)
        inputs = [leaf_lp] + ([leaf_en] if leaf_en is not None else [])
        g = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else [None] * len(inputs)
    g_lp = torch.zeros(N, dtype=torch.float64, device=batch.device)
    if g[0] is not None:
        g_lp[sel] = g[0].double()
    g_en = None
    if leaf_en is not None:
        g_en = torch.zeros(N, dtype=torch.float64, device=batch.device)
        if g[1] is not None:
            g_en[sel] = g[1].double()
    return (g_lp, g_en), float(loss.detach()), metrics


def _recomputed(run: "_Run", tok, logp, ent, spec: PassSpec):
    """The micro-batch's loss value (with the parts' values) and metrics from every target's
    detached log-probs: the same arithmetic as tree mode."""
    with torch.no_grad():
        loss, metrics = loss_from_logprobs(run.objective, run.batch, tok, logp, ent, aggregation=spec.aggregation,
                                           normalizer=spec.normalizer, ref=run.ref)
    return _with_parts(run, float(loss)), metrics


def _with_parts(run: "_Run", value: float) -> float:
    for part in run.parts:
        value += part.value()
    return value


def _plus(loss: Optional[torch.Tensor], terms) -> Optional[torch.Tensor]:
    """``loss`` plus each term that is not None, in order."""
    for t in terms:
        if t is not None:
            loss = t if loss is None else loss + t
    return loss


def _accumulator(param) -> Optional[torch.Tensor]:
    """Where a trained ``param``'s gradient is added up during the passes: its ``.grad`` when it
    has one (no second ``[V, D]`` copy; autograd adds into it in place too), else a new buffer
    that becomes its ``.grad`` (an out-of-memory attempt clears the gradients either way)."""
    if param is None or not param.requires_grad:
        return None
    g = param.grad
    if g is not None and g.dtype == param.dtype and g.shape == param.shape and not g.is_sparse:
        return g
    return torch.zeros_like(param)


_group_sum = group_sum  # (the sum over a group of the values set, NaN where none is)


def _gather_collected(run: "_Run", with_entropy: bool):
    """Every target's detached log-prob (and entropy) from the ranks of the group that computed it."""
    N, dev = run.N, run.batch.device
    lp = torch.full((N,), float("nan"), dtype=torch.float64, device=dev)
    en = torch.full((N,), float("nan"), dtype=torch.float64, device=dev) if with_entropy else None
    for tok, logp, ent in run.collected:
        lp[tok] = logp.double()
        if en is not None:
            en[tok] = ent.double()
    lp = _group_sum(lp, run.cp_group)
    en = _group_sum(en, run.cp_group) if en is not None else None
    tok = torch.nonzero(~torch.isnan(lp)).squeeze(1)
    dtype = _dtype(run.model)
    return tok, lp[tok].to(dtype), (en[tok].to(dtype) if en is not None else None)


def _dtype(model) -> torch.dtype:
    p = next(model.parameters())
    dt = p.dtype
    return dt if dt in (torch.float32, torch.float64) else torch.float32


@torch.no_grad()
def partitioned_values(trunk, critic, batch: TreeBatch, *, budget_tokens: Optional[int] = None,
                       attention: Any = "auto", comm: Optional[Collectives] = None,
                       stats: Optional[PartitionStats] = None, cp_group=None) -> torch.Tensor:
    """``[N]`` float64 values of every target token's state (NaN elsewhere): ``critic``'s head on
    ``trunk``'s hidden states, from a no-gradient pass over the partitions of ``budget_tokens``
    (``cp_group``: each pass split over its ranks, ``budget_tokens`` per rank, as in
    :func:`run_micro_batch`; every rank gets every value)."""
    comm = comm if comm is not None else Collectives(1)
    stats = stats if stats is not None else PartitionStats()
    run = _Run(trunk, None, batch, _plan(batch, budget_tokens, cp_group), FoldSpec(False, False, False, False),
               PassSpec("sum", 1.0, budget_tokens, attention, None), PassState(stats, comm))
    _join(run, cp_group)
    values, _ = run.collect(trunk, with_entropy=False, value_head=critic)
    if comm.max(float(run.failed)) > 0:
        raise torch.OutOfMemoryError(f"out of memory computing the critic's values (budget {budget_tokens} tokens)")
    return values


@torch.no_grad()
def policy_logprobs(model, batch: TreeBatch, *, budget_tokens: Optional[int] = None, attention: Any = "auto",
                    chunk_rows: Optional[int] = None, comm: Optional[Collectives] = None,
                    stats: Optional[PartitionStats] = None, cp_group=None) -> torch.Tensor:
    """``[N]`` float64 log-probs of every target token under ``model`` (NaN elsewhere), from a
    no-gradient pass over the partitions of ``budget_tokens`` (rollout log-probs; ``cp_group``:
    each pass split over its ranks, ``budget_tokens`` per rank, as in :func:`run_micro_batch`)."""
    comm = comm if comm is not None else Collectives(1)
    stats = stats if stats is not None else PartitionStats()
    spec = FoldSpec(False, False, False, False)
    run = _Run(model, None, batch, _plan(batch, budget_tokens, cp_group), spec,
               PassSpec("sum", 1.0, budget_tokens, attention, chunk_rows), PassState(stats, comm))
    _join(run, cp_group)
    lp, _ = run.collect(model, with_entropy=False)
    if comm.max(float(run.failed)) > 0:
        raise torch.OutOfMemoryError(f"out of memory computing rollout log-probs (budget {budget_tokens} tokens)")
    return lp


def _plan(batch: TreeBatch, budget_tokens: Optional[int], cp_group):
    """The partition plan of ``batch`` under ``budget_tokens`` per rank (None: one pass); a chain
    of a context-parallel group's passes holds C x that."""
    C = dist.get_world_size(cp_group) if cp_group is not None else 1
    chain_budget = None if budget_tokens is None else budget_tokens * C
    if chain_budget is None or chain_budget >= batch.num_tokens:
        return whole_row_plan(batch)
    return plan_partitions(batch, chain_budget, per_rank=C)


def _join(run: "_Run", cp_group) -> None:
    """Split ``run``'s passes over ``cp_group``'s ranks (context parallelism; one rank: nothing)."""
    C = dist.get_world_size(cp_group) if cp_group is not None else 1
    if C > 1:
        run.cp_group, run.cp_size = cp_group, (C, dist.get_rank(cp_group))
        run.chunk_rows = cp_chunk_rows(run.chunk_rows, run.model, C)
