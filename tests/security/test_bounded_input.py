"""Bounded input: whatever a data file holds, reading it costs bounded memory and time, and an
over-limit record is a data error naming the file, the line and the option to raise
(``on_error=skip`` skips it and the good records still build). Running out of memory is
never reported as bad data. The gzip bomb goes through the real ``treelit-train`` under an
address-space cap."""

from __future__ import annotations

import gzip
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from treelit.builders.base import make_tree_builder
from treelit.data.limits import MiB, ReadLimits, ReadMemoryError
from treelit.data.records import DataError, iter_file
from treelit.data.sources import make_data_source
from treelit.data.stream import TreeStream
from treelit.lightning.data import TreeDataModule
from treelit.lightning.rollouts import RolloutDirDataModule
from treelit.lightning.streaming import StreamingTreeDataModule

GOOD = {"branches": [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 4]}]}


def line(rec) -> bytes:
    return json.dumps(rec).encode() + b"\n"


def long_line(n: int) -> bytes:
    """A valid record of about ``n`` bytes (one branch of many token ids)."""
    k = max(1, n // 4)
    return line({"branches": [{"input_ids": [100] * k}]})


# crafting gzip bombs without holding (or even compressing) what they expand to ------------------


def _gf2_times(mat, vec):
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat):
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A+B from those of A and B (zlib's algorithm; Python's zlib lacks it)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def write_bomb(path: Path, expanded: int, prefix: bytes = b"", fill: bytes = b"\0", chunk: int = MiB) -> Path:
    """A valid gzip file: ``prefix`` then ``expanded`` bytes of ``fill``. One chunk is compressed
    once (after a full flush deflate blocks stand alone) and its blocks written again and again."""
    piece = (fill * chunk)[:chunk]
    blocks = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = blocks.compress(piece) + blocks.flush(zlib.Z_FULL_FLUSH)
    head = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = head.compress(prefix) + head.flush(zlib.Z_FULL_FLUSH)
    end = zlib.compressobj(9, zlib.DEFLATED, -15)
    last = end.compress(b"") + end.flush()
    k = expanded // chunk
    crc, size, one = 0, 0, zlib.crc32(piece)
    step, step_len, n = one, chunk, k  # CRC of k chunks by doubling
    while n:
        if n & 1:
            crc, size = crc32_combine(crc, step, step_len), size + step_len
        step, step_len, n = crc32_combine(step, step, step_len), 2 * step_len, n >> 1
    crc = crc32_combine(zlib.crc32(prefix), crc, size)
    with open(path, "wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + first)
        for _ in range(k):
            f.write(block)
        f.write(last + struct.pack("<II", crc, (len(prefix) + size) & 0xFFFFFFFF))
    return path


def test_the_crafted_bomb_is_valid_gzip(tmp_path):
    p = write_bomb(tmp_path / "b.gz", 3 * 65536, prefix=b"head\n", fill=b"xy", chunk=65536)
    data = gzip.decompress(p.read_bytes())  # checks the CRC and the length
    assert data == b"head\n" + b"xy" * (3 * 65536 // 2)


# max_record_bytes ------------------------------------------------------------------------------


def test_a_long_line_names_file_line_and_limit_and_is_never_held(tmp_path):
    p = tmp_path / "d.jsonl"
    with open(p, "wb") as f:
        f.write(line(GOOD))
        for _ in range(16):  # a 16 MiB line, written in pieces
            f.write(b" " * MiB)
        f.write(b"x\n")
        f.write(line(GOOD))
    limits = ReadLimits(max_record_bytes=64 * 1024)
    tracemalloc.start()
    try:
        items = list(iter_file(p, limits=limits))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB, f"reading held {peak} bytes"
    kinds = [type(i).__name__ for i in items]
    assert kinds == ["Record", "DataError", "Record"]
    assert str(items[1]) == (f"{p}:2: the record is longer than data.max_record_bytes=65536 bytes "
                             "(raise data.max_record_bytes to read it)")
    assert items[2].source == f"{p}:3"
    # the error's resume position skips the long line; the good record after it comes next
    after = list(iter_file(p, items[1].next, limits=limits))
    assert [i.source for i in after] == [f"{p}:3"]
    # a line of exactly the limit is read
    q = tmp_path / "e.jsonl"
    rec = long_line(1000)
    q.write_bytes(rec)
    assert [type(i).__name__ for i in iter_file(q, limits=ReadLimits(max_record_bytes=len(rec) - 1))] == ["Record"]
    assert [type(i).__name__ for i in iter_file(q, limits=ReadLimits(max_record_bytes=len(rec) - 2))] == ["DataError"]


def _lines_file(tmp_path, name="d.jsonl"):
    p = tmp_path / name
    data = line(GOOD) + long_line(5000) + line({"branches": [{"input_ids": [5, 6]}]})
    if name.endswith(".gz"):
        p.write_bytes(gzip.compress(data))
    else:
        p.write_bytes(data)
    return p


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz"])
def test_in_memory_data_raise_and_skip(tmp_path, name):
    p = _lines_file(tmp_path, name)
    dm = TreeDataModule(str(p), max_record_bytes=4096, shuffle=False)
    with pytest.raises(DataError, match=rf"^{p}:2: the record is longer than data.max_record_bytes=4096 bytes"):
        dm.setup()
    dm = TreeDataModule(str(p), max_record_bytes=4096, on_error="skip", shuffle=False)
    dm.setup()
    assert dm.read_stats.skipped == 1 and "data.max_record_bytes=4096" in dm.read_stats.errors[0]
    assert [t.source for t in dm.trees] == [f"{p}:1", f"{p}:3"]
    assert TreeDataModule(str(p), shuffle=False).stats()["trees"] == 3  # the default limit reads it


def _stream(paths, on_error="raise", **limits):
    m = StreamingTreeDataModule(make_data_source("files", paths=[str(x) for x in paths]), shuffle=False,
                                shuffle_buffer=4, on_error=on_error, micro_batch_tokens=64, **limits)
    m.check_against(1000, 64)
    return m


def test_streamed_data_raise_and_skip(tmp_path):
    p = _lines_file(tmp_path, "d.jsonl.gz")
    with pytest.raises(DataError, match=rf"^{p}:2: the record is longer than data.max_record_bytes=4096 bytes"):
        _stream([p], max_record_bytes=4096).next_step()
    m = _stream([p], on_error="skip", max_record_bytes=4096)
    assert m.source.read_limits == ReadLimits(max_record_bytes=4096)
    assert m.next_step().tree_tokens > 0
    assert m.read_stats.skipped >= 1 and all(e.startswith(f"{p}:2: ") for e in m.read_stats.errors)
    # one reader, record by record: the long line is skipped, the records around it served
    stream = TreeStream(m.source, [0], make_tree_builder("sequences"), on_error="skip", shuffle=False, buffer_size=4)
    trees = [stream.next_tree() for _ in range(3)]
    assert [(t.source, t.epoch) for t in trees] == [(f"{p}:1", 0), (f"{p}:3", 0), (f"{p}:1", 1)]
    assert stream.stats.skipped >= 1 and all(e.startswith(f"{p}:2: ") for e in stream.stats.errors)  # once per epoch


def test_rollout_files_raise_and_skip(tmp_path):
    d = tmp_path / "rollouts"
    d.mkdir()
    p = _lines_file(d, "step-000.jsonl")
    m = RolloutDirDataModule(str(d), max_record_bytes=4096, timeout_s=5)
    m.check_against(1000, 64)
    with pytest.raises(DataError, match=rf"^{p}:2: the record is longer than data.max_record_bytes=4096 bytes"):
        m.load_step(0)
    m = RolloutDirDataModule(str(d), max_record_bytes=4096, max_branches_per_record=1, on_error="skip", timeout_s=5)
    m.check_against(1000, 64)
    step = m.load_step(0)
    assert m.read_stats.skipped == 2 and step.tree_tokens == 2  # the long line and the two-branch record


# max_branches_per_record -------------------------------------------------------------------------


def test_too_many_branches_named_and_skipped(tmp_path):
    p = tmp_path / "d.jsonl"
    wide = {"branches": [{"input_ids": [1, i]} for i in range(2, 9)]}  # 7 branches
    p.write_bytes(line(GOOD) + line(wide) + line(GOOD))
    with pytest.raises(DataError, match=rf"^{p}:2: the record has 7 branches, more than "
                                        r"data.max_branches_per_record=6 \(raise data.max_branches_per_record"):
        TreeDataModule(str(p), max_branches_per_record=6).setup()
    dm = TreeDataModule(str(p), max_branches_per_record=6, on_error="skip", shuffle=False)
    dm.setup()
    assert dm.read_stats.skipped == 1 and len(dm.trees) == 2
    assert TreeDataModule(str(p), max_branches_per_record=7).stats()["branches"] == 11


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_branch_limit_in_json_and_parquet(tmp_path, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [GOOD, {"branches": [{"input_ids": [1, i]} for i in range(2, 9)]}]
    p = tmp_path / f"d.{fmt}"
    if fmt == "json":
        p.write_text(json.dumps(recs))
    else:
        pq.write_table(pa.Table.from_pylist(recs), p)
    items = list(iter_file(p, limits=ReadLimits(max_branches_per_record=6)))
    where = "record 1" if fmt == "json" else "row 1"
    assert type(items[0]).__name__ == "Record" and items[0].source.endswith(("record 0", "row 0"))
    assert isinstance(items[1], DataError)
    assert str(items[1]).startswith(f"{p}:{where}: the record has 7 branches, more than data.max_branches_per_record=6")


def test_branch_limit_in_a_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    wide = {"branches": [{"input_ids": [1, i]} for i in range(2, 9)]}
    datasets.Dataset.from_list([GOOD, wide, GOOD]).save_to_disk(str(tmp_path / "ds"))
    m = StreamingTreeDataModule(make_data_source("hf_dataset", path=str(tmp_path / "ds")), max_branches_per_record=6)
    items = list(m.source.read(0))
    assert [type(i).__name__ for i in items] == ["Record", "DataError", "Record"]
    assert str(items[1]).startswith(f"{tmp_path / 'ds'}:row 1: the record has 7 branches, more than "
                                    "data.max_branches_per_record=6")
    assert items[1].next == 2


def test_chat_records_count_their_model_calls():
    from treelit.data.limits import branch_count

    msgs = [{"role": "user", "content": "q"}] + [{"role": "assistant", "content": str(i)} for i in range(5)]
    assert branch_count({"messages": msgs}) == 5
    assert branch_count({"branches": [{"messages": msgs}, {"messages": msgs[:2]}]}) == 6
    assert branch_count(GOOD) == 2 and branch_count([1, 2]) == 0


# .json files and compressed input -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["d.json", "d.json.gz"])
def test_a_json_file_obeys_the_record_limit_as_a_whole(tmp_path, name):
    p = tmp_path / name
    text = json.dumps([GOOD] * 200).encode()
    p.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    assert len(list(iter_file(p, limits=ReadLimits(max_record_bytes=len(text))))) == 200
    (err,) = list(iter_file(p, limits=ReadLimits(max_record_bytes=len(text) - 1)))
    assert isinstance(err, DataError)
    assert str(err).startswith(f"{p}:1: a .json file is read whole, and this one is larger than "
                               f"data.max_record_bytes={len(text) - 1} bytes")
    assert "JSONL" in str(err)
    dm = TreeDataModule(str(p), max_record_bytes=len(text) - 1, on_error="skip")
    with pytest.raises(DataError, match="no trees to train on"):
        dm.setup()
    assert dm.read_stats.skipped == 1


def test_expansion_ratio_names_file_and_option(tmp_path):
    p = write_bomb(tmp_path / "d.jsonl.gz", 64 * MiB, prefix=line(GOOD) * 3, fill=b"\n")
    size = p.stat().st_size
    limits = ReadLimits(max_record_bytes=MiB, max_expansion_ratio=10)
    t0 = time.monotonic()
    items = list(iter_file(p, limits=limits))
    assert time.monotonic() - t0 < 20
    assert [type(i).__name__ for i in items] == ["Record"] * 3 + ["DataError"]
    msg = str(items[-1])
    assert msg.startswith(f"{p}:")
    assert f"decompressed data passed {max(MiB, 10 * size)} bytes, more than data.max_expansion_ratio=10 times" in msg
    assert "raise data.max_expansion_ratio" in msg
    dm = TreeDataModule(str(p), max_record_bytes=MiB, max_expansion_ratio=10, on_error="skip", shuffle=False)
    dm.setup()
    assert len(dm.trees) == 3 and dm.read_stats.skipped == 1
    # a genuine, well-compressed file within the ratio reads whole
    assert len(list(iter_file(p, limits=ReadLimits(max_expansion_ratio=100_000)))) == 3


def test_bomb_in_process_holds_at_most_one_record(tmp_path):
    """The fast variant of the command-line bomb: one endless line of zeros."""
    p = write_bomb(tmp_path / "b.jsonl.gz", 256 * MiB, prefix=line(GOOD))
    limits = ReadLimits(max_record_bytes=2 * MiB)
    tracemalloc.start()
    try:
        it = iter_file(p, limits=limits)
        first, second = next(it), next(it)
        _, peak = tracemalloc.get_traced_memory()
        rest = list(it)  # under on_error=skip reading goes on: the line is skipped up to the cap
        _, peak_all = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first.source == f"{p}:1"
    assert str(second) == f"{p}:2: the record is longer than data.max_record_bytes={2 * MiB} bytes " \
                          "(raise data.max_record_bytes to read it)"
    assert peak < 8 * MiB and peak_all < 8 * MiB, (peak, peak_all)
    assert len(rest) == 1 and "data.max_expansion_ratio=100" in str(rest[0])


# validation and configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["max_record_bytes", "max_branches_per_record", "max_expansion_ratio"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "big", True])
def test_limits_must_be_positive_integers(tmp_path, option, value):
    with pytest.raises(ValueError, match=rf"data.{option} must be a positive integer, got"):
        TreeDataModule(str(tmp_path / "x.jsonl"), **{option: value})
    with pytest.raises(ValueError, match=rf"data.{option} must be a positive integer"):
        StreamingTreeDataModule(make_data_source("files", paths=[str(_lines_file(tmp_path))]), **{option: value})
    with pytest.raises(ValueError, match=rf"data.{option} must be a positive integer"):
        RolloutDirDataModule(str(tmp_path / "r"), **{option: value})


@pytest.mark.parametrize("data", ["jsonl", "stream", "rollouts", "hf_dataset", "tau_bench", "synthetic_agentic",
                                  "synthetic_rollouts"])
def test_every_data_config_has_the_limits(data):
    from treelit.cli.config import compose

    cfg = compose([f"data={data}"])
    assert cfg.data.max_record_bytes == 64 * MiB
    assert cfg.data.max_branches_per_record == 65_536
    assert cfg.data.max_expansion_ratio == 100
    assert ReadLimits() == ReadLimits(cfg.data.max_record_bytes, cfg.data.max_branches_per_record,
                                      cfg.data.max_expansion_ratio)


# chat: deep nesting and a template that never ends -----------------------------------------------------


@pytest.fixture(scope="module")
def qwen_tok():
    from treelit.builders.chat import load_tokenizer
    from treelit.data.tokenizers import qwen_tokenizer_dir

    return load_tokenizer(qwen_tokenizer_dir())


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _nested(depth: int):
    x = 1
    for _ in range(depth):
        x = {"a": x}
    return x


def test_deeply_nested_messages_are_a_skippable_data_error(tmp_path, qwen_tok):
    deep = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"function": {"name": "f", "arguments": _nested(800)}}]}]}
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [CHAT, deep, CHAT]) + "\n")
    json.loads(p.read_text().splitlines()[1])  # parseable: the depth is below the parser's limit
    builder = make_tree_builder("chat", tokenizer=qwen_tok, group_key=None)
    with pytest.raises(DataError, match=rf"^{p}:2: messages: lists and objects nested more than 64 levels deep"):
        TreeDataModule(str(p), tree_builder=builder).setup()
    dm = TreeDataModule(str(p), tree_builder=builder, on_error="skip", shuffle=False)
    dm.setup()
    assert dm.read_stats.skipped == 1 and [t.source for t in dm.trees] == [f"{p}:1", f"{p}:3"]


