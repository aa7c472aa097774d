"""Bad input, fuzzed: every mutated file is built exactly as written, refused with a clear
error naming the file and the line (and the field), or its bad records are skipped and
counted - nothing in between, and no raw exception reaches the user.

2,400 derandomized files (``fuzz_cases.case(i)``: token or chat records, JSONL, JSON,
Parquet or gzipped JSONL, one mutation each) go through the data path of
``treelit-train`` (read, build, check against a model's limits and the objective, pack)
with the ``sequences``, ``groups`` and ``chat`` builders, with and without an advantage
estimator, under ``on_error=raise`` and ``skip``. A build is compared with an
independent reading of the file: the kept records' branches, masks, weights, rollout
log-probs and advantages (computed here from the rewards), grouped by keys of the same
JSON type; chat branches are compared as text with the documented export (thinking kept
in its own call, compaction honoured).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import re
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

from fuzz_cases import CHAT_REC, MAX_LEN, RAW, TOKEN_REC, VOCAB, case, expected_field, write_case
from pipeline import run
from treelit.data.records import DataError

N_FILES = 2400
TOKEN_CONFIGS = [("sequences", None, "sft"), ("groups", None, "sft"), ("sequences", "grpo", "grpo"),
                 ("groups", "grpo", "grpo"), ("groups", None, "ppo")]
CHAT_CONFIGS = [("per_call", None, "sft"), ("trajectory", "grpo", "grpo"), ("per_call", "grpo", "grpo"),
                ("trajectory", None, "sft")]
DATASET_LEVEL = ("no trees to train on", "have a single sample", "has a single sample", "group_key is not set")
UNREADABLE = object()


# an independent reading of the file ----------------------------------------------------------------


def oracle_records(path: Path) -> Tuple[List[Tuple[str, Any]], bool]:
    """``[(location, record or UNREADABLE)]`` and whether the file is complete (not truncated)."""
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [(f"{path}:row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())], True
    raw = path.read_bytes()
    complete = True
    if name.endswith(".gz"):
        d = __import__("zlib").decompressobj(31)
        raw = d.decompress(raw)
        complete = d.eof
    if name.endswith(".json") or name.endswith(".json.gz"):
        try:
            data = json.loads(raw.decode("utf-8-sig"))
            assert isinstance(data, list)
        except (Exception, RecursionError):
            return [(f"{path}:1", UNREADABLE)], complete
        return [(f"{path}:record {i}", r) for i, r in enumerate(data)], complete
    out = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if n == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{n}", json.loads(line.decode("utf-8"))))
        except (Exception, RecursionError):
            out.append((f"{path}:{n}", UNREADABLE))
    if not complete and out:
        out[-1] = (out[-1][0], UNREADABLE)  # the last line may be cut short
    return out, complete


def _num(x) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _key(x) -> bool:
    return x is None or isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))


def invalid_token_record(rec, builder) -> str:
    """Why a token record may not be built as written ('' if it may)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("branches"), list) or not rec["branches"]:
        return "structure"
    if builder == "groups" and not _key(rec.get("group")):
        return "record group"
    for br in rec["branches"]:
        ids = br.get("input_ids") if isinstance(br, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < VOCAB for t in ids):
            return "input_ids"
        if len(ids) > MAX_LEN:
            return "length"
        m = br.get("loss_mask")
        if m is not None and (len(m) != len(ids) or any(type(v) not in (int, bool) or v not in (0, 1) for v in m)):
            return "loss_mask"
        for k in ("weight", "reward", "advantage"):
            if br.get(k) is not None and not _num(br[k]):
                return k
        if br.get("weight") is not None and br["weight"] < 0:
            return "weight"
        if not _key(br.get("group")) or not _key(br.get("pair")):
            return "group/pair"
        for k in ("old_logprobs", "ref_logprobs"):
            v = br.get(k)
            if v is not None and (len(v) != len(ids) or any(x is not None and not (_num(x) and x <= 0) for x in v)):
                return k
    return ""


