"""A resumable stream of trees from a data source, in bounded memory.

A :class:`TreeStream` is one *reader*: it reads its shards of a
:class:`~treelit.data.sources.DataSource` record by record, builds trees on the fly
with the tree builder's :class:`~treelit.builders.assemble.Assembler` (groups are held
until none of their keys has been seen for ``group_window`` records, and never span
two shards), and serves them through a shuffle buffer of ``buffer_size`` trees. What
it holds at any time is the buffer, the open groups and the record being read, so host
memory is bounded by the buffer, not by the data.

Epochs: a reader visits each of its shards once per epoch (in a seeded order per
epoch when shuffling) and drains its buffer before the next epoch starts, so every
tree is served exactly once per epoch.

Resume: :meth:`TreeStream.state` is a small JSON-like dict - the shard and position to
read next, the random generator's state, the open groups and the buffered trees as
the positions of their records - from which :meth:`TreeStream.load` rebuilds the
same stream exactly (buffered trees are re-read and rebuilt; the data files must not
change in between).

Bounds: each record is read within the source's ``read_limits`` (``data.max_*``, see
:mod:`treelit.data.limits`); a ``MemoryError`` while a record is built is reported as
running out of memory on that record, never as bad data.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from treelit.builders.assemble import Assembler, Limits
from treelit.builders.base import BuiltTree, TreeBuilder
from treelit.data.limits import out_of_memory
from treelit.data.records import DataError, ReadStats, Record
from treelit.data.sources import DataSource

__all__ = ["TreeStream"]

log = logging.getLogger(__name__)


class TreeStream:
    """Args:
        source: the data source; ``shards``: the indices of this reader's shards.
        builder: the tree builder; ``limits``: model and objective checks (see :class:`Limits`).
        on_error: ``raise`` or ``skip`` (skips counted in ``stats``).
        seed, reader: seed the shard order and the shuffle buffer (``reader`` tells readers apart).
        shuffle: shuffle the shard order per epoch and draw trees at random from the buffer.
        buffer_size: trees held in the shuffle buffer.
        group_window: records after which a group with no new record is complete.
    """

    def __init__(self, source: DataSource, shards: Sequence[int], builder: TreeBuilder, *,
                 limits: Optional[Limits] = None, on_error: str = "raise", seed: int = 0, reader: int = 0,
                 shuffle: bool = True, buffer_size: int = 1024, group_window: int = 1000,
                 stats: Optional[ReadStats] = None) -> None:
        if not shards:
            raise DataError(f"reader {reader} has no shard to read: {len(source.shards())} shards for more readers; "
                            "give more files (or data.source.num_shards), or fewer readers (data.num_readers)")
        if buffer_size < 1 or group_window < 1:
            raise ValueError("data.shuffle_buffer and data.group_window must be >= 1")
        self.source, self.shard_ids, self.builder = source, list(shards), builder
        self.limits = limits or Limits()
        self.on_error, self.seed, self.reader, self.shuffle = on_error, int(seed), int(reader), bool(shuffle)
        self.buffer_size, self.group_window = int(buffer_size), int(group_window)
        self.stats = stats if stats is not None else ReadStats()
        self.asm = self._assembler()
        self.rng = np.random.default_rng([self.seed, self.reader, 7])
        self.epoch, self.k, self.cursor, self.draining = 0, 0, None, False
        self.order = self._order(0)
        self.buffer: List[BuiltTree] = []
        self.served = 0  # trees served in this epoch
        self.filled = False
        self._it: Optional[Iterator] = None

    def _assembler(self, window: Optional[int] = -1) -> Assembler:
        return Assembler(self.builder, on_error=self.on_error, window=self.group_window if window == -1 else window,
                         limits=self.limits, stats=self.stats, name=f"reader {self.reader}")

    def _order(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(self.shard_ids)
        perm = np.random.default_rng([self.seed, self.reader, epoch]).permutation(len(self.shard_ids))
        return [self.shard_ids[i] for i in perm]

    # reading ------------------------------------------------------------------------------------
    def _read_one(self) -> bool:
        """Read one record (or finish a shard); False once the epoch's shards are all read."""
        while self.k < len(self.order):
            shard = self.order[self.k]
            if self._it is None:
                self._it = iter(self.source.read(shard, self.cursor))
            item = next(self._it, None)
            if item is None:
                self._end_shard()
                continue
            self.cursor = item.next
            if isinstance(item, DataError):
                self.asm._fail(item, 1)
            else:
                item.position = [shard, item.position]
                self.stats.read += 1
                try:
                    self.buffer += self.asm.add(item)
                except MemoryError:
                    raise out_of_memory(item.source, self.source.read_limits) from None
            if item.next is None:
                self._end_shard()
            return True
        return False

    def _end_shard(self) -> None:
        try:
            self.buffer += self.asm.flush()  # a group never spans two shards
        except MemoryError:
            shard = self.source.shards()[self.order[self.k]]
            raise out_of_memory(f"{shard} (building the trees of its last groups)", self.source.read_limits) from None
        self.k += 1
        self.cursor, self._it = None, None

    def next_tree(self) -> BuiltTree:
        """The next tree of the stream (endless: epoch after epoch)."""
        while True:
            if not self.draining and len(self.buffer) < self.buffer_size:
                if not self._read_one():
                    self.draining = True
                continue
            if not self.filled:
                self.filled = True
                self.asm.report()  # every group a singleton: refused before the first step
            if self.buffer:
                i = int(self.rng.integers(len(self.buffer))) if self.shuffle else 0
                if self.shuffle:
                    self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
                    tree = self.buffer.pop()
                else:
                    tree = self.buffer.pop(0)
                self.served += 1
                tree.epoch = self.epoch
                return tree
            self.asm.report()
            if self.served == 0:
                raise DataError(f"{', '.join(self.source.shards()[s] for s in self.shard_ids)[:300]}: no trees to "
                                f"train on ({self.stats.skipped} records skipped)")
            self.epoch += 1
            self.order, self.k, self.cursor, self._it = self._order(self.epoch), 0, None, None
            self.draining, self.served = False, 0
            self.asm.closed.clear()  # a new epoch meets every group again

    # resumable state ------------------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        return {
            "epoch": self.epoch, "k": self.k, "order": list(self.order), "cursor": self.cursor,
            "draining": self.draining, "served": self.served, "filled": self.filled,
            "rng": self.rng.bit_generator.state, "read": self.stats.read, "skipped": self.stats.skipped,
            "buffer": [[t.unit, t.unit_index] for t in self.buffer], "assembler": self.asm.state(),
        }

    def load(self, state: Dict[str, Any]) -> None:
        self.epoch, self.k, self.order = int(state["epoch"]), int(state["k"]), list(state["order"])
        self.cursor, self.draining = state["cursor"], bool(state["draining"])
        self.served, self.filled = int(state["served"]), bool(state["filled"])
        self.rng.bit_generator.state = state["rng"]
        self.stats.read, self.stats.skipped = int(state["read"]), int(state["skipped"])
        self._it = None
        self.asm = self._assembler()
        self.asm.load(state["assembler"], self.record_at)
        cache: Dict[str, List[BuiltTree]] = {}
        self.buffer = []
        for unit, j in state["buffer"]:
            key = repr(unit)
            if key not in cache:
                cache[key] = self._rebuild(unit)
            self.buffer.append(cache[key][j])

    def record_at(self, position) -> Record:
        shard, pos = position
        return self.source.record_at(int(shard), pos)

    def _rebuild(self, unit) -> List[BuiltTree]:
        """The trees of a completed unit, rebuilt from its records (deterministic)."""
        asm = self._assembler(window=None)
        asm.on_error = "raise"
        trees: List[BuiltTree] = []
        for position in unit:
            rec = self.record_at(position)
            rec.position = position
            trees += asm.add(rec)
        return trees + asm.flush()