def test_nesting_beyond_the_json_parser_is_a_data_error_too(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(line(GOOD) + b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n" + line(GOOD))
    dm = TreeDataModule(str(p), on_error="skip", shuffle=False)
    dm.setup()
    assert dm.read_stats.skipped == 1 and len(dm.trees) == 2
    assert dm.read_stats.errors[0].startswith(f"{p}:2: invalid JSON (nested too deeply")


HANG = ("{% if messages[0]['content'] == 'hang' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}")


def test_a_template_that_never_ends_is_stopped(tmp_path, qwen_tok):
    import copy

    tok = copy.copy(qwen_tok)
    tok.chat_template = HANG + qwen_tok.chat_template
    p = tmp_path / "d.jsonl"
    hang = {"messages": [{"role": "user", "content": "hang"}, {"role": "assistant", "content": "x"}]}
    p.write_text("\n".join(json.dumps(r) for r in [CHAT, hang, CHAT]) + "\n")
    before = signal.getsignal(signal.SIGALRM)
    builder = make_tree_builder("chat", tokenizer=tok, group_key=None, render_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(DataError, match=rf"^{p}:2: messages: rendering the chat template took longer than "
                                        r"tree_builder.render_timeout_s=0.5 s"):
        TreeDataModule(str(p), tree_builder=builder).setup()
    assert time.monotonic() - t0 < 15
    dm = TreeDataModule(str(p), tree_builder=builder, on_error="skip", shuffle=False)
    dm.setup()
    assert dm.read_stats.skipped == 1 and [t.source for t in dm.trees] == [f"{p}:1", f"{p}:3"]
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.parametrize("value", [0, -1, "x", float("inf")])
def test_render_timeout_is_validated(qwen_tok, value):
    with pytest.raises(ValueError, match="tree_builder.render_timeout_s must be a positive number"):
        make_tree_builder("chat", tokenizer=qwen_tok, render_timeout_s=value)


# MemoryError is not bad data -------------------------------------------------------------------------


def test_memory_error_while_parsing_is_not_a_data_error(tmp_path, monkeypatch):
    import treelit.data.records as records

    p = tmp_path / "d.jsonl"
    p.write_bytes(line(GOOD) * 3)

    def no_memory(raw, src):
        raise MemoryError("Unable to allocate 16 bytes")

    monkeypatch.setattr(records, "_parse", no_memory)
    dm = TreeDataModule(str(p), on_error="skip")
    with pytest.raises(ReadMemoryError) as info:
        dm.setup()  # not skipped
    msg = str(info.value)
    assert not isinstance(info.value, DataError) and isinstance(info.value, MemoryError)
    assert msg.startswith(f"out of memory while reading {p}:1 (this is not a data error")
    assert f"data.max_record_bytes={64 * MiB}, data.max_branches_per_record=65536" in msg
    assert "\n" not in msg and "flat list" not in msg
    from treelit.cli.console import user_error_message

    assert user_error_message(info.value) == msg  # printed as one `error:` line


@pytest.mark.parametrize("stream", [False, True])
def test_memory_error_while_building_names_the_record(tmp_path, monkeypatch, stream):
    import treelit.tree.token_tree as token_tree

    p = tmp_path / "d.jsonl"
    p.write_bytes(line(GOOD) * 3)
    real = token_tree._as_token_array
    calls = []

    def as_array(branch, b, source):  # the token ids of the second record's first branch
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("Unable to allocate 16 bytes for an array")
        return real(branch, b, source)

    monkeypatch.setattr(token_tree, "_as_token_array", as_array)
    with pytest.raises(ReadMemoryError, match=rf"^out of memory while reading {p}:2 "):
        if stream:
            _stream([p], on_error="skip").next_step()
        else:
            TreeDataModule(str(p), on_error="skip").setup()


def test_token_tree_does_not_call_memory_errors_bad_ids(monkeypatch):
    import treelit.tree.token_tree as token_tree

    def asarray(x, *a, **k):
        raise MemoryError("Unable to allocate 16 bytes")

    monkeypatch.setattr(token_tree.np, "asarray", asarray)
    with pytest.raises(MemoryError) as info:
        token_tree._as_token_array([1, 2], 0, "")
    assert not isinstance(info.value, ValueError)


# the gzip bomb through treelit-train, under an address-space cap --------------------------------------

AS_CAP = 6 << 30  # torch and its libraries reserve a few GiB of address space; the 4 GiB bomb does not fit too


def _train(tmp_path, name: str, data: Path) -> dict:
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="0",
               CUDA_VISIBLE_DEVICES="")  # a CUDA context alone reserves more address space than the cap
    env.pop("MLFLOW_TRACKING_URI", None)
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "treelit.cli.train", "data=stream", f"data.source.paths={data}", "logger=none",
             "model.config.num_layers=1", "model.config.embed_dim=32", "model.config.intermediate_dim=64",
             "callbacks.progress=null", "trainer.enable_progress_bar=false", f"output_dir={tmp_path / name}"],
            cwd=str(tmp_path), env=env, stdout=o, stderr=e, preexec_fn=cap)
    return {"proc": proc, "out": out, "err": err}