def invalid_chat_record(rec) -> str:
    if not isinstance(rec, dict) or not _key(rec.get("group")) or not (rec.get("reward") is None or _num(rec["reward"])):
        return "record"
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not any(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs):
        return "messages"
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            return "message"
        for k in ("content", "reasoning_content", "thinking"):
            if m.get(k) is not None and not isinstance(m[k], str):
                return k
        if m.get("compaction") is not None and not isinstance(m["compaction"], bool):
            return "compaction"
        for c in m.get("tool_calls") or []:
            fn = c.get("function") if isinstance(c, dict) and c.get("function") is not None else c
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), (str, dict)):
                return "tool_calls"
        try:
            json.dumps(m, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "surrogate"
    return ""


def _typed(k):
    return None if k is None else (type(k).__name__, k)


def _grpo(rewards: List[float], keys: List[Any]) -> List[float]:
    out = [0.0] * len(rewards)
    groups: Dict[Any, List[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    for idx in groups.values():
        r = np.array([rewards[i] for i in idx])
        a = (r - r.mean()) / (r.std(ddof=1) + 1e-6) if len(idx) > 1 else np.zeros(1)
        for i, v in zip(idx, a):
            out[i] = float(v)
    return out


def _canon_lp(vals):
    return tuple(None if (v is None or (isinstance(v, float) and math.isnan(v))) else round(float(v), 9) for v in vals)


def expected_token_trees(kept, builder, est, objective):
    rl = objective != "sft"
    trees: "OrderedDict[Any, List[list]]" = OrderedDict()
    for ri, (_, rec) in enumerate(kept):
        for br in rec["branches"]:
            if builder == "sequences":
                tk = ("own", ri)
                ak = _typed(br.get("group")) or ("own", ri)
            else:
                k = br.get("group") if br.get("group") is not None else rec.get("group")
                tk = _typed(k) or ("own", ri)
                ak = tk
            trees.setdefault(tk, []).append([br, ak, br.get("advantage") if rl else None])
    if rl and est:
        todo = [item for t in trees.values() for item in t if item[0].get("advantage") is None]
        for item, a in zip(todo, _grpo([float(i[0]["reward"]) for i in todo], [i[1] for i in todo])):
            item[2] = a
    out = []
    for items in trees.values():
        has_old = rl and any(i[0].get("old_logprobs") is not None for i in items)
        tree = []
        for br, _, adv in items:
            ids = list(br["input_ids"])
            mask = tuple(bool(m) for m in br["loss_mask"]) if br.get("loss_mask") is not None else (True,) * len(ids)
            old = None
            if has_old:
                old = _canon_lp(br.get("old_logprobs") or [None] * len(ids))
            w = 1.0 if br.get("weight") is None else float(br["weight"])
            tree.append((tuple(int(t) for t in ids), mask, round(w, 9), None if adv is None else round(float(adv), 6), old))
        out.append(tuple(tree))
    return sorted(out, key=repr)


def built_token_trees(dm):
    out = []
    for t in dm.trees:
        tr = t.tree
        ptr = tr.branch_ptr
        tree = []
        for b in range(tr.num_branches):
            old = None if tr.branch_old is None else _canon_lp(tr.branch_old[ptr[b]: ptr[b + 1]].tolist())
            adv = None if tr.branch_adv is None else round(float(tr.branch_adv[b]), 6)
            tree.append((tuple(int(x) for x in tr.branch(b)), tuple(bool(m) for m in tr.loss_mask(b)),
                         round(float(tr.branch_weight[b]), 9), adv, old))
        out.append(tuple(tree))
    return sorted(out, key=repr)


def _norm(m, keep):
    out = {k: v for k, v in m.items() if k not in ("reasoning_content", "thinking", "compaction")}
    if out.get("tool_calls"):  # a null 'function' (Parquet's fill for a flat call) is absent
        out["tool_calls"] = [{k: v for k, v in c.items() if not (k == "function" and v is None)} for c in out["tool_calls"]]
    th = m.get("reasoning_content") or m.get("thinking")
    if out.get("content") is None:
        out["content"] = ""
    if keep and th:
        out["content"] = f"<think>\n{th}\n</think>\n\n{out['content']}"
    return out


def chat_texts(tok, msgs, export):
    render = lambda ms: tok.apply_chat_template(ms, tokenize=False)  # noqa: E731
    if export == "trajectory":
        return [render([_norm(m, True) for m in msgs])]
    out = []
    for t, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = max([i for i in range(t) if msgs[i].get("compaction") is True], default=0)
        ctx = [i for i in range(start) if msgs[i]["role"] == "system"] + list(range(start, t))
        out.append(render([_norm(msgs[i], False) for i in ctx] + [_norm(m, True)]))
    return out


def expected_chat_trees(tok, kept, export, est, objective):
    trees: "OrderedDict[Any, List[list]]" = OrderedDict()
    rewards, keys, members = [], [], []
    for ri, (_, rec) in enumerate(kept):
        k = _typed(rec.get("group")) or ("own", ri)
        texts = chat_texts(tok, rec["messages"], export)
        items = [[txt, None] for txt in texts]
        trees.setdefault(k, []).extend(items)
        rewards.append(rec.get("reward"))
        keys.append(k)
        members.append(items)
    if est and objective != "sft":
        for items, a in zip(members, _grpo([float(r) for r in rewards], keys)):
            for it in items:
                it[1] = round(a, 6)
    return sorted((tuple((txt, adv) for txt, adv in t) for t in trees.values()), key=repr)


def built_chat_trees(tok, dm):
    out = []
    for t in dm.trees:
        tr = t.tree
        out.append(tuple((tok.decode(tr.branch(b).tolist()), None if tr.branch_adv is None else
                          round(float(tr.branch_adv[b]), 6)) for b in range(tr.num_branches)))
    return sorted(out, key=repr)


# the test ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from treelit.builders.chat import load_tokenizer
    from treelit.data.tokenizers import qwen_tokenizer_dir

    return load_tokenizer(qwen_tokenizer_dir())


def _error_ok(msg: str, path: Path, field: str, on_error: str, objective: str = "") -> bool:
    dataset_level = any(s in msg for s in DATASET_LEVEL)
    if on_error == "skip" and not dataset_level:
        return False  # skip must skip a bad record, never stop on it
    if not msg.startswith(f"{path}"):
        return False
    if dataset_level:
        return True
    if not re.match(rf"{re.escape(str(path))}:(\d+|row \d+|record \d+): ", msg):
        return False  # a record-level error names the line (row, record)
    return field == "" or any(f in msg for f in field.split("|")) or "invalid JSON" in msg or (objective == "ppo" and ".advantage:" in msg)


def check_case(i: int, directory: Path, tok, outcomes: Counter) -> None:
    c = case(i)
    path = write_case(c, directory)
    field = expected_field(c)
    if c.kind == "chat":
        export, est, objective = CHAT_CONFIGS[(i // 5) % len(CHAT_CONFIGS)]
        kw = dict(builder="chat", tokenizer=tok, vocab=200_000, max_len=4096,
                  builder_options={"export": export, "advantage": est, "group_key": "group"})
    else:
        builder, est, objective = TOKEN_CONFIGS[(i // 2) % len(TOKEN_CONFIGS)]
        kw = dict(builder=builder, vocab=VOCAB, max_len=MAX_LEN, builder_options={"advantage": est})
    entries, complete = oracle_records(path)
    results = {}
    for on_error in ("raise", "skip"):
        where = f"case {i} ({c.kind}/{c.mutation}, {path.name}, {kw['builder']} advantage={est} objective={objective}, on_error={on_error})"
        try:
            dm = run(path, on_error=on_error, objective=objective, **kw)
        except DataError as exc:
            assert _error_ok(str(exc), path, field, on_error, objective), f"{where}: unclear error: {exc}"
            results[on_error] = ("error", str(exc))
            outcomes[f"{on_error}:error"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{where}: raw {type(exc).__name__} reached the user: {exc}")
        kept_locs = {s for t in dm.trees for s in t.sources}
        kept = [(loc, rec) for loc, rec in entries if loc in kept_locs]
        assert len(kept) == len(kept_locs), f"{where}: built from records the file does not hold: {kept_locs}"
        assert all(rec is not UNREADABLE for _, rec in kept), f"{where}: built an unreadable record"
        skipped = dm.read_stats.skipped
        if complete:
            assert skipped + len(kept) == len(entries), f"{where}: {len(entries)} records, {len(kept)} built, {skipped} skipped"
        else:
            assert skipped >= 1 and skipped + len(kept) <= len(entries), where
        if on_error == "raise":
            assert skipped == 0 and len(kept) == len(entries), where
        else:
            assert len(dm.read_stats.errors) == min(skipped, 1000) or skipped > len(dm.read_stats.errors), where
            for e in dm.read_stats.errors:
                assert _error_ok(e, path, field, "raise", objective) or any(s in e for s in DATASET_LEVEL) or \
                    re.match(rf"{re.escape(str(path))}:(\d+|row \d+|record \d+): ", e), f"{where}: unclear skip: {e}"
        for loc, rec in kept:
            why = invalid_chat_record(rec) if c.kind == "chat" else invalid_token_record(rec, kw["builder"])
            assert not why, f"{where}: built {loc}, whose {why} is not valid as written: {rec}"
        if c.kind == "chat":
            exp, got = expected_chat_trees(tok, kept, export, est, objective), built_chat_trees(tok, dm)
        else:
            exp, got = expected_token_trees(kept, kw["builder"], est, objective), built_token_trees(dm)
        assert got == exp, f"{where}: built\n{got}\nexpected (from the file as written)\n{exp}"
        results[on_error] = ("built", skipped)
        outcomes[f"{on_error}:{'skip' if skipped else 'built'}"] += 1
    if results["raise"][0] == "built":
        assert results["skip"] == ("built", 0), f"case {i}: raise built everything but skip did not: {results}"


@pytest.mark.parametrize("chunk", range(8))
def test_fuzzed_files(chunk, tmp_path, tok, caplog):
    caplog.set_level(logging.ERROR)
    outcomes: Counter = Counter()
    for i in range(chunk, N_FILES, 8):
        check_case(i, tmp_path, tok, outcomes)
    total = sum(outcomes.values())
    assert total == 2 * len(range(chunk, N_FILES, 8))
    # the cases exercise all three outcomes under both modes
    assert outcomes["raise:built"] and outcomes["raise:error"] and outcomes["skip:skip"], outcomes


def test_the_fuzz_covers_every_mutation_kind_and_format():
    seen = Counter((case(i).kind, case(i).mutation) for i in range(N_FILES))
    assert N_FILES >= 2000
    for name in list(TOKEN_REC) + list(RAW):
        assert seen[("token", name)] >= 3, name
    for name in list(CHAT_REC) + list(RAW):
        assert seen[("chat", name)] >= 1, name
    fmts = Counter(case(i).fmt for i in range(N_FILES))
    assert set(fmts) == {"jsonl", "json", "parquet", "jsonl.gz"}, fmts
