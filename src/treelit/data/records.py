"""Reading tree records from JSONL, JSON and Parquet, with errors that name file, line and field.

Token-level format, one record per tree::

    {"id": "task-7",
     "branches": [
        {"input_ids": [151644, 8948, ...],     # required: token ids
         "loss_mask": [0, 0, ..., 1, 1],       # optional: 1 = token is a target (default: all)
         "weight": 1.0,                        # optional: branch weight (>= 0, default 1)
         "group": "prompt-3",                  # optional: group key (a string or an integer)
         "reward": 1.0, "advantage": 0.5,      # optional: RL fields (numbers)
         "old_logprobs": [...], "ref_logprobs": [...],  # optional: one per token (or null)
         "token_rewards": [...],               # optional: a reward per token (GAE with a critic)
         "pair": 0, "chosen": true,            # optional: DPO pairs
         "routed_experts": {...}}              # optional: recorded MoE routing (treelit.tree.routing)
     ]}

Chat-format records (``messages`` instead of ``input_ids``) are read the same way and
turned into token branches by the ``chat`` tree builder.

Reading never lets a raw decoding error through: a line that is not UTF-8, not JSON,
nested deeper than Python can parse, or cut short by a truncated ``.gz`` stream is a
:class:`DataError` naming the file and the line (``on_error=skip`` skips and counts it).
Reading is bounded (:mod:`treelit.data.limits`): a record longer than
``data.max_record_bytes`` is refused without being held, one with more branches than
``data.max_branches_per_record`` before it is built, a ``.gz`` file expanding past
``data.max_expansion_ratio`` times its size is refused, and running out of memory is
reported as such (:class:`~treelit.data.limits.ReadMemoryError`), never as bad data.
Every record carries its ``source`` (``file:line``, ``file:record i`` or ``file:row i``)
and a ``position`` from which a reader can resume (see :mod:`treelit.data.sources`).
"""

from __future__ import annotations

import difflib
import gzip
import json
import logging
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from treelit.data.limits import ReadLimits, ReadMemoryError, branch_count, out_of_memory, skip_blank_lines, skip_line
from treelit.tree.token_tree import TreeInputError

__all__ = [
    "Record", "read_records", "iter_file", "validate_token_record", "DataError", "ReadStats", "check_key", "data_format",
    "ReadLimits", "ReadMemoryError",
]

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")
MAX_TOKEN_ID = 2**63 - 1
BRANCH_KEYS = ("input_ids", "loss_mask", "weight", "group", "reward", "advantage", "old_logprobs", "ref_logprobs",
               "pair", "chosen", "token_rewards", "routed_experts", "images", "policy_versions")
CHAT_HINT = "a chat record (messages, no input_ids): render it with tree_builder=chat (the token builders read input_ids)"


class DataError(TreeInputError):
    """A malformed input record (the message starts with ``file:line:``)."""


@dataclass
class Record:
    """One input record: its parsed ``data``, its ``source`` (for messages) and its ``position``
    in the file (``(line, byte offset)`` for JSONL, ``row`` for Parquet, ``index`` for JSON);
    ``next`` is the position after it (None: the end of the file). A :class:`DataError`
    yielded by a reader carries the same two attributes."""

    data: Dict[str, Any]
    source: str
    position: Any = None
    next: Any = None  # the position right after this record (where a reader resumes)
    path: Optional[str] = None  # the data file it came from (images are read relative to its folder)

    @property
    def id(self) -> str:
        v = self.data.get("id") if isinstance(self.data, dict) else None
        return self.source if v is None else str(v)


@dataclass
class ReadStats:
    read: int = 0
    skipped: int = 0
    errors: List[str] = field(default_factory=list)
    max_errors_kept: int = 1000

    def skip(self, err: Union[str, Exception], records: int = 1) -> None:
        """Count ``records`` skipped records and log why (the first ``max_errors_kept`` messages are kept)."""
        self.skipped += records
        if len(self.errors) < self.max_errors_kept:
            self.errors.append(str(err))
        log.warning("skipping bad record%s: %s", "s" if records != 1 else "", err)


