"""What reading one record may cost: bounds that hold whatever a data file contains.

Data files are often written by someone else (a rollout engine, a colleague, a download).
Without bounds, one hostile or broken file decides how much memory and time a run
spends before its first step: a 4 MB ``.jsonl.gz`` can expand to a 4 GiB line that
``readline()`` materialises whole; a 200 MB record with 10^7 branches builds a trie
for minutes before the machine runs out of memory. :class:`ReadLimits` caps each cost
*before* it is paid, with an error naming the file, the line and the option to raise:

* ``max_record_bytes`` (64 MiB): a JSONL line is read with ``readline(limit + 1)``; a
  longer one is never held whole - the rest of it is skipped in 1 MiB chunks up to the
  next newline, and the record is refused (``on_error=skip`` skips it). A ``.json`` file
  (one JSON list) is read whole, so the whole file obeys the limit: JSON lists have no
  record boundaries a reader could resynchronise on after an error and cannot be resumed
  mid-file without re-reading them, so large data belongs in JSONL (or Parquet).
  Parquet is read a row group at a time; a row group whose stated size averages more
  than the limit per row is refused unread (a single oversized row among small ones is
  not detected: Parquet gives no per-row size before decoding).
  Parsing ``N`` bytes of JSON takes several times ``N`` of Python objects, so the default
  keeps one record's footprint to a few GB at most.
* ``max_branches_per_record`` (65,536): counted on the parsed record before any tree is
  built (``branches`` entries; for chat records the assistant messages, one branch
  each under ``per_call`` export). A GRPO group has 4-64 samples and an agent trajectory
  a few hundred model calls; 65,536 leaves room for the largest real trees while keeping a
  runaway record (10^7 one-token branches) from building a trie for minutes: the trie's
  per-branch bookkeeping is Python objects, and one such record cost 8 GB.
* ``max_expansion_ratio`` (100): a compressed (``.gz``) file may expand to
  ``max(max_expansion_ratio x its compressed size, max_record_bytes)`` bytes. JSON data
  compresses 3-30 times (the bundled data: 10-30); a decompression bomb of zeros or
  spaces about 1000 times. Past the cap the file is refused (under ``skip``: the rest of
  it is skipped, counted as one bad record).

A ``MemoryError`` while a record is read or built is never reported as bad data (it
says nothing about the record's validity and ``on_error=skip`` must not hide it): it
becomes :class:`ReadMemoryError`, one line naming the record being read and these limits.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, BinaryIO, Optional, Tuple

from treelit.tree.token_tree import TreeInputError

__all__ = ["ReadLimits", "ReadMemoryError", "branch_count", "out_of_memory", "skip_blank_lines", "skip_line", "MiB"]

MiB = 1 << 20
CHUNK = MiB  # what skipping the rest of an over-long line holds at a time


@dataclass(frozen=True)
class ReadLimits:
    """Per-record bounds (the ``data.max_*`` options; see the module docstring)."""

    max_record_bytes: int = 64 * MiB
    max_branches_per_record: int = 65_536
    max_expansion_ratio: int = 100

    def __post_init__(self) -> None:
        for name in ("max_record_bytes", "max_branches_per_record", "max_expansion_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"data.{name} must be a positive integer, got {v!r}")

    def expanded_cap(self, path: Any) -> Optional[int]:
        """The most bytes a compressed file may expand to (None: not compressed)."""
        if not str(path).lower().endswith(".gz"):
            return None
        return max(self.max_record_bytes, self.max_expansion_ratio * os.path.getsize(path))

    def expansion_message(self, path: Any, line: int) -> str:
        size = os.path.getsize(path)
        return (f"{path}:{line}: decompressed data passed {self.expanded_cap(path)} bytes, more than "
                f"data.max_expansion_ratio={self.max_expansion_ratio} times the file's {size} compressed bytes "
                "(a decompression bomb?); if the file is genuine, raise data.max_expansion_ratio")

    def record_message(self, where: str) -> str:
        return (f"{where}: the record is longer than data.max_record_bytes={self.max_record_bytes} bytes "
                "(raise data.max_record_bytes to read it)")

    def describe(self) -> str:
        return (f"data.max_record_bytes={self.max_record_bytes}, "
                f"data.max_branches_per_record={self.max_branches_per_record}")


class ReadMemoryError(TreeInputError, MemoryError):
    """The process ran out of memory while reading or building a record. Not a
    :class:`~treelit.data.records.DataError` (``on_error=skip`` does not skip it); still
    reported as one ``error:`` line, naming the record and the limits."""


def out_of_memory(where: str, limits: Optional[ReadLimits]) -> ReadMemoryError:
    limits = limits or ReadLimits()
    return ReadMemoryError(
        f"out of memory while reading {where} (this is not a data error: the record may be valid); records are "
        f"bounded by {limits.describe()}: lower them to refuse such records before they are read, give the process "
        "more memory, or for data larger than memory use data=stream")


def _assistant_calls(msgs: Any) -> int:
    if not isinstance(msgs, list):
        return 0
    return max(1, sum(1 for m in msgs if isinstance(m, dict) and m.get("role") == "assistant"))


def branch_count(data: Any) -> int:
    """Branches a record makes, counted before building: its ``branches`` entries, or for
    chat records its assistant messages (one branch per model call), whichever is larger."""
    if not isinstance(data, dict):
        return 0
    branches = data.get("branches")
    n = len(branches) if isinstance(branches, list) else 0
    calls = _assistant_calls(data.get("messages")) + _assistant_calls(data.get("traj"))
    if isinstance(branches, list):
        calls += sum(_assistant_calls(b.get("messages")) for b in branches if isinstance(b, dict))
    return max(n, calls)


def skip_line(f: BinaryIO, cap: Optional[int] = None, offset: int = 0) -> Tuple[int, bool]:
    """Consume the rest of the current line in :data:`CHUNK` pieces, never holding it:
    ``(bytes consumed, capped)``; ``capped``: the file position (``offset`` + consumed)
    passed ``cap`` first (a decompression bomb of one endless line)."""
    n = 0
    while True:
        if cap is not None and offset + n > cap:
            return n, True
        chunk = f.readline(CHUNK)
        n += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return n, False


_BLANK = re.compile(rb"[ \t\r\n]*")


def skip_blank_lines(f: BinaryIO, budget: Optional[int] = None) -> Tuple[int, int]:
    """Consume the blank lines ahead (whole lines only), a buffer at a time rather than a
    line at a time (a stream of newlines must not cost a Python loop per byte), stopping
    once more than ``budget`` bytes are consumed: ``(bytes, lines)``."""
    n = lines = 0
    while budget is None or n <= budget:
        ahead = f.peek(CHUNK)
        k = ahead.rfind(b"\n", 0, _BLANK.match(ahead).end()) + 1
        if not k:
            return n, lines
        lines += ahead.count(b"\n", 0, k)
        n += len(f.read(k))
        if k < len(ahead):
            return n, lines
    return n, lines