def _wait(run: dict, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while True:  # os.wait4 gives this child's own peak RSS (RUSAGE_CHILDREN mixes every child)
        pid, status, usage = os.wait4(run["proc"].pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            run["proc"].kill()
            pytest.fail("treelit-train did not finish")
        time.sleep(0.2)
    run["proc"].returncode = os.waitstatus_to_exitcode(status)
    return {"rc": run["proc"].returncode, "rss": usage.ru_maxrss * 1024, "stderr": run["err"].read_text(),
            "stdout": run["out"].read_text()}


def test_gzip_bomb_through_the_cli_under_ulimit(tmp_path):
    bomb = write_bomb(tmp_path / "bomb.jsonl.gz", 4 << 30)  # about 4 MB expanding to 4 GiB: one line of zeros
    assert bomb.stat().st_size < 8 * MiB
    small = tmp_path / "small.jsonl.gz"
    small.write_bytes(gzip.compress(b'{"x": 1}\n'))
    runs = {"bomb": _train(tmp_path, "bomb", bomb), "small": _train(tmp_path, "small", small)}  # side by side
    res = {k: _wait(v) for k, v in runs.items()}
    r = res["bomb"]
    assert r["rc"] == 1, r["stderr"][-3000:]
    errors = [ln for ln in r["stderr"].splitlines() if ln.startswith("error:")]
    assert errors == [f"error: {bomb}:1: the record is longer than data.max_record_bytes={64 * MiB} bytes "
                      "(raise data.max_record_bytes to read it)"], r["stderr"][-3000:]
    assert "Traceback" not in r["stderr"] + r["stdout"] and "MemoryError" not in r["stderr"]
    assert res["small"]["rc"] == 1 and "error: " in res["small"]["stderr"], res["small"]["stderr"][-3000:]
    # the same process failing on a tiny file: what reading the bomb added is about one record
    extra = r["rss"] - res["small"]["rss"]
    assert extra < 3 * 64 * MiB, f"peak RSS {r['rss'] >> 20} MiB vs {res['small']['rss'] >> 20} MiB"