# field checks ----------------------------------------------------------------------------------


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def finite_number(x: Any) -> bool:
    """A JSON number that is a finite float (huge integers are not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _show(x: Any, n: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def check_key(value: Any, where: str) -> None:
    """A group key (or pair id) is a string or an integer: ``7`` and ``"7"`` are different keys,
    and booleans, numbers with a fraction, lists and objects are refused (they would merge or not hash)."""
    if value is None or isinstance(value, str) or is_int(value):
        return
    raise DataError(f"{where}: must be a string or an integer, got {type(value).__name__} {_show(value)}")


def check_text(value: Any, where: str) -> None:
    """A string that can be encoded as UTF-8 (JSON allows lone surrogates such as "\\ud800")."""
    if not isinstance(value, str):
        raise DataError(f"{where}: must be a string, got {type(value).__name__} {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: contains a lone surrogate {value[exc.start]!r} at character {exc.start} "
                        "(not encodable as UTF-8)") from None


def _typo(key: str, known) -> Optional[str]:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return close[0] if close else None


def validate_token_record(rec: Any, source: str) -> None:
    """Check a token-level record's structure; raise :class:`DataError` naming the field."""
    if not isinstance(rec, dict):
        raise DataError(f"{source}: a record must be a JSON object, got {type(rec).__name__}")
    check_key(rec.get("id"), f"{source}: id")
    branches = rec.get("branches")
    if branches is None and ("messages" in rec or "traj" in rec):
        raise DataError(f"{source}: {'messages' if 'messages' in rec else 'traj'}: {CHAT_HINT}")
    if not isinstance(branches, list) or not branches:
        raise DataError(f"{source}: branches: must be a non-empty list of branch objects, got {_show(branches)}")
    for b, br in enumerate(branches):
        where = f"{source}: branches[{b}]"
        if not isinstance(br, dict):
            raise DataError(f"{where}: must be an object, got {type(br).__name__}")
        for key in br:
            if key not in BRANCH_KEYS and not str(key).startswith("_"):
                guess = _typo(str(key), BRANCH_KEYS)
                if guess is not None:
                    raise DataError(f"{where}.{key}: unknown field; did you mean '{guess}'?")
        ids = br.get("input_ids")
        if ids is None and "messages" in br:
            raise DataError(f"{where}.messages: {CHAT_HINT}")
        if not isinstance(ids, list) or not ids:
            raise DataError(f"{where}.input_ids: must be a non-empty list of token ids, got {_show(ids)}")
        for i, t in enumerate(ids):
            if not is_int(t):
                raise DataError(f"{where}.input_ids[{i}]: token ids must be integers, got {_show(t)}")
            if t < 0 or t > MAX_TOKEN_ID:
                raise DataError(f"{where}.input_ids[{i}]: token id {_show(t)} is out of range (0 .. 2^63-1)")
        mask = br.get("loss_mask")
        if mask is not None:
            if not isinstance(mask, list) or any(not (m is True or m is False or (is_int(m) and m in (0, 1))) for m in mask):
                raise DataError(f"{where}.loss_mask: must be a list of 0/1 (or true/false), got {_show(mask)}")
            if len(mask) != len(ids):
                raise DataError(f"{where}.loss_mask: length {len(mask)} != {len(ids)} input_ids")
        for key in ("weight", "reward", "advantage"):
            if br.get(key) is not None and not finite_number(br[key]):
                raise DataError(f"{where}.{key}: must be a finite number, got {_show(br[key])}")
        if br.get("weight") is not None and br["weight"] < 0:
            raise DataError(f"{where}.weight: must be >= 0, got {br['weight']!r}")
        for key in ("group", "pair"):
            check_key(br.get(key), f"{where}.{key}")
        if br.get("chosen") is not None and not isinstance(br["chosen"], bool):
            raise DataError(f"{where}.chosen: must be true or false, got {_show(br['chosen'])}")
        rewards = br.get("token_rewards")
        if rewards is not None:
            if not isinstance(rewards, list) or len(rewards) != len(ids):
                raise DataError(f"{where}.token_rewards: must be a list of {len(ids)} rewards (one per token, or null)")
            for i, v in enumerate(rewards):
                if v is not None and not finite_number(v):
                    raise DataError(f"{where}.token_rewards[{i}]: must be a finite number or null, got {_show(v)}")
        versions = br.get("policy_versions")  # per token: the policy version that sampled it (null: not sampled)
        if versions is not None:
            if not isinstance(versions, list) or len(versions) != len(ids):
                got = f"{len(versions)} entries" if isinstance(versions, list) else _show(versions)
                raise DataError(f"{where}.policy_versions: must be a list of {len(ids)} versions (one per token, null "
                                f"for tokens not sampled), got {got}")
            for i, v in enumerate(versions):
                if v is not None and not (is_int(v) and v >= 0):
                    raise DataError(f"{where}.policy_versions[{i}]: must be a non-negative integer or null, "
                                    f"got {_show(v)}")
        images = br.get("images")
        if images is not None:
            if not isinstance(images, list) or not all(isinstance(r, str) and r for r in images):
                raise DataError(f"{where}.images: must be a list of image paths or data: URIs, got {_show(images)}")
            # per-token fields are expanded with the images (builders.vision.expand_raw_images)
        for key in ("old_logprobs", "ref_logprobs"):
            lp = br.get(key)
            if lp is None:
                continue
            if not isinstance(lp, list) or len(lp) != len(ids):
                raise DataError(f"{where}.{key}: must be a list of {len(ids)} log-probs (one per token, or null)")
            for i, v in enumerate(lp):
                if v is not None and not (finite_number(v) and v <= 0):
                    raise DataError(f"{where}.{key}[{i}]: must be a finite log-prob <= 0 or null, got {_show(v)}")
        # routed_experts is read only under model.moe.routing=replay (builders.checks.check_replay_routing)


