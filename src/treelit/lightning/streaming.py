"""``StreamingTreeDataModule``: trees built on the fly from a data source, in bounded memory.

Where :class:`~treelit.lightning.data.TreeDataModule` builds every tree before the first
step, this module reads records lazily (:mod:`treelit.data.sources`), builds trees as
they come and serves them through a shuffle buffer (:class:`~treelit.data.stream.TreeStream`),
so start-up time and host memory do not grow with the data.

Several processes. The data is read by ``num_readers`` logical readers (default: the
number of processes), each owning a disjoint set of shards (shard ``i`` belongs to
reader ``i mod num_readers``) and its own buffer; reader ``r`` runs on rank
``r mod world``, so no rank parses another's shards. Step ``s`` is made of the next
``micro_batches_per_step`` micro-batches of *every* reader, each packed greedily up to
``micro_batch_tokens`` tree tokens: ranks get the same number of nearly full
micro-batches (balanced work; padded with empty ones when readers do not divide evenly
over ranks), and the global batch - hence every update - depends on ``num_readers``
only, not on the number of processes: one process with ``data.num_readers=2`` trains
exactly as two processes do.

Resume. Before producing each step the module snapshots its readers' state (a few
positions, the random state, the buffered trees as record positions); the checkpoint
holds the snapshot of the first step not yet trained, gathered from every rank, so a
run killed mid-shard resumes with exactly the batches it would have seen.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from treelit.builders.assemble import Limits
from treelit.builders.base import BuiltTree, TreeBuilder
from treelit.builders.sequences import SequencesBuilder
from treelit.data.limits import MiB, ReadLimits
from treelit.data.records import DataError, ReadStats
from treelit.data.sources import DataSource
from treelit.data.stream import TreeStream
from treelit.lightning.data import StepBatch, _empty_batch, _image_totals, _tree_cost, conform_batches, tree_origin
from treelit.tree.batch import TreeBatch
from treelit.utils.distributed import data_parallel_rank

__all__ = ["StreamingTreeDataModule"]

log = logging.getLogger(__name__)


class _Steps(IterableDataset):
    def __init__(self, dm: "StreamingTreeDataModule") -> None:
        self.dm = dm

    def __iter__(self) -> Iterator[StepBatch]:
        while True:
            yield self.dm.next_step()


class StreamingTreeDataModule(pl.LightningDataModule):
    """Args:
        source: a :class:`~treelit.data.sources.DataSource` (the ``data.source`` config node).
        tree_builder: a tree builder instance (default ``sequences``).
        micro_batch_tokens: tree-token budget of one packed micro-batch.
        micro_batches_per_step: micro-batches per optimizer step and reader.
        shuffle: shuffle shard order per epoch and draw trees at random from the buffer.
        shuffle_buffer: trees held per reader (the memory bound).
        seed: seed of the shard order and the buffer draws.
        on_error: ``raise`` or ``skip`` (bad records are skipped, counted and logged).
        group_window: on the stream, a group is complete once no record of it has come for
            this many records (groups never span two files).
        num_readers: logical readers (default: the number of processes).
        sample_trees: the first trees served are kept in ``trees`` for callbacks (e.g. the
            reward-margin plot).
        max_record_bytes, max_branches_per_record, max_expansion_ratio: what reading one
            record may cost (:class:`~treelit.data.limits.ReadLimits`, given to the source as
            its ``read_limits``); a record over a limit is a data error naming it.
    """

    def __init__(
        self,
        source: DataSource,
        tree_builder: Optional[TreeBuilder] = None,
        micro_batch_tokens: int = 8192,
        micro_batches_per_step: int = 1,
        shuffle: bool = True,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        on_error: str = "raise",
        group_window: int = 1000,
        num_readers: Optional[int] = None,
        attention_cost: float = 1.0 / 1024,
        sample_trees: int = 64,
        max_record_bytes: int = 64 * MiB,
        max_branches_per_record: int = 65_536,
        max_expansion_ratio: int = 100,
    ) -> None:
        super().__init__()
        if not isinstance(source, DataSource):
            raise ValueError(f"data.source must be a data source (see `treelit list`), got {type(source).__name__}")
        source.read_limits = ReadLimits(max_record_bytes, max_branches_per_record, max_expansion_ratio)
        if micro_batch_tokens <= 0 or micro_batches_per_step <= 0:
            raise ValueError("data.micro_batch_tokens and data.micro_batches_per_step must be positive")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"data.on_error must be 'raise' or 'skip', got {on_error!r}")
        if num_readers is not None and int(num_readers) < 1:
            raise ValueError(f"data.num_readers must be >= 1, got {num_readers}")
        self.source = source
        self.builder = tree_builder or SequencesBuilder()
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.micro_batches_per_step = int(micro_batches_per_step)
        self.shuffle, self.shuffle_buffer, self.seed = bool(shuffle), int(shuffle_buffer), int(seed)
        self.on_error, self.group_window = on_error, int(group_window)
        self.num_readers = None if num_readers is None else int(num_readers)
        self.attention_cost = float(attention_cost)
        self.sample_trees = int(sample_trees)
        self.limits = Limits()
        self.read_stats = ReadStats()
        self.rank, self.world = 0, 1
        self.readers: Dict[int, TreeStream] = {}
        self.pending: Dict[int, Optional[BuiltTree]] = {}
        self.trees: List[BuiltTree] = []
        self.consumed_steps = 0
        self.next_index = 0
        self._snaps: "OrderedDict[int, Dict[int, Any]]" = OrderedDict()
        self._ready: Dict[int, StepBatch] = {}
        self._restore: Optional[Dict[str, Any]] = None

    # readers -----------------------------------------------------------------------------------
    def _num_readers(self) -> int:
        return self.num_readers or self.world

    def _make_readers(self) -> None:
        R, n = self._num_readers(), len(self.source.shards())
        if R > n:
            raise DataError(f"data.num_readers={R} but the data source has {n} shard(s): every reader needs its own "
                            "shards; split the data into more files (or data.source.num_shards) or use fewer readers")
        self.read_stats = ReadStats()
        self.readers = {
            r: TreeStream(self.source, list(range(r, n, R)), self.builder, limits=self.limits, on_error=self.on_error,
                          seed=self.seed, reader=r, shuffle=self.shuffle, buffer_size=self.shuffle_buffer,
                          group_window=self.group_window, stats=self.read_stats)
            for r in range(R) if r % self.world == self.rank
        }
        self.pending = {r: None for r in self.readers}
        self.next_index, self._snaps, self._ready = 0, OrderedDict(), {}
        if self._restore is not None:
            self._apply(self._restore)

    def setup(self, stage: Optional[str] = None) -> None:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and data_parallel_rank(trainer) != (self.rank, self.world):
            self.rank, self.world = data_parallel_rank(trainer)
            self.readers = {}
        if not self.readers:
            self._make_readers()

    def check_against(self, vocab_size: int, max_seq_len: Optional[int], objective: Any = None,
                      routing: Optional[Tuple[int, int, int]] = None, experts: Optional[int] = None) -> None:
        """Check records against the model and the objective as they are read; the first step is
        built here, so bad records at the start of the data fail before training. (A stream is
        not read whole in advance: later records are checked when they come; ``on_error=skip``
        skips and counts them.)"""
        self.limits = Limits(int(vocab_size), None if max_seq_len is None else int(max_seq_len),
                             None if objective is None else objective.data_needs(),
                             "the objective" if objective is None else f"objective={objective.name}", routing,
                             experts)
        self.readers = {}
        self.setup()
        self._ready[self.next_index] = self._produce(self.next_index)

    def stats(self) -> Dict[str, Any]:
        """Statistics of the trees read so far (a stream is not read whole in advance)."""
        self.setup()
        if not self._ready and self.next_index == 0:
            self._ready[0] = self._produce(0)  # the trees read before the first step
        batches = [t.tree.to_batch() for t in self.trees]
        flat = sum(b.flat_tokens for b in batches)
        tree = sum(b.num_tokens for b in batches)
        return {
            "trees": len(batches), "branches": sum(b.num_branches for b in batches), "flat_tokens": flat,
            "tree_tokens": tree, "por": 1 - tree / flat if flat else 0.0, "ideal_speedup": flat / tree if tree else 0.0,
            "records_skipped": self.read_stats.skipped, "shards": len(self.source.shards()),
            "longest_branch": max((b.max_depth for b in batches), default=0),  # of the trees read so far
            "streamed": True, "records_read": self.read_stats.read,  # so far: not the whole data
            "readers": self._num_readers(),
            **_image_totals(t.tree for t in self.trees),  # of the trees read so far
        }

    # steps ----------------------------------------------------------------------------------------
    def _micro_batches(self, r: int) -> List[TreeBatch]:
        """The next ``micro_batches_per_step`` micro-batches of reader ``r``, packed greedily: a
        micro-batch closes when the next tree does not fit, and that tree starts the next one.
        The end of an epoch ends the step (as in memory: the last step of an epoch may be short)."""
        reader, rows, cur, size = self.readers[r], [], [], 0
        while True:
            t = self.pending[r] if self.pending[r] is not None else reader.next_tree()
            self.pending[r] = None
            n = t.tree.num_tokens
            new_epoch = bool(cur) and t.epoch != cur[-1].epoch
            if cur and (size + n > self.micro_batch_tokens or new_epoch):
                rows.append(cur)
                self.pending[r] = t
                if len(rows) == self.micro_batches_per_step or new_epoch:  # an epoch ends its last step
                    break
                cur, size = [], 0
                continue
            if len(self.trees) < self.sample_trees:
                self.trees.append(t)
            cur.append(t)
            size += n
        self._origins += [[tree_origin(t) for t in row] for row in rows]
        return [TreeBatch.pack(conform_batches([t.tree.to_batch() for t in row])) for row in rows]

    def _produce(self, index: int) -> StepBatch:
        self._snaps[index] = {r: self._reader_state(r) for r in self.readers}
        while len(self._snaps) > 8:
            self._snaps.popitem(last=False)
        mine: List[TreeBatch] = []
        self._origins: List[List[str]] = []
        for r in sorted(self.readers):
            mine += self._micro_batches(r)
        per_rank = -(-self._num_readers() // self.world) * self.micro_batches_per_step
        origins = self._origins + [[] for _ in range(per_rank - len(mine))]
        mine += [_empty_batch() for _ in range(per_rank - len(mine))]
        return StepBatch(mine, index, self._imbalance(mine), origins)

    def _imbalance(self, mine: List[TreeBatch]) -> float:
        if self.world == 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return 1.0
        cost = torch.tensor([sum(_tree_cost(b, self.attention_cost) for b in mine)], dtype=torch.float64)
        out = [torch.zeros_like(cost) for _ in range(self.world)]
        torch.distributed.all_gather(out, cost)
        loads = [float(c) for c in out]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def next_step(self) -> StepBatch:
        """The next step of the stream (steps are produced in order)."""
        self.setup()
        index = self.next_index
        step = self._ready.pop(index) if index in self._ready else self._produce(index)
        self.next_index = index + 1
        return step

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(_Steps(self), batch_size=None, num_workers=0, collate_fn=lambda x: x)

    def transfer_batch_to_device(self, batch: StepBatch, device: torch.device, dataloader_idx: int) -> StepBatch:
        return batch.on(device)

    # checkpointed state -----------------------------------------------------------------------------
    def _reader_state(self, r: int) -> Dict[str, Any]:
        p = self.pending[r]
        return {"reader": self.readers[r].state(), "pending": None if p is None else [p.unit, p.unit_index, p.epoch]}

    def state_dict(self) -> Dict[str, Any]:
        c = self.consumed_steps
        mine = self._snaps.get(c)
        if mine is None:  # nothing produced past the last trained step: the live state is it
            mine = {r: self._reader_state(r) for r in self.readers}
        states = dict(mine)
        if self.world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: List[Any] = [None] * self.world
            torch.distributed.all_gather_object(gathered, mine)
            states = {r: s for part in gathered for r, s in part.items()}
        return {"consumed_steps": c, "num_readers": self._num_readers(),
                "readers": {str(r): s for r, s in states.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._restore = state
        if self.readers:
            self._apply(state)

    def _apply(self, state: Dict[str, Any]) -> None:
        if int(state.get("num_readers", self._num_readers())) != self._num_readers():
            raise DataError(f"the checkpoint was written with data.num_readers={state['num_readers']}; resume with the "
                            f"same number of readers (now {self._num_readers()})")
        for r, reader in self.readers.items():
            s = state["readers"][str(r)]
            reader.load(s["reader"])
            p = s["pending"]
            if p is not None:
                self.pending[r] = reader._rebuild(p[0])[p[1]]
                self.pending[r].epoch = int(p[2])
            else:
                self.pending[r] = None
        self.consumed_steps = self.next_index = int(state["consumed_steps"])
        self._snaps, self._ready = OrderedDict(), {}
        self.trees = []
