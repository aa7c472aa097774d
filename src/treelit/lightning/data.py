"""``TreeDataModule``: records -> trees -> packed micro-batches -> optimizer steps.

Trees are built once (``check_against`` / ``setup``) from a JSONL/JSON/Parquet file
through the tree builder's :class:`~treelit.builders.assemble.Assembler`, every record
checked against the model (vocabulary, context length) and what the objective reads
before training starts (``on_error=skip`` skips and counts bad records instead; trees
lacking an optional field still pack with the others), then served as an endless, reproducible stream of *steps*: in each data
epoch the trees are shuffled (seeded by ``seed`` and the epoch number), packed in
order into micro-batches of at most ``micro_batch_tokens`` tree tokens, and grouped
``micro_batches_per_step`` at a time. A step is one optimizer update; its
normaliser is computed over all of its micro-batches. The module's state (steps
consumed) is saved in Lightning checkpoints, so a resumed run continues with
exactly the batches an uninterrupted run would have seen. For data larger than memory
see :mod:`treelit.lightning.streaming`; for rollouts arriving during training,
:mod:`treelit.lightning.rollouts`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from treelit.builders.assemble import Assembler, Limits
from treelit.builders.base import BuiltTree, TreeBuilder
from treelit.builders.sequences import SequencesBuilder
from treelit.data.limits import MiB, ReadLimits, out_of_memory
from treelit.data.records import DataError, ReadStats, Record, iter_file, read_records
from treelit.utils.paths import resolve_data_path
from treelit.tree.batch import TreeBatch
from treelit.tree.images import image_counts
from treelit.tree.token_tree import TokenTree
from treelit.utils.distributed import data_parallel_rank

__all__ = ["TreeDataModule", "StepBatch", "tree_origin"]

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """The micro-batches of one optimizer step (this rank's share of it)."""

    micro_batches: List[TreeBatch]
    index: int  # global step index in the data stream
    load_imbalance: float = 1.0  # max over ranks of the assigned cost / mean (1 = balanced)
    # per micro-batch, its trees as "id (file:line)" (None: not known), for messages that name them
    origins: Optional[List[List[str]]] = None

    def on(self, device: torch.device) -> "StepBatch":
        """The same step with its micro-batches on ``device``."""
        return replace(self, micro_batches=[b.to(device) for b in self.micro_batches])

    @property
    def tree_tokens(self) -> int:
        return sum(b.num_tokens for b in self.micro_batches)

    @property
    def flat_tokens(self) -> int:
        return sum(b.flat_tokens for b in self.micro_batches)

    @property
    def shared_tokens_lost(self) -> int:
        """Tree tokens that log-prob / routing splits added (``tree/shared_tokens_lost``)."""
        return sum(b.shared_tokens_lost for b in self.micro_batches)


def tree_origin(t: BuiltTree) -> str:
    """A tree as messages name it: its id and the record it came from (``file:line``)."""
    return f"{t.id} ({t.source})"


def _pack_indices(order: List[int], sizes: List[int], budget: int) -> List[List[int]]:
    """Greedy in-order packing of trees into rows of at most ``budget`` tokens (a larger tree
    gets a row of its own)."""
    rows: List[List[int]] = []
    cur: List[int] = []
    size = 0
    for t in order:
        if cur and size + sizes[t] > budget:
            rows.append(cur)
            cur, size = [], 0
        cur.append(int(t))
        size += sizes[t]
    if cur:
        rows.append(cur)
    return rows


def _tree_cost(batch: TreeBatch, attention_cost: float) -> float:
    """Tree tokens plus weighted attention work (sum over segments of length x path)."""
    start, length, parent = batch.seg_start.numpy(), batch.seg_len.numpy(), batch.seg_parent.numpy()
    path = np.zeros(len(start))
    for s in range(len(start)):
        if parent[s] >= 0:
            path[s] = path[parent[s]] + length[parent[s]]
    pairs = float((length * path + length * (length + 1) / 2).sum())
    return batch.num_tokens + attention_cost * pairs


def _assign(trees: List[int], cost: np.ndarray, world: int) -> List[List[int]]:
    """Largest-cost-first onto the least loaded rank (deterministic; ties by rank)."""
    shares: List[List[int]] = [[] for _ in range(world)]
    load = [0.0] * world
    for t in sorted(trees, key=lambda t: (-cost[t], t)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(t)
        load[r] += cost[t]
    return [sorted(s, key=trees.index) for s in shares]


def build_trees(path: str, builder: TreeBuilder, *, on_error: str = "raise", limits: Optional[Limits] = None,
                stats: Optional[ReadStats] = None, read_limits: Optional[ReadLimits] = None,
                branch_hook: Optional[Callable[[Record, List[Dict[str, Any]]], Optional[List[Dict[str, Any]]]]] = None
                ) -> List[BuiltTree]:
    """Every tree of a data file, in memory, through the builder's :class:`Assembler` (or its
    own ``__call__`` for builders that only define that, checked against the model per tree),
    each record read within ``read_limits`` (:mod:`treelit.data.limits`), its encoded branches
    passed through ``branch_hook`` (see :class:`Assembler`; e.g. per-token staleness,
    :mod:`treelit.lightning.token_staleness`)."""
    stats = stats if stats is not None else ReadStats()
    limits = limits or Limits()
    if on_error not in ("raise", "skip"):
        raise ValueError(f"data.on_error must be 'raise' or 'skip', got {on_error!r}")
    if type(builder).__call__ is not TreeBuilder.__call__:
        return _legacy_build(path, builder, on_error, limits, stats, read_limits)
    asm = Assembler(builder, on_error=on_error, limits=limits, stats=stats, name=str(path), branch_hook=branch_hook)
    trees: List[BuiltTree] = []
    for item in iter_file(path, limits=read_limits):
        if isinstance(item, DataError):
            if on_error == "raise":
                raise item
            stats.skip(item)
            continue
        stats.read += 1
        try:
            trees += asm.add(item)
        except MemoryError:
            raise out_of_memory(item.source, read_limits) from None
    try:
        trees += asm.flush()
    except MemoryError:
        raise out_of_memory(f"{path} (building the trees of its groups)", read_limits) from None
    asm.report()
    return trees


def _legacy_build(path, builder, on_error, limits, stats, read_limits) -> List[BuiltTree]:
    records = read_records(path, on_error=on_error, validate=getattr(builder, "validate", None), stats=stats,
                           limits=read_limits)
    trees = []
    for t in builder(records):
        try:
            t.tree.to_batch().validate_for_model(limits.vocab_size or 2**62, limits.max_seq_len)
        except MemoryError:
            raise out_of_memory(t.source, read_limits) from None
        except Exception as exc:
            err = DataError(f"{t.source} (tree {t.id!r}): {exc}")
            if on_error == "raise":
                raise err from exc
            stats.skip(err)
            continue
        trees.append(t)
    return trees


_PRESENT_TOGETHER = {
    "token_old_logp": ("branch_old_logp",), "token_ref_logp": ("branch_ref_logp",),
    "adv_pos_sum": ("adv_neg_sum", "adv_pos_mean", "adv_neg_mean", "branch_adv"),
    "branch_token_adv": (),
}


def _image_totals(trees: Any) -> Dict[str, int]:
    """The data's image counts (:func:`~treelit.tree.images.image_counts` summed over the trees);
    empty when no tree has images (the statistics of text data stay as they were)."""
    total = {"images": 0, "distinct_images": 0, "shared_images": 0}
    for tree in trees:
        for k, v in image_counts(tree).items():
            total[k] += v
    return total if total["images"] else {}


def conform_batches(batches: List[TreeBatch]) -> List[TreeBatch]:
    """Give every batch the same optional fields so that any of them pack together: a branch
    field some trees lack is None on theirs, missing rollout/reference log-probs are NaN
    (unknown), a missing advantage is NaN (an objective that needs one refuses it; the data
    module's checks make sure none reaches such an objective)."""
    keys = set().union(*(b.branch_fields.keys() for b in batches)) if batches else set()
    for b in batches:
        for k in keys - b.branch_fields.keys():
            b.branch_fields[k] = [None] * b.num_branches
    for lead, rest in _PRESENT_TOGETHER.items():
        have = [getattr(b, lead) is not None for b in batches]
        if all(have) or not any(have):
            continue
        for b, h in zip(batches, have):
            if h:
                continue
            N, F, B = b.num_tokens, b.flat_tokens, b.num_branches
            for name in (lead,) + rest:
                if name == "branch_adv":
                    val = torch.full((B,), float("nan"), dtype=torch.float64)
                elif name == "branch_token_adv":  # a tree with per-branch advantages: its branch's on every token
                    adv = torch.zeros(B, dtype=torch.float64) if b.branch_adv is None else b.branch_adv.nan_to_num(0.0)
                    val = torch.repeat_interleave(adv.cpu(), torch.diff(b.branch_ptr.cpu()))
                elif name.startswith("adv_"):
                    val = torch.zeros(N, dtype=torch.float64)
                else:
                    val = torch.full((F if name.startswith("branch_") else N,), float("nan"), dtype=torch.float64)
                setattr(b, name, val)
    routed = [b.token_routing for b in batches if b.token_routing is not None]
    if routed:  # tokens of trees without a record route live (-1)
        for b in batches:
            if b.token_routing is None:
                b.token_routing = torch.full((b.num_tokens, *routed[0].shape[1:]), -1, dtype=torch.long)
    return batches


def _empty_batch() -> TreeBatch:
    """A two-token row with no targets: a pass that contributes nothing but its collectives."""
    return TokenTree.from_branches([[0, 0]], loss_masks=[[0, 0]]).to_batch()


class _StepStream(IterableDataset):
    def __init__(self, dm: "TreeDataModule") -> None:
        self.dm = dm

    def __iter__(self) -> Iterator[StepBatch]:
        step = self.dm.consumed_steps
        while True:
            yield self.dm.step(step)
            step += 1


class TreeDataModule(pl.LightningDataModule):
    """Args:
        train_path: data file (``.jsonl``, ``.json``, ``.parquet``; ``.gz`` for JSON).
        tree_builder: a tree builder instance (default ``sequences``).
        micro_batch_tokens: tree-token budget of one packed micro-batch.
        micro_batches_per_step: micro-batches per optimizer step (gradient accumulation).
        shuffle: shuffle trees each data epoch (seeded).
        seed: shuffling seed.
        on_error: ``raise`` or ``skip`` for malformed records (skips are counted and logged).
        max_trees: use only the first trees (smoke tests).
        attention_cost: weight of attention work (query x key pairs, the sum over segments of
            length x path) against tree tokens in the cost that assigns trees to ranks.
        max_record_bytes, max_branches_per_record, max_expansion_ratio: what reading one
            record may cost (:class:`~treelit.data.limits.ReadLimits`); a record over a limit
            is a data error naming it (``on_error=skip`` skips it).

    With several processes, every rank computes the same global step (the trees a single
    process would train on in that step), assigns its trees to ranks by cost (largest first,
    to the least loaded rank) so that ranks finish together, packs its own share, and pads
    it with empty micro-batches to the largest share's count, so every rank runs the same
    number of passes and collectives.
    """

    def __init__(
        self,
        train_path: Optional[str] = None,
        tree_builder: Optional[TreeBuilder] = None,
        micro_batch_tokens: int = 8192,
        micro_batches_per_step: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        on_error: str = "raise",
        max_trees: Optional[int] = None,
        attention_cost: float = 1.0 / 1024,
        max_record_bytes: int = 64 * MiB,
        max_branches_per_record: int = 65_536,
        max_expansion_ratio: int = 100,
    ) -> None:
        super().__init__()
        self.read_limits = ReadLimits(max_record_bytes, max_branches_per_record, max_expansion_ratio)
        if not train_path:
            raise ValueError("data.train_path is required (a .jsonl, .json or .parquet file)")
        if micro_batch_tokens <= 0 or micro_batches_per_step <= 0:
            raise ValueError("data.micro_batch_tokens and data.micro_batches_per_step must be positive")
        self.train_path = resolve_data_path(str(train_path))  # a bundled file's name too
        self.builder = tree_builder or SequencesBuilder()
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.micro_batches_per_step = int(micro_batches_per_step)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.on_error = on_error
        self.max_trees = max_trees
        self.read_stats = ReadStats()
        self.trees: List[BuiltTree] = []
        self._batches: List[TreeBatch] = []
        self._epoch_cache: Dict[int, List[List[List[int]]]] = {}
        self._epoch_len: Dict[int, int] = {}
        self.consumed_steps = 0
        self.attention_cost = float(attention_cost)
        self.rank, self.world = 0, 1
        self.limits = Limits()

    # building ----------------------------------------------------------------------------
    def setup(self, stage: Optional[str] = None) -> None:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            self.rank, self.world = data_parallel_rank(trainer)  # (context parallelism: per group)
        if self.trees:
            return
        self.read_stats = ReadStats()
        trees = build_trees(self.train_path, self.builder, on_error=self.on_error, limits=self.limits,
                            stats=self.read_stats, read_limits=self.read_limits)
        if self.max_trees:
            trees = trees[: self.max_trees]
        if not trees:
            raise DataError(f"{self.train_path}: no trees to train on ({self.read_stats.skipped} records skipped)")
        self.trees = trees
        self._batches = conform_batches([t.tree.to_batch() for t in trees])
        self._cost = np.array([_tree_cost(b, self.attention_cost) for b in self._batches])
        self._epoch_cache, self._epoch_len = {}, {}
        if self.read_stats.skipped:
            n = self.read_stats.skipped
            log.warning("%s: skipped %d malformed record%s (data.on_error=skip)", self.train_path, n, "s" if n != 1 else "")

    def check_against(self, vocab_size: int, max_seq_len: Optional[int], objective: Any = None,
                      routing: Optional[Tuple[int, int, int]] = None, experts: Optional[int] = None) -> None:
        """Build the trees checked against the model (vocabulary, context length) and what
        ``objective`` reads from the data, so that anything the first step would trip on fails
        here, before training, naming the record (``on_error=skip``: skipped and counted)."""
        limits = Limits(int(vocab_size), None if max_seq_len is None else int(max_seq_len),
                        None if objective is None else objective.data_needs(),
                        "the objective" if objective is None else f"objective={objective.name}", routing,
                        experts)
        if limits != self.limits:
            self.limits = limits
            self.trees = []
        self.setup()

    def stats(self) -> Dict[str, Any]:
        self.setup()
        flat = sum(b.flat_tokens for b in self._batches)
        tree = sum(b.num_tokens for b in self._batches)
        return {
            "trees": len(self._batches),
            "branches": sum(b.num_branches for b in self._batches),
            "flat_tokens": flat,
            "tree_tokens": tree,
            "por": 1 - tree / flat,
            "ideal_speedup": flat / tree,
            "records_skipped": self.read_stats.skipped,
            "longest_branch": max((b.max_depth for b in self._batches), default=0),
            **_image_totals(t.tree for t in self.trees),
        }

    # the step stream -----------------------------------------------------------------------
    def epoch_steps(self, epoch: int) -> List[List[List[int]]]:
        """The steps of data epoch ``epoch``: per step, its packed rows as lists of tree indices
        (the global plan, the same on every rank; the latest epoch is cached)."""
        if epoch not in self._epoch_cache:
            order = np.arange(len(self._batches))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(order))
            rows = _pack_indices(list(order), [b.num_tokens for b in self._batches], self.micro_batch_tokens)
            k = self.micro_batches_per_step
            self._epoch_cache = {epoch: [rows[i : i + k] for i in range(0, len(rows), k)]}
            self._epoch_len[epoch] = len(self._epoch_cache[epoch])
        return self._epoch_cache[epoch]

    def _epoch_length(self, epoch: int) -> int:
        if epoch not in self._epoch_len:
            self.epoch_steps(epoch)
        return self._epoch_len[epoch]

    def step(self, index: int) -> StepBatch:
        """The ``index``-th step of the stream (deterministic)."""
        self.setup()
        epoch, i = 0, index
        while i >= self._epoch_length(epoch):
            i -= self._epoch_length(epoch)
            epoch += 1
        rows = self.epoch_steps(epoch)[i]
        if self.world == 1:
            return StepBatch([TreeBatch.pack([self._batches[t] for t in row]) for row in rows], index,
                             origins=self._origins(rows))
        trees = [t for row in rows for t in row]
        shares = _assign(trees, self._cost, self.world)
        loads = [sum(self._cost[t] for t in share) for share in shares]
        sizes = [self._batches[t].num_tokens for t in range(len(self._batches))]
        packed = [_pack_indices(share, sizes, self.micro_batch_tokens) for share in shares]
        n_passes = max(1, max(len(p) for p in packed))
        mine = [TreeBatch.pack([self._batches[t] for t in row]) for row in packed[self.rank]]
        mine += [_empty_batch() for _ in range(n_passes - len(mine))]
        mean = sum(loads) / len(loads)
        origins = self._origins(packed[self.rank]) + [[] for _ in range(n_passes - len(packed[self.rank]))]
        return StepBatch(mine, index, max(loads) / mean if mean > 0 else 1.0, origins)

    def _origins(self, rows: List[List[int]]) -> List[List[str]]:
        return [[tree_origin(self.trees[t]) for t in row] for row in rows]

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(_StepStream(self), batch_size=None, num_workers=0, collate_fn=lambda x: x)

    def transfer_batch_to_device(self, batch: StepBatch, device: torch.device, dataloader_idx: int) -> StepBatch:
        return batch.on(device)

    # checkpointed state -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"consumed_steps": self.consumed_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.consumed_steps = int(state.get("consumed_steps", 0))
