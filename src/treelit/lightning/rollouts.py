"""``RolloutDirDataModule``: online RL from a directory a rollout engine writes into.

A rollout engine (vLLM, SGLang, your own sampler) writes one file of records per
optimizer step into ``directory`` - token ids, loss masks, rewards or advantages and
the sampling log-probs (``old_logprobs``), so nothing is re-tokenized. The trainer
takes the files in name order, one per step: it waits for the next one (up to
``timeout_s``), builds its trees (advantages from rewards are computed within the file:
the file is "the batch"), trains on them (``ppo_epochs`` passes, ``ppo_minibatches``
updates each, as for any step batch) and marks the file consumed by renaming it to
``<name>.consumed`` once the step is done. While it waits it logs a line every
:data:`HEARTBEAT_S` seconds, naming files in the folder this run did not take (an earlier
run's ``.consumed`` files: its sampler believes those steps written and waits for nothing).

Write each file under a name the ``pattern`` does not match (``step-000007.jsonl.tmp``)
and rename it when complete (a rename is atomic), and name files so that they sort in
step order (zero-padded numbers). The directory takes regular files only: a symbolic
link matching the pattern is an error naming it, and the file names a checkpoint holds
(the files already trained on) must be plain names in the directory.

Lightning fetches the next batch before it trains the current one; waiting for the next
file there would wait for rollouts that need this step's weights. So the data loader
yields placeholders and each step's file is read in ``transfer_batch_to_device``, right
before that step trains. With several processes every rank reads the (small) file and
takes a cost-balanced share of its trees, as :class:`~treelit.lightning.data.TreeDataModule` does.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from treelit.builders.assemble import Limits
from treelit.builders.base import BuiltTree, TreeBuilder
from treelit.builders.sequences import SequencesBuilder
from treelit.data.limits import MiB, ReadLimits
from treelit.data.records import DataError, ReadStats
from treelit.lightning.data import (StepBatch, _assign, _empty_batch, _pack_indices, _tree_cost, build_trees,
                                    conform_batches, tree_origin)
from treelit.lightning.staleness import STALE, StalenessGate, trainer_policy_version
from treelit.tree.batch import TreeBatch
from treelit.utils.distributed import data_parallel_rank
from treelit.utils.paths import confined
from treelit.utils.rl_folders import done_rollouts

__all__ = ["RolloutDirDataModule"]

log = logging.getLogger(__name__)

CONSUMED = ".consumed"
HEARTBEAT_S = 30.0  # while it waits for a rollout file, a line this often (seconds)


class _Pending:
    """Step ``index``, to be read from the next rollout file right before it trains."""

    def __init__(self, index: int) -> None:
        self.index = index


class _Steps(IterableDataset):
    def __init__(self, dm: "RolloutDirDataModule") -> None:
        self.dm = dm

    def __iter__(self) -> Iterator[_Pending]:
        i = self.dm.consumed_steps
        while True:
            yield _Pending(i)
            i += 1


class RolloutDirDataModule(pl.LightningDataModule):
    """Args:
        directory: the directory the rollout engine writes into (created if missing).
        tree_builder: a tree builder instance (default ``sequences``).
        micro_batch_tokens: tree-token budget of one packed micro-batch (a file gives as many as it needs).
        pattern: the file names to take (a glob, e.g. ``*.jsonl``; ``.parquet`` and ``.jsonl.gz`` work too).
        timeout_s: how long to wait for the next file before failing.
        poll_s: how often to look.
        on_error: ``raise`` or ``skip`` for bad records (skips counted and logged).
        mark_consumed: rename each trained file to ``<name>.consumed``.
        max_staleness: skip or refuse (``on_stale``: ``skip`` | ``raise``) a file sampled more than
            this many policy versions behind the trainer (records' ``policy_version``; null: no
            limit), see :mod:`treelit.lightning.staleness`.
        staleness_policy: what ``max_staleness`` does with a stale token: ``skip_file`` (the
            whole file, as ``on_stale`` says), ``drop_tokens`` (out of the loss) or ``drop_branch``
            (records may carry per-token ``policy_versions``), see :mod:`treelit.lightning.token_staleness`.
        max_record_bytes, max_branches_per_record, max_expansion_ratio: what reading one
            record may cost (:class:`~treelit.data.limits.ReadLimits`); a record over a limit
            is a data error naming it (``on_error=skip`` skips it).
    """

    def __init__(
        self,
        directory: str,
        tree_builder: Optional[TreeBuilder] = None,
        micro_batch_tokens: int = 8192,
        pattern: str = "*.jsonl",
        timeout_s: float = 600.0,
        poll_s: float = 0.2,
        on_error: str = "raise",
        mark_consumed: bool = True,
        attention_cost: float = 1.0 / 1024,
        sample_trees: int = 64,
        max_record_bytes: int = 64 * MiB,
        max_branches_per_record: int = 65_536,
        max_expansion_ratio: int = 100,
        max_staleness: Optional[int] = None,
        on_stale: str = "skip",
        staleness_policy: str = "skip_file",
    ) -> None:
        super().__init__()
        self.read_limits = ReadLimits(max_record_bytes, max_branches_per_record, max_expansion_ratio)
        self.staleness = StalenessGate(max_staleness, on_stale, staleness_policy)
        if not directory:
            raise ValueError("data.directory is required: the directory the rollout engine writes files into")
        if micro_batch_tokens <= 0 or timeout_s <= 0 or poll_s <= 0:
            raise ValueError("data.micro_batch_tokens, data.timeout_s and data.poll_s must be positive")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"data.on_error must be 'raise' or 'skip', got {on_error!r}")
        self.directory = Path(directory)
        self.builder = tree_builder or SequencesBuilder()
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.pattern, self.timeout_s, self.poll_s = pattern, float(timeout_s), float(poll_s)
        self.on_error, self.mark_consumed = on_error, bool(mark_consumed)
        self.attention_cost, self.sample_trees = float(attention_cost), int(sample_trees)
        self.limits = Limits()
        self.read_stats = ReadStats()
        self.rank, self.world = 0, 1
        self.consumed_steps = 0
        self.step_files: Dict[int, str] = {}  # step index -> file name
        self.marked: set = set()
        self.trees: List[BuiltTree] = []

    def setup(self, stage: Optional[str] = None) -> None:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            self.rank, self.world = data_parallel_rank(trainer)  # (context parallelism: per group)
        self.directory.mkdir(parents=True, exist_ok=True)

    def check_against(self, vocab_size: int, max_seq_len: Optional[int], objective: Any = None,
                      routing: Optional[Tuple[int, int, int]] = None, experts: Optional[int] = None) -> None:
        """Records are checked against the model and the objective as each file arrives."""
        self.limits = Limits(int(vocab_size), None if max_seq_len is None else int(max_seq_len),
                             None if objective is None else objective.data_needs(),
                             "the objective" if objective is None else f"objective={objective.name}", routing,
                             experts)
        self.setup()

    def stats(self) -> Dict[str, Any]:
        """Rollouts arrive during training: nothing is known before the first step."""
        return {"trees": 0, "branches": 0, "flat_tokens": 0, "tree_tokens": 0, "por": 0.0, "ideal_speedup": 0.0,
                "records_skipped": self.read_stats.skipped, "streamed": True, "records_read": self.read_stats.read}

    # files ------------------------------------------------------------------------------------------
    def _candidates(self) -> List[Path]:
        """The files waiting to be trained on: regular files only, inside ``directory`` (a
        symbolic link there is refused, naming it: it could point anywhere)."""
        done = set(self.step_files.values()) | self.staleness.names()
        out = []
        for p in sorted(self.directory.glob(self.pattern)):
            if p.name in done:
                continue
            if p.is_symlink():
                raise DataError(f"{p}: a symbolic link in the rollout directory (it takes regular files only: "
                                "write each file there, then rename it)")
            if p.is_file():
                confined(self.directory, p.relative_to(self.directory), f"{self.directory}: rollout file",
                         resolve=True, error=DataError)
                out.append(p)
        return out

    def _wait_next(self, index: int) -> Path:
        start = time.monotonic()
        end, beat = start + self.timeout_s, start + HEARTBEAT_S
        while True:
            files = self._candidates()
            if files:
                return files[0]
            now = time.monotonic()
            if now > end:
                raise DataError(f"{self.directory}: no rollout file matching {self.pattern!r} for step {index + 1} "
                                f"within data.timeout_s={self.timeout_s:g}s{self._taken_note()}")
            if now >= beat:
                beat = now + HEARTBEAT_S
                if self.rank == 0:
                    log.info("step %d: waiting for a rollout file matching %r in %s: %.0fs of data.timeout_s=%gs "
                             "(policy version %d published)%s", index + 1, self.pattern, self.directory, now - start,
                             self.timeout_s, self.policy_version(), self._taken_note())
            time.sleep(self.poll_s)

    def _taken_note(self) -> str:
        """What the directory holds besides the files to come, when it holds files this run did
        not take (an earlier run's, whose sampler may believe its work done)."""
        mine = {n + CONSUMED for n in self.step_files.values()} | {n + STALE for n in self.staleness.names()}
        theirs = [n for n in done_rollouts(self.directory) if n not in mine]
        if not theirs:
            return ""
        return (f"; it holds {len(theirs)} file(s) this run did not take ({theirs[0]}, ...): an earlier run's? A "
                "sampler that finds them believes those steps written")

    def _mark(self, upto: int) -> None:
        """Rename the files of the steps before ``upto`` (trained) to ``<name>.consumed`` (rank 0)."""
        if not self.mark_consumed or self.rank != 0:
            return
        for i, name in sorted(self.step_files.items()):
            if i < upto and name not in self.marked:
                src = self._named(name)
                if os.path.lexists(src):
                    os.replace(src, self.directory / (name + CONSUMED))
                self.marked.add(name)
        self.staleness.mark(self.directory, upto)

    def load_step(self, index: int) -> StepBatch:
        """Wait for the next file, build its trees and pack this rank's share (step ``index``)."""
        self._mark(index)
        path = self._wait_next(index)
        while not self.staleness.admit(path, index, self.policy_version(), self.read_limits):
            path = self._wait_next(index)  # that file was too stale (data.max_staleness) and is skipped
        self.step_files[index] = path.name
        trees = build_trees(str(path), self.builder, on_error=self.on_error, limits=self.limits, stats=self.read_stats,
                            read_limits=self.read_limits, branch_hook=self.staleness.reader(self.policy_version()))
        self.staleness.counted()
        if not trees:
            raise DataError(f"{path}: no trees to train on ({self.read_stats.skipped} records skipped so far)")
        if len(self.trees) < self.sample_trees:
            self.trees += trees[: self.sample_trees - len(self.trees)]
        batches = conform_batches([t.tree.to_batch() for t in trees])
        sizes = [b.num_tokens for b in batches]
        log.info("step %d: %s (%d trees, %d tree tokens)", index + 1, path.name, len(trees), sum(sizes))
        if self.world == 1:
            rows = _pack_indices(list(range(len(batches))), sizes, self.micro_batch_tokens)
            return StepBatch([TreeBatch.pack([batches[t] for t in row]) for row in rows], index,
                             origins=[[tree_origin(trees[t]) for t in row] for row in rows])
        cost = np.array([_tree_cost(b, self.attention_cost) for b in batches])
        shares = _assign(list(range(len(batches))), cost, self.world)
        packed = [_pack_indices(share, sizes, self.micro_batch_tokens) for share in shares]
        n_passes = max(1, max(len(p) for p in packed))
        mine = [TreeBatch.pack([batches[t] for t in row]) for row in packed[self.rank]]
        origins = [[tree_origin(trees[t]) for t in row] for row in packed[self.rank]]
        origins += [[] for _ in range(n_passes - len(mine))]
        mine += [_empty_batch() for _ in range(n_passes - len(mine))]
        loads = [float(cost[s].sum()) for s in shares]
        mean = sum(loads) / len(loads)
        return StepBatch(mine, index, max(loads) / mean if mean > 0 else 1.0, origins)

    def policy_version(self) -> int:
        """The trainer's policy version, which rollout staleness is measured against."""
        return trainer_policy_version(getattr(self, "trainer", None))

    @property
    def step_metrics(self) -> Dict[str, float]:
        """``rollout/staleness_max``, ``rollout/staleness_mean`` (the last file), ``rollout/files_skipped_stale``,
        and the last file's per-token ``staleness/...`` counts (:mod:`treelit.lightning.token_staleness`)."""
        return dict(self.staleness.metrics)

    # Lightning hooks ----------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(_Steps(self), batch_size=None, num_workers=0, collate_fn=lambda x: x)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> StepBatch:
        if isinstance(batch, _Pending):
            batch = self.load_step(batch.index)
        return batch.on(device)

    def teardown(self, stage: Optional[str] = None) -> None:
        self._mark(self.consumed_steps)

    def state_dict(self) -> Dict[str, Any]:
        c = self.consumed_steps
        return {"consumed_steps": c, "files": [self.step_files[i] for i in sorted(self.step_files) if i < c],
                "stale": self.staleness.state(c)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The state of :meth:`state_dict`; its file names come from the checkpoint (a file
        someone may have handed over) and must be plain names of files in ``directory``."""
        what = "resume_from: the checkpoint's rollout-directory state"
        names, stale = state.get("files", []), state.get("stale") or {}
        skipped_by_step = stale.get("skipped") or {} if isinstance(stale, dict) else None
        if (not isinstance(names, list) or not isinstance(skipped_by_step, dict)
                or not all(isinstance(v, list) for v in skipped_by_step.values())):
            raise DataError(f"{what} is malformed (files: a list of names; stale.skipped: lists of names by step)")
        for name in names:
            self._named(name)
        self.consumed_steps = int(state.get("consumed_steps", 0))
        self.step_files = {i: name for i, name in enumerate(names)}
        self.marked = set()
        for skipped in skipped_by_step.values():
            for name in skipped:
                self._named(name)
        self.staleness.load(stale)

    def _named(self, name: Any) -> Path:
        """``directory / name`` for a rollout file name read from a checkpoint, refused unless it
        is a plain name (no directory part)."""
        what = "resume_from: the checkpoint's rollout file name"
        path = confined(self.directory, name, what, error=DataError)
        if path.parent != self.directory:
            raise DataError(f"{what}: {name!r} is not a plain file name in {self.directory}")
        return path
