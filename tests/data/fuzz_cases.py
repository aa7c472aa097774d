"""Mutated data files for the bad-input fuzz test.

Each case is a small valid file (token records with groups, rewards, masks and rollout
log-probs, or chat records with tool calls, thinking and compaction) with one mutation
applied, chosen from the kinds below; ``case(i)`` is derandomized (seeded by ``i``).
Mutations either edit the records (``rec``) or the bytes of the written file (``raw``).
"""

from __future__ import annotations

import copy
import gzip
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

VOCAB = 600
MAX_LEN = 40


@dataclass
class Case:
    index: int
    kind: str  # "token" | "chat"
    mutation: str
    records: List[Any]
    raw: Optional[Callable[[bytes], bytes]]  # byte-level mutation of the written file
    fmt: str  # "jsonl" | "json" | "parquet" | "jsonl.gz"


def _lp(prefix: Tuple[int, ...]) -> float:
    return -((hash(prefix) % 97) + 1) / 40.0


def token_base(rng: np.random.Generator) -> List[Dict[str, Any]]:
    recs = []
    per_branch = bool(rng.integers(2))
    given_adv = bool(rng.integers(2))
    for g in range(int(rng.integers(1, 3))):
        key: Any = f"g{g}" if rng.integers(2) else g
        prompt = [int(t) for t in rng.integers(1, 50, size=int(rng.integers(2, 6)))]
        for _ in range(int(rng.integers(2, 4))):
            branches = []
            for _ in range(int(rng.integers(1, 3))):
                comp = [int(t) for t in rng.integers(1, 50, size=int(rng.integers(1, 5)))]
                ids = prompt + comp
                br: Dict[str, Any] = {"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(comp),
                                      "reward": float(rng.integers(2))}
                if rng.integers(3) == 0:
                    br["weight"] = float(rng.choice([0.5, 1.0, 2.0]))
                if rng.integers(2):
                    br["old_logprobs"] = [None] + [_lp(tuple(ids[: t + 1])) for t in range(1, len(ids))]
                if per_branch:
                    br["group"] = key
                if given_adv:
                    br["advantage"] = float(rng.normal())
                branches.append(br)
            rec: Dict[str, Any] = {"id": f"r{len(recs)}", "branches": branches}
            if not per_branch:
                rec["group"] = key
            recs.append(rec)
    return recs


def chat_base(rng: np.random.Generator) -> List[Dict[str, Any]]:
    recs = []
    words = ["alpha", "beta", "gamma", "delta", "order", "flight", "seat", "refund"]

    def text(n):
        return " ".join(str(rng.choice(words)) for _ in range(n))

    for g in range(int(rng.integers(1, 3))):
        key: Any = f"task-{g}" if rng.integers(2) else g
        for _ in range(int(rng.integers(2, 4))):
            msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": text(3)}]
            for turn in range(int(rng.integers(1, 3))):
                a: Dict[str, Any] = {"role": "assistant", "content": text(2)}
                if rng.integers(2):
                    a["reasoning_content"] = text(2)
                if rng.integers(2):
                    a["tool_calls"] = [{"id": "c", "type": "function",
                                        "function": {"name": "lookup", "arguments": {"q": text(1)}}}]
                    msgs += [a, {"role": "tool", "tool_call_id": "c", "content": text(2)}]
                else:
                    msgs += [a, {"role": "user", "content": text(2), **({"compaction": True} if turn and rng.integers(2) else {})}]
            msgs.append({"role": "assistant", "content": text(2)})
            recs.append({"id": f"c{len(recs)}", "group": key, "reward": float(rng.integers(2)), "messages": msgs})
    return recs


# mutations ----------------------------------------------------------------------------------------


def _pick(rng, recs):
    return recs[int(rng.integers(len(recs)))]


def _branch(rng, recs):
    r = _pick(rng, recs)
    return r["branches"][int(rng.integers(len(r["branches"])))]