# reading -----------------------------------------------------------------------------------------


def data_format(path: Union[str, Path]) -> str:
    """``jsonl``, ``json`` or ``parquet`` from the file name (``.gz`` allowed for the JSON ones)."""
    name = Path(path).name.lower()
    for fmt in ("jsonl", "json", "parquet"):
        if name.endswith("." + fmt) or (fmt != "parquet" and name.endswith(f".{fmt}.gz")):
            return fmt
    raise DataError(f"{path}: unsupported data file type (use .jsonl, .json, .parquet, or .jsonl.gz / .json.gz)")


def _json_problem(exc: json.JSONDecodeError) -> str:
    """``exc``'s message and column (Python's "Invalid control character at" already ends in "at")."""
    msg = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at column {exc.colno}"


def _parse(raw: bytes, src: str) -> Union[Any, DataError]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return DataError(f"{src}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                         "data files must be UTF-8")
    try:  # (without the line's end: a line cut short is reported at its last column, not at column 1 of nothing)
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        return DataError(f"{src}: invalid JSON ({_json_problem(exc)})")
    except RecursionError:
        return DataError(f"{src}: invalid JSON (nested too deeply to parse)")
    except ValueError as exc:  # e.g. an integer literal of more than 4300 digits
        return DataError(f"{src}: invalid JSON ({exc})")


_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def _at(item, position, nxt):
    item.position, item.next = position, nxt
    return item


def _iter_jsonl(path: Path, start: Optional[Tuple[int, ...]] = None, limits: Optional[ReadLimits] = None
                ) -> Iterator[Union["Record", DataError]]:
    """Lines of at most ``limits.max_record_bytes`` bytes are parsed; a longer one is reported
    after reading ``max_record_bytes + 1`` bytes of it, and skipped (in bounded pieces) only if
    reading goes on: its ``next`` position ``(line, offset of the line, 1)`` says "skip the line
    at offset" so a reader resuming there skips it too."""
    limits = limits or ReadLimits()
    cap = limits.expanded_cap(path)
    lineno, offset, *skip = start or (0, 0)
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        if offset:
            f.seek(offset)
        blank = False
        while True:
            pos = (lineno, offset)
            if cap is not None and offset > cap:
                yield _at(DataError(limits.expansion_message(path, lineno)), pos, None)
                return
            try:
                if skip:  # the rest of an over-long line
                    skip = []
                    n, _ = skip_line(f, cap, offset)
                    offset += n
                    continue
                if blank:  # a run of blank lines, at buffer speed
                    blank = False
                    n, lines = skip_blank_lines(f, None if cap is None else cap - offset)
                    offset, lineno = offset + n, lineno + lines
                    continue
                raw = f.readline(limits.max_record_bytes + 1)
            except _GZIP_ERRORS as exc:
                yield _at(DataError(f"{path}:{lineno + 1}: truncated or corrupt gzip data after line {lineno} ({exc})"),
                          pos, None)
                return
            except MemoryError:
                raise out_of_memory(f"{path}:{lineno + 1}", limits) from None
            if not raw:
                return
            lineno += 1
            offset += len(raw)
            if len(raw) > limits.max_record_bytes and not raw.endswith(b"\n"):
                del raw
                skip = [1]
                yield _at(DataError(limits.record_message(f"{path}:{lineno}")), pos, (lineno, pos[1], 1))
                continue  # reading goes on: skip the rest of the line
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark
            if not raw.strip():
                blank = True
                continue
            src = f"{path}:{lineno}"
            try:
                item = _checked(_parse(raw, src), src, limits)
            except MemoryError:
                raise out_of_memory(src, limits) from None
            yield _at(item if isinstance(item, DataError) else Record(item, src), pos, (lineno, offset))


def _checked(item: Union[Any, DataError], src: str, limits: ReadLimits) -> Union[Any, DataError]:
    """A parsed record, or the error of one with more branches than the limit allows."""
    if not isinstance(item, DataError):
        n = branch_count(item)
        if n > limits.max_branches_per_record:
            return DataError(f"{src}: the record has {n} branches, more than data.max_branches_per_record="
                             f"{limits.max_branches_per_record} (raise data.max_branches_per_record to read it)")
    return item


def _iter_json(path: Path, start: Optional[int] = None, limits: Optional[ReadLimits] = None
               ) -> Iterator[Union["Record", DataError]]:
    limits = limits or ReadLimits()
    try:
        for item in _iter_json_items(path, start, limits):
            if isinstance(item, DataError):
                yield _at(item, 0, None)
                continue
            checked = _checked(item.data, item.source, limits)
            yield item if checked is item.data else _at(checked, item.position, item.next)
    except MemoryError:
        raise out_of_memory(f"{path} (a .json file is read whole)", limits) from None


def _iter_json_items(path: Path, start: Optional[int], limits: ReadLimits) -> Iterator[Union["Record", DataError]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read(limits.max_record_bytes + 1)
    except _GZIP_ERRORS as exc:
        yield DataError(f"{path}:1: truncated or corrupt gzip data ({exc})")
        return
    if len(raw) > limits.max_record_bytes:
        del raw
        yield DataError(f"{path}:1: a .json file is read whole, and this one is larger than data.max_record_bytes="
                        f"{limits.max_record_bytes} bytes{' decompressed' if path.name.lower().endswith('.gz') else ''}; "
                        "write large data as JSONL, one record per line (e.g. jq -c '.[]' in.json > out.jsonl), "
                        "or raise data.max_record_bytes")
        return
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        yield DataError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[exc.start]:02x}); data files must be UTF-8")
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        yield DataError(f"{path}:{exc.lineno}: invalid JSON ({_json_problem(exc)})")
        return
    except RecursionError:
        yield DataError(f"{path}:1: invalid JSON (nested too deeply to parse)")
        return
    except ValueError as exc:
        yield DataError(f"{path}:1: invalid JSON ({exc})")
        return
    if not isinstance(data, list):
        yield DataError(f"{path}:1: a .json data file must hold a list of records, got {type(data).__name__}")
        return
    for i in range(start or 0, len(data)):
        yield Record(data[i], f"{path}:record {i}", i, i + 1 if i + 1 < len(data) else None)


