"""Data sources (registry kind ``data_source``): where streamed records come from.

A source is a list of *shards* (files, or row ranges of a Hugging Face dataset) read
lazily, one record at a time, from any position: every record it yields carries its
``position`` and the ``next`` position, so a reader can stop anywhere and resume
exactly there (see :mod:`treelit.data.stream`). Sources never hold more than the
record being read (a ``.json`` list file is parsed whole: JSON lists do not stream, so
the whole file obeys ``data.max_record_bytes``; use JSONL or Parquet for large data).
A source reads within its :attr:`DataSource.read_limits` (set by the data module from
the ``data.max_*`` options, see :mod:`treelit.data.limits`): a record over a limit is a
:class:`DataError` naming it.

Built-ins:

* ``files``: JSONL / JSON / Parquet files (``.gz`` for the JSON ones) given as a glob,
  a directory, or a list of those; one shard per file, in sorted order.
* ``hf_dataset``: a Hugging Face ``datasets`` dataset on local disk (memory-mapped
  Arrow): a directory written by ``Dataset.save_to_disk``, or local ``data_files``
  loaded with ``datasets.load_dataset(<format>, data_files=...)``; ``num_shards`` row
  ranges. No download is ever attempted.

Third-party sources register through the entry-point group ``treelit.data_source``.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, List, Optional, Sequence, Union

from treelit.data.limits import ReadLimits, branch_count
from treelit.data.records import DataError, Record, data_format, iter_file
from treelit.registry import get_registry
from treelit.utils.paths import glob_files, walk_files

__all__ = ["DATA_SOURCES", "DataSource", "FileSource", "HFDatasetSource", "make_data_source"]

DATA_SOURCES = get_registry("data_source", ["treelit.data.sources"])

_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


class DataSource:
    """Interface: ``shards()`` names the shards; ``read(shard, start)`` yields the records (or
    the :class:`DataError` of an unreadable one) of shard ``shard`` from position ``start``
    (None: its beginning), each with ``.position`` and ``.next`` (None after the last), within
    ``read_limits`` (a record over a limit is yielded as a :class:`DataError`)."""

    name = "?"
    read_limits: ReadLimits = ReadLimits()

    def shards(self) -> List[str]:
        raise NotImplementedError

    def read(self, shard: int, start: Any = None) -> Iterator[Union[Record, DataError]]:
        raise NotImplementedError

    def record_at(self, shard: int, position: Any) -> Union[Record, DataError]:
        """The record at ``position`` of ``shard`` (to rebuild buffered trees on resume)."""
        for item in self.read(shard, position):
            return item
        raise DataError(f"{self.shards()[shard]}: no record at position {position!r} (the data changed since the checkpoint?)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.shards())} shards)"


def _expand(paths: Union[str, Sequence[str]]) -> List[str]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths or [])
    out: List[str] = []
    for p in items:
        p = os.path.expanduser(str(p))
        if os.path.isdir(p):  # linked directories are not entered; each real file once
            found = walk_files(p, lambda rel: rel.lower().endswith(_SUFFIXES))
            if not found:
                raise DataError(f"data.source.paths: directory {p!r} holds no .jsonl/.json/.parquet files")
            out += found
        elif any(c in p for c in "*?["):
            found = glob_files(p)
            if not found:
                raise DataError(f"data.source.paths: the pattern {p!r} matches no file")
            out += found
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise DataError(f"data.source.paths: {p!r} does not exist")
    if not out:
        raise DataError("data.source.paths: no data files given")
    for f in out:
        data_format(f)  # unsupported types fail here, naming the file
    return out


@DATA_SOURCES.register("files")
class FileSource(DataSource):
    """Args:
        paths: a file, a directory (its data files, recursively), a glob (``shards/*.jsonl.gz``,
            ``data/**/*.jsonl``), or a list of those; one shard per file, sorted. Symbolically
            linked directories are not entered (linked files are read); each real file is one shard.
    """

    name = "files"

    def __init__(self, paths: Union[str, Sequence[str]]) -> None:
        self.paths = _expand(paths)

    def shards(self) -> List[str]:
        return self.paths

    def read(self, shard: int, start: Any = None) -> Iterator[Union[Record, DataError]]:
        return iter_file(self.paths[shard], start, self.read_limits)


@DATA_SOURCES.register("hf_dataset")
class HFDatasetSource(DataSource):
    """Args:
        path: a directory written by ``Dataset.save_to_disk`` (read with ``datasets.load_from_disk``).
        data_files: instead, local files loaded with ``datasets.load_dataset(format, data_files=...)``.
        format: ``json``, ``parquet``, ``arrow`` or ``csv`` (with ``data_files``).
        split: the split (``train``) when the dataset has several.
        num_shards: row ranges the dataset is read as (readers take disjoint shards).
    """

    name = "hf_dataset"

    def __init__(self, path: Optional[str] = None, data_files: Any = None, format: str = "json", split: str = "train",
                 num_shards: int = 1) -> None:
        try:
            import datasets  # optional and heavy (~2 s CPU): data=hf_dataset only
        except ImportError as exc:  # an optional dependency
            raise ImportError("data source hf_dataset needs the 'datasets' package (pip install datasets)") from exc
        if (path is None) == (data_files is None):
            raise ValueError("data.source: give either path (a save_to_disk directory) or data_files (local files)")
        if path is not None:
            if not os.path.isdir(str(path)):
                raise DataError(f"data.source.path: directory {str(path)!r} does not exist")
            ds = datasets.load_from_disk(str(path))
            self.label = str(path)
        else:
            files = _expand(data_files) if not isinstance(data_files, dict) else data_files
            ds = datasets.load_dataset(format, data_files=files, split=split)
            self.label = f"{format}:{files[0] if isinstance(files, list) and len(files) == 1 else files}"
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{self.label}: no split {split!r} (splits: {', '.join(ds)})")
            ds = ds[split]
        if int(num_shards) < 1:
            raise ValueError(f"data.source.num_shards must be >= 1, got {num_shards}")
        self.ds = ds
        n = len(ds)
        k = max(1, min(int(num_shards), n))
        self.bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]

    def shards(self) -> List[str]:
        return [f"{self.label}[{a}:{b}]" for a, b in self.bounds]

    def read(self, shard: int, start: Any = None) -> Iterator[Union[Record, DataError]]:
        a, b = self.bounds[shard]
        limit = self.read_limits.max_branches_per_record
        for i in range(a if start is None else int(start), b):
            rec, src, nxt = self.ds[i], f"{self.label}:row {i}", i + 1 if i + 1 < b else None
            n = branch_count(rec)
            if n > limit:
                err = DataError(f"{src}: the record has {n} branches, more than data.max_branches_per_record={limit} "
                                "(raise data.max_branches_per_record to read it)")
                err.position, err.next = i, nxt
                yield err
                continue
            yield Record(rec, src, i, nxt)


def make_data_source(name: str, **options: Any) -> DataSource:
    """Instantiate the data source registered as ``name`` (the ``data.source`` config node)."""
    return DATA_SOURCES.get(name)(**options)