def _set_group(value):
    def f(rng, recs):
        r = _pick(rng, recs)
        if "group" in r:
            r["group"] = value
        for b in r["branches"]:
            if "group" in b:
                b["group"] = value
    return f


def _typed_pair(a, b):
    def f(rng, recs):
        for r, v in zip(recs[:2], (a, b)):
            r["group"] = v
            for br in r["branches"]:
                br.pop("group", None)
    return f


def _branch_field(field, value):
    def f(rng, recs):
        _branch(rng, recs)[field] = copy.deepcopy(value)
    return f


def _branch_drop(field):
    def f(rng, recs):
        _branch(rng, recs).pop(field, None)
    return f


def _token(value):
    def f(rng, recs):
        br = _branch(rng, recs)
        br["input_ids"][int(rng.integers(len(br["input_ids"])))] = value
    return f


def _record(value):
    def f(rng, recs):
        recs[int(rng.integers(len(recs)))] = copy.deepcopy(value)
    return f


def _some_only(field, value_fn):
    def f(rng, recs):
        for r in recs:
            for b in r["branches"]:
                b.pop(field, None)
        b = _branch(rng, recs)
        b[field] = value_fn(b)
    return f


def _drop_some(field):
    def f(rng, recs):
        for b in _pick(rng, recs)["branches"]:
            b.pop(field, None)
    return f


def _dup_id(rng, recs):
    if len(recs) > 1:
        recs[-1]["id"] = recs[0]["id"]
        for r in (recs[0], recs[-1]):
            r.pop("group", None)
            for b in r.get("branches", []):
                b.pop("group", None)


def _conflict(rng, recs):
    b0 = recs[0]["branches"][0]
    for r in recs[1:]:
        if r.get("group", r["branches"][0].get("group")) == recs[0].get("group", b0.get("group")):
            b = copy.deepcopy(b0)
            b["old_logprobs"] = [None] + [-0.5] * (len(b["input_ids"]) - 1)
            b0["old_logprobs"] = [None] + [-1.5] * (len(b0["input_ids"]) - 1)
            r["branches"].append(b)
            return


def _long(rng, recs):
    b = _branch(rng, recs)
    extra = MAX_LEN + 1 - len(b["input_ids"])
    b["input_ids"] += [3] * extra
    if "loss_mask" in b:
        b["loss_mask"] += [1] * extra
    if "old_logprobs" in b:
        b["old_logprobs"] += [None] * extra


def _mixed_branch_group(rng, recs):
    r = _pick(rng, recs)
    r.pop("group", None)
    r["branches"][0]["group"] = "solo"
    if len(r["branches"]) == 1:
        r["branches"].append(copy.deepcopy(r["branches"][0]))
    r["branches"][1].pop("group", None)
    r["branches"][1]["input_ids"] = r["branches"][1]["input_ids"] + [7]
    for k in ("loss_mask", "old_logprobs"):
        if k in r["branches"][1]:
            r["branches"][1][k] = r["branches"][1][k] + [r["branches"][1][k][-1]]


def _raw_line(fn):
    """Apply ``fn`` to the bytes of the second non-empty line of a JSONL file."""
    def raw(data: bytes) -> bytes:
        lines = data.split(b"\n")
        i = 1 if len(lines) > 2 else 0
        lines[i] = fn(lines[i])
        return b"\n".join(lines)
    return raw


def _ins(blob: bytes):
    return lambda line: line[:12] + blob + line[12:]