def _iter_parquet(path: Path, start: Optional[int] = None, limits: Optional[ReadLimits] = None
                  ) -> Iterator[Union["Record", DataError]]:
    import pyarrow as pa  # heavy (~0.3 s CPU): Parquet files only
    import pyarrow.parquet as pq  # heavy: Parquet files only

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        yield _at(DataError(f"{path}:row 0: not a readable Parquet file ({exc})"), 0, None)
        return
    limits = limits or ReadLimits()
    total = pf.metadata.num_rows
    row = 0
    start = start or 0
    for g in range(pf.num_row_groups):
        meta = pf.metadata.row_group(g)
        n = meta.num_rows
        if row + n <= start:
            row += n
            continue
        if meta.total_byte_size > limits.max_record_bytes * max(n, 1):  # its rows average more than the limit
            yield _at(DataError(f"{path}:row {row}: row group {g} holds {meta.total_byte_size} bytes for {n} rows, "
                                f"more than data.max_record_bytes={limits.max_record_bytes} bytes per row "
                                "(raise data.max_record_bytes to read it)"), row, row + n if row + n < total else None)
            row += n
            continue
        try:
            rows = pf.read_row_group(g).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            yield _at(DataError(f"{path}:row {row}: unreadable Parquet row group {g} ({exc})"), row, None)
            return
        except MemoryError:
            raise out_of_memory(f"{path}:row {row} (Parquet row group {g}, read whole)", limits) from None
        for i, rec in enumerate(rows):
            r = row + i
            if r >= start:
                src = f"{path}:row {r}"
                item = _checked(rec, src, limits)
                yield _at(item, r, r + 1 if r + 1 < total else None) if isinstance(item, DataError) \
                    else Record(rec, src, r, r + 1 if r + 1 < total else None)
        row += n


