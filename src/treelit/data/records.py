"""Reading tree records from JSONL and Parquet, with errors that name file, line and field.

Token-level format, one record per tree::

    {"id": "task-7",
     "branches": [
        {"input_ids": [151644, 8948, ...],     # required: token ids
         "loss_mask": [0, 0, ..., 1, 1],       # optional: 1 = token is a target (default: all)
         "weight": 1.0,                        # optional: branch weight (>= 0, default 1)
         "group": "prompt-3",                  # optional: group key (GRPO groups)
         "reward": 1.0, "advantage": 0.5,      # optional: RL fields (numbers)
         "old_logprobs": [...], "ref_logprobs": [...]}  # optional: one per token
     ]}

Chat-format records (``messages`` instead of ``input_ids``) are read the same way and
turned into token branches by the ``chat`` tree builder.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

from treelit.tree.token_tree import TreeInputError

__all__ = ["Record", "read_records", "validate_token_record", "DataError", "ReadStats"]

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")


class DataError(TreeInputError):
    """A malformed input record (the message starts with ``file:line:``)."""


@dataclass
class Record:
    data: Dict[str, Any]
    source: str  # "file:line" (JSONL) or "file:row" (Parquet)

    @property
    def id(self) -> str:
        return str(self.data.get("id", self.source))


@dataclass
class ReadStats:
    read: int = 0
    skipped: int = 0
    errors: List[str] = field(default_factory=list)


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_token_record(rec: Dict[str, Any], source: str) -> None:
    """Check a token-level record's structure; raise :class:`DataError` naming the field."""
    if not isinstance(rec, dict):
        raise DataError(f"{source}: a record must be a JSON object, got {type(rec).__name__}")
    branches = rec.get("branches")
    if not isinstance(branches, list) or not branches:
        raise DataError(f"{source}: field 'branches' must be a non-empty list")
    for b, br in enumerate(branches):
        where = f"{source}: branches[{b}]"
        if not isinstance(br, dict):
            raise DataError(f"{where}: must be an object")
        ids = br.get("input_ids")
        if not _is_int_list(ids):
            raise DataError(f"{where}.input_ids: must be a list of integers")
        if not ids:
            raise DataError(f"{where}.input_ids: empty branch")
        if min(ids) < 0:
            raise DataError(f"{where}.input_ids: negative token id {min(ids)}")
        mask = br.get("loss_mask")
        if mask is not None:
            if not isinstance(mask, list) or any(m not in (0, 1, True, False) for m in mask):
                raise DataError(f"{where}.loss_mask: must be a list of 0/1")
            if len(mask) != len(ids):
                raise DataError(f"{where}.loss_mask: length {len(mask)} != {len(ids)} input_ids")
        for key in ("weight", "reward", "advantage"):
            if key in br and br[key] is not None and not _finite(br[key]):
                raise DataError(f"{where}.{key}: must be a finite number, got {br[key]!r}")
        if "weight" in br and br["weight"] is not None and br["weight"] < 0:
            raise DataError(f"{where}.weight: must be >= 0, got {br['weight']!r}")
        for key in ("old_logprobs", "ref_logprobs"):
            lp = br.get(key)
            if lp is None:
                continue
            if not isinstance(lp, list) or len(lp) != len(ids) or not all(
                v is None or (_finite(v) and v <= 0) for v in lp
            ):
                raise DataError(f"{where}.{key}: must be a list of {len(ids)} finite log-probs (<= 0) or nulls")


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _iter_jsonl(path: Path) -> Iterator[Union[Record, DataError]]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            src = f"{path}:{lineno}"
            try:
                yield Record(json.loads(line), src)
            except json.JSONDecodeError as exc:
                yield DataError(f"{src}: invalid JSON ({exc.msg} at column {exc.colno})")


def _iter_json(path: Path) -> Iterator[Union[Record, DataError]]:
    try:
        with _open_text(path) as f:
            data = json.loads(f.read())
    except json.JSONDecodeError as exc:
        yield DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})")
        return
    if not isinstance(data, list):
        yield DataError(f"{path}: a .json data file must hold a list of records")
        return
    for i, rec in enumerate(data):
        yield Record(rec, f"{path}:record {i}")


def _iter_parquet(path: Path) -> Iterator[Union[Record, DataError]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist()):
        yield Record(row, f"{path}:row {i}")


def read_records(
    path: Union[str, Path],
    *,
    on_error: str = "raise",
    validate=validate_token_record,
    stats: Optional[ReadStats] = None,
) -> Iterator[Record]:
    """Yield records from a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file (``.gz`` for the JSON ones).

    Args:
        on_error: ``raise`` (stop at the first bad record) or ``skip`` (log it, count it in
            ``stats``, go on). Nothing is dropped silently.
        validate: a per-record check ``validate(record_dict, source)`` (raises DataError).
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"data.on_error must be one of {ON_ERROR}, got {on_error!r}")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    name = path.name.lower()
    suffix = next((s for s in (".jsonl", ".json", ".parquet") if name.endswith(s) or name.endswith(s + ".gz")), None)
    readers = {".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet}
    if suffix is None or (suffix == ".parquet" and name.endswith(".gz")):
        raise DataError(f"{path}: unsupported data file type (use .jsonl, .json, .parquet, or .jsonl.gz / .json.gz)")
    stats = stats if stats is not None else ReadStats()
    for item in readers[suffix](path):
        if isinstance(item, Record) and validate is not None:
            try:
                validate(item.data, item.source)
            except DataError as exc:
                item = exc
        if isinstance(item, DataError):
            if on_error == "raise":
                raise item
            stats.skipped += 1
            stats.errors.append(str(item))
            log.warning("skipping bad record: %s", item)
            continue
        stats.read += 1
        yield item