TOKEN_REC: Dict[str, Tuple[Callable, str]] = {
    # name: (mutation, field the error should name when the mutated record is refused)
    "group_int_vs_str": (_typed_pair(7, "7"), "group"),
    "group_bool_vs_str": (_typed_pair(True, "True"), "group"),
    "group_list_vs_str": (_typed_pair([1], "[1]"), "group"),
    "group_int_vs_bool": (_typed_pair(1, True), "group"),
    "group_float": (_set_group(1.5), "group"),
    "group_dict": (_set_group({"a": 1}), "group"),
    "group_null": (_set_group(None), "group"),
    "group_missing_on_a_branch": (_mixed_branch_group, "group"),
    "dup_id": (_dup_id, "id"),
    "id_list": (lambda rng, recs: _pick(rng, recs).__setitem__("id", [1, 2]), "id"),
    "reward_missing": (_branch_drop("reward"), "reward"),
    "reward_nan": (_branch_field("reward", float("nan")), "reward"),
    "reward_string": (_branch_field("reward", "1"), "reward"),
    "reward_bool": (_branch_field("reward", True), "reward"),
    "reward_huge_int": (_branch_field("reward", 10**400), "reward"),
    "weight_negative": (_branch_field("weight", -1.0), "weight"),
    "weight_huge_int": (_branch_field("weight", 10**309), "weight"),
    "weight_string": (_branch_field("weight", "2"), "weight"),
    "weight_zero": (_branch_field("weight", 0), "weight"),
    "advantage_some_only": (_some_only("advantage", lambda b: 0.5), "advantage"),
    "advantage_inf": (_branch_field("advantage", float("inf")), "advantage"),
    "advantage_everywhere": (lambda rng, recs: [b.__setitem__("advantage", float(i % 3) - 1) for i, b in enumerate(
        b for r in recs for b in r["branches"])], "advantage"),
    "token_negative": (_token(-1), "input_ids"),
    "token_float": (_token(1.5), "input_ids"),
    "token_float_integral": (_token(3.0), "input_ids"),
    "token_bool": (_token(True), "input_ids"),
    "token_huge": (_token(2**63), "input_ids"),
    "token_above_vocab": (_token(VOCAB), "input_ids"),
    "token_string": (_token("5"), "input_ids"),
    "token_null": (_token(None), "input_ids"),
    "branch_too_long": (_long, "max_seq_len"),
    "input_ids_empty": (_branch_field("input_ids", []), "input_ids"),
    "input_ids_missing": (_branch_drop("input_ids"), "input_ids"),
    "input_ids_nested": (_branch_field("input_ids", [[1, 2], [3]]), "input_ids"),
    "branches_empty": (lambda rng, recs: _pick(rng, recs).__setitem__("branches", []), "branches"),
    "branches_object": (lambda rng, recs: _pick(rng, recs).__setitem__("branches", {"input_ids": [1, 2]}), "branches"),
    "branch_not_object": (lambda rng, recs: _pick(rng, recs)["branches"].__setitem__(0, [1, 2, 3]), "branches"),
    "loss_mask_short": (lambda rng, recs: _branch(rng, recs).__setitem__("loss_mask", [1]), "loss_mask"),
    "loss_mask_value": (lambda rng, recs: _branch(rng, recs).update(
        loss_mask=[2] * 50), "loss_mask"),
    "loss_mask_string": (_branch_field("loss_mask", "1111"), "loss_mask"),
    "loss_mask_missing": (_branch_drop("loss_mask"), "loss_mask"),
    "old_logprob_positive": (lambda rng, recs: _branch(rng, recs).__setitem__(
        "old_logprobs", [None] + [0.5] * 60), "old_logprobs"),
    "old_logprobs_wrong_length": (_branch_field("old_logprobs", [None, -1.0]), "old_logprobs"),
    "old_logprobs_some_records": (_drop_some("old_logprobs"), "old_logprobs"),
    "ref_logprobs_some_records": (_some_only("ref_logprobs", lambda b: [None] + [-1.0] * (len(b["input_ids"]) - 1)),
                                  "ref_logprobs"),
    "old_logprob_conflict": (_conflict, "old_logprobs"),
    "group_some_records": (_drop_some("group"), "group"),
    "reward_some_records": (_drop_some("reward"), "reward"),
    "field_typo": (lambda rng, recs: _branch(rng, recs).__setitem__("loss_masks", [1]), "loss_masks"),
    "unknown_field": (_branch_field("note", "kept aside"), ""),
    "chosen_not_bool": (_branch_field("chosen", "yes"), "chosen"),
    "pair_list": (_branch_field("pair", [0]), "pair"),
    "record_list": (_record([1, 2, 3]), "record|branches"),
    "record_null": (_record(None), "record|branches"),
    "record_string": (_record("branches"), "record|branches"),
    "valid": (lambda rng, recs: None, ""),
}