READERS = {"jsonl": _iter_jsonl, "json": _iter_json, "parquet": _iter_parquet}


def iter_file(path: Union[str, Path], start: Any = None, limits: Optional[ReadLimits] = None
              ) -> Iterator[Union[Record, DataError]]:
    """Records (or the :class:`DataError` of a record that cannot be read) of one data file,
    from ``start`` (a :attr:`Record.position`, resuming after nothing: the record at it comes first),
    each within ``limits`` (default :class:`~treelit.data.limits.ReadLimits`: a record over a
    limit is a :class:`DataError` naming it)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    fmt = data_format(path)
    return _with_path(READERS[fmt](path, start, limits), str(path))


def _with_path(items: Iterator[Union[Record, DataError]], path: str) -> Iterator[Union[Record, DataError]]:
    for item in items:
        if isinstance(item, Record):
            item.path = path
        yield item


def read_records(
    path: Union[str, Path],
    *,
    on_error: str = "raise",
    validate=validate_token_record,
    stats: Optional[ReadStats] = None,
    limits: Optional[ReadLimits] = None,
) -> Iterator[Record]:
    """Yield records from a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file (``.gz`` for the JSON ones).

    Args:
        on_error: ``raise`` (stop at the first bad record) or ``skip`` (log it, count it in
            ``stats``, go on). Nothing is dropped silently.
        validate: a per-record check ``validate(record_dict, source)`` (raises DataError).
        limits: :class:`~treelit.data.limits.ReadLimits` (default: the defaults).
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"data.on_error must be one of {ON_ERROR}, got {on_error!r}")
    stats = stats if stats is not None else ReadStats()
    for item in iter_file(path, limits=limits):
        if isinstance(item, Record) and validate is not None:
            try:
                validate(item.data, item.source)
            except DataError as exc:
                item = exc
        if isinstance(item, DataError):
            if on_error == "raise":
                raise item
            stats.skip(item)
            continue
        stats.read += 1
        yield item