RAW: Dict[str, Tuple[Callable[[bytes], bytes], str]] = {
    "invalid_json": (_raw_line(lambda line: line[: len(line) // 2]), "invalid JSON"),
    "invalid_utf8": (_raw_line(_ins(b"\xff\xfe")), "UTF-8"),
    "latin1_bytes": (_raw_line(_ins("caf\u00e9".encode("latin-1"))), "UTF-8"),
    "utf16_file": (lambda data: data.decode("utf-8").encode("utf-16"), "UTF-8"),
    "deep_nesting": (_raw_line(lambda line: b"[" * 50000 + b"]" * 50000), "nested"),
    "huge_digits": (_raw_line(lambda line: line.replace(b"[", b"[" + b"9" * 5000 + b",", 1)), "invalid JSON"),
    "nan_literal": (_raw_line(lambda line: line.replace(b'"reward": 1.0', b'"reward": NaN').replace(
        b'"reward": 0.0', b'"reward": NaN')), "reward"),
    "blank_lines": (lambda data: b"\n\n" + data.replace(b"\n", b"\n   \n"), ""),
    "utf8_bom": (lambda data: b"\xef\xbb\xbf" + data, ""),
    "crlf": (lambda data: data.replace(b"\n", b"\r\n"), ""),
    "truncated": (lambda data: data[: max(1, len(data) * 2 // 3)], "gzip"),
}


def _msg(rng, recs, role="assistant"):
    r = _pick(rng, recs)
    ms = [m for m in r["messages"] if m.get("role") == role]
    return ms[int(rng.integers(len(ms)))], r


def _msg_field(field, value, role="assistant"):
    def f(rng, recs):
        _msg(rng, recs, role)[0][field] = copy.deepcopy(value)
    return f


def _call(value):
    def f(rng, recs):
        _msg(rng, recs)[0]["tool_calls"] = [copy.deepcopy(value)]
    return f


def _no_assistant(rng, recs):
    r = _pick(rng, recs)
    r["messages"] = [m for m in r["messages"] if m["role"] != "assistant"]


def _chat_dup_id(rng, recs):
    if len(recs) > 1:
        recs[-1]["id"] = recs[0]["id"]
        recs[0].pop("group", None)
        recs[-1].pop("group", None)


CHAT_REC: Dict[str, Tuple[Callable, str]] = {
    "reasoning_object": (_msg_field("reasoning_content", {"a": 1}), "reasoning_content"),
    "reasoning_number": (_msg_field("reasoning_content", 3), "reasoning_content"),
    "thinking_list": (_msg_field("thinking", ["x"]), "thinking"),
    "compaction_string": (_msg_field("compaction", "false", "user"), "compaction"),
    "compaction_list": (_msg_field("compaction", [0], "user"), "compaction"),
    "compaction_object": (_msg_field("compaction", {}, "user"), "compaction"),
    "compaction_true": (_msg_field("compaction", True, "user"), ""),
    "compaction_false": (_msg_field("compaction", False, "user"), ""),
    "call_no_name": (_call({"function": {"arguments": "{}"}}), "name"),
    "call_name_int": (_call({"function": {"name": 3, "arguments": "{}"}}), "name"),
    "call_function_string": (_call({"function": "lookup"}), "function"),
    "call_null": (_call(None), "tool_calls"),
    "call_arguments_list": (_call({"function": {"name": "f", "arguments": [1]}}), "arguments"),
    "call_flat": (_call({"name": "lookup", "arguments": "{\"q\": 1}"}), ""),
    "tool_calls_object": (_msg_field("tool_calls", {"name": "f"}), "tool_calls"),
    "lone_surrogate": (_msg_field("content", "a\ud800b"), "content"),
    "lone_surrogate_in_args": (_call({"function": {"name": "f", "arguments": {"q": "\udc00"}}}), "arguments"),
    "content_number": (_msg_field("content", 5), "content"),
    "content_null": (_msg_field("content", None), ""),
    "role_unknown": (_msg_field("role", "robot"), "role"),
    "messages_empty": (lambda rng, recs: _pick(rng, recs).__setitem__("messages", []), "messages"),
    "message_not_object": (lambda rng, recs: _pick(rng, recs)["messages"].__setitem__(1, "hi"), "messages"),
    "no_assistant": (_no_assistant, "assistant"),
    "reward_nan": (lambda rng, recs: _pick(rng, recs).__setitem__("reward", float("nan")), "reward"),
    "reward_string": (lambda rng, recs: _pick(rng, recs).__setitem__("reward", "1"), "reward"),
    "reward_missing": (lambda rng, recs: _pick(rng, recs).pop("reward"), "reward"),
    "group_list": (lambda rng, recs: _pick(rng, recs).__setitem__("group", ["t"]), "group"),
    "group_bool": (lambda rng, recs: _pick(rng, recs).__setitem__("group", True), "group"),
    "group_int_vs_str": (lambda rng, recs: [recs[0].__setitem__("group", 3), recs[1].__setitem__("group", "3")], "group"),
    "dup_id": (_chat_dup_id, "id"),
    "valid": (lambda rng, recs: None, ""),
}


def case(i: int) -> Case:
    rng = np.random.default_rng(i)
    kind = "chat" if i % 5 == 4 else "token"
    table = CHAT_REC if kind == "chat" else TOKEN_REC
    names = sorted(table) + sorted(RAW)
    name = names[(i // 5) % len(names)]
    recs = chat_base(rng) if kind == "chat" else token_base(rng)
    raw = None
    fmt = ["jsonl", "json", "jsonl", "parquet", "jsonl.gz", "jsonl", "jsonl"][(i // 3) % 7]
    if name in RAW:
        raw = RAW[name][0]
        if name == "truncated":
            fmt = "jsonl.gz"
        elif fmt == "parquet" or (fmt == "json" and name in ("blank_lines", "crlf")):
            fmt = "jsonl"
    else:
        table[name][0](rng, recs)
    return Case(i, kind, name, recs, raw, fmt)


def expected_field(c: Case) -> str:
    return (RAW[c.mutation][1] if c.raw is not None else (CHAT_REC if c.kind == "chat" else TOKEN_REC)[c.mutation][1])


def write_case(c: Case, directory) -> Any:
    """Write the case's file; returns its path (Parquet falls back to JSONL where the records
    have no single Arrow schema)."""
    from pathlib import Path

    fmt = c.fmt
    if fmt == "parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = Path(directory) / f"case{c.index}.parquet"
            pq.write_table(pa.Table.from_pylist(c.records), path)
            return path
        except Exception:
            fmt = "jsonl"
    path = Path(directory) / f"case{c.index}.{fmt}"
    if fmt == "json":
        text = json.dumps(c.records).encode()
    else:
        text = "".join(json.dumps(r) + "\n" for r in c.records).encode()
    if fmt == "jsonl.gz":
        data = c.raw(gzip.compress(text)) if c.mutation == "truncated" else gzip.compress(c.raw(text) if c.raw else text)
    else:
        data = c.raw(text) if c.raw else text
    path.write_bytes(data)
    return path
