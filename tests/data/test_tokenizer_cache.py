"""The tokenizer cache (``treelit.data.tokenizers.qwen_tokenizer_dir``) shared by processes
that build it at the same moment - the ranks of a run, nodes on one shared filesystem:
three processes (as if on different nodes: the same host name and pid) race to build one
cache entry while a fourth reads it in a loop. Every builder gets the same directory, the
reader never sees a partial file, and no temporary directory is left behind.

The builder is replaced by one that writes the same files slowly (so the builds overlap
for certain and take no time); the real one races in the slow test."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path
from typing import Dict

import pytest

from treelit.data.tokenizers import CACHE_NAME

FILES: Dict[str, bytes] = {"tokenizer.json": bytes(range(256)) * 4096, "tokenizer_config.json": b'{"a": 1}' * 64}
CHUNKS = 16


def slow_build(out_dir, chat_template=None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in FILES.items():
        step = -(-len(data) // CHUNKS)
        with open(out / name, "wb") as f:
            for i in range(0, len(data), step):
                f.write(data[i : i + step])
                f.flush()
                time.sleep(0.02)
    return out


def builder(root: str, start, result: str, fake: bool, delay: float) -> None:
    import treelit.data.tokenizers as tk

    if fake:
        tk.build_qwen_tokenizer = slow_build
    real_pid, real_host = os.getpid, socket.gethostname
    os.getpid, socket.gethostname = (lambda: 4242), (lambda: "node")  # every builder looks like the same process
    start.wait()
    time.sleep(delay)  # nodes do not start in step: one is still writing when another has finished
    try:
        path = tk.qwen_tokenizer_dir(root)
    except BaseException as exc:
        path = f"error: {type(exc).__name__}: {exc}"
    finally:
        os.getpid, socket.gethostname = real_pid, real_host
    Path(result).write_text(path)


def reader(root: str, start, done, result: str) -> None:
    """Reads every file of the entry whenever it is there; writes the distinct contents seen."""
    out = Path(root) / CACHE_NAME
    seen: Dict[str, set] = {}
    reads = 0
    start.wait()
    while not done.is_set():
        if (out / "tokenizer.json").is_file():
            for f in out.iterdir():
                seen.setdefault(f.name, set()).add(hashlib.sha256(f.read_bytes()).hexdigest())
            reads += 1
        time.sleep(0.005)
    Path(result).write_text(json.dumps({"reads": reads, "seen": {k: sorted(v) for k, v in seen.items()}}))


def race(root: Path, n: int, fake: bool, deadline: float):
    ctx = mp.get_context("spawn")
    start, done = ctx.Barrier(n + 1), ctx.Event()
    builders = [ctx.Process(target=builder, args=(str(root), start, str(root.parent / f"b{i}.txt"), fake, 0.2 * i))
                for i in range(n)]
    read = ctx.Process(target=reader, args=(str(root), start, done, str(root.parent / "reader.txt")))
    procs = [*builders, read]
    for p in procs:
        p.start()
    try:
        for p in builders:
            p.join(max(1.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"a builder did not finish (exit {p.exitcode})"
        time.sleep(0.1)
        done.set()
        read.join(30)
        assert read.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    paths = [(root.parent / f"b{i}.txt").read_text() for i in range(n)]
    report = json.loads((root.parent / "reader.txt").read_text())
    final = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in (root / CACHE_NAME).iterdir()}
    partial = [name for name, digests in report["seen"].items() if digests != [final.get(name)]]
    return paths, report["reads"], partial


def test_processes_racing_on_one_cache_dir_share_one_complete_entry(tmp_path):
    root = tmp_path / "cache"
    paths, seen, partial = race(root, 3, fake=True, deadline=time.monotonic() + 120)
    entry = root / CACHE_NAME
    assert paths == [str(entry)] * 3, paths
    assert seen > 0, "the reader never saw the entry"
    assert partial == [], f"the reader saw these files other than whole: {partial}"
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == FILES
    assert [p.name for p in root.iterdir()] == [CACHE_NAME], "temporary directories left behind"
    oct_mode = entry.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert oct_mode == 0o777 & ~umask, oct(oct_mode)  # readable as any directory the user makes


def test_an_entry_there_is_used_and_a_foreign_one_is_named(tmp_path, monkeypatch):
    import treelit.data.tokenizers as tk

    built = []
    monkeypatch.setattr(tk, "build_qwen_tokenizer", lambda out, *a: built.append(out) or slow_build(out))
    root = tmp_path / "cache"
    first = tk.qwen_tokenizer_dir(root)
    assert tk.qwen_tokenizer_dir(root) == first and len(built) == 1  # built once, then read
    other = tmp_path / "other"
    (other / CACHE_NAME).mkdir(parents=True)
    (other / CACHE_NAME / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(OSError, match=r"qwen2-chatml-tokenizer-[0-9a-f]{12} exists but has no tokenizer.json.*remove it"):
        tk.qwen_tokenizer_dir(other)
    assert [p.name for p in other.iterdir()] == [CACHE_NAME]
    (other / CACHE_NAME / "notes.txt").unlink()  # an empty directory is taken over
    assert tk.qwen_tokenizer_dir(other) == str(other / CACHE_NAME)


@pytest.mark.slow  # two real builds of the Qwen tokenizer at once (about 40 s on 2 busy cores)
def test_two_processes_building_the_real_tokenizer_at_once(tmp_path):
    from transformers import AutoTokenizer

    root = tmp_path / "cache"
    paths, _, partial = race(root, 2, fake=False, deadline=time.monotonic() + 300)
    assert paths == [str(root / CACHE_NAME)] * 2 and partial == [], (paths, partial)
    tok = AutoTokenizer.from_pretrained(paths[0])
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert [p.name for p in root.iterdir()] == [CACHE_NAME]


def test_the_entry_names_its_recipe_and_old_builds_are_removed(tmp_path, monkeypatch):
    """The entry's name carries a digest of what it is built from (a changed chat template
    gets a new entry, not a stale one), and a build directory a killed process left more
    than a day ago is removed by the next build."""
    import treelit.data.tokenizers as tk

    assert CACHE_NAME.startswith("qwen2-chatml-tokenizer-") and len(CACHE_NAME.rsplit("-", 1)[1]) == 12
    monkeypatch.setattr(tk, "CHATML_TEMPLATE", tk.CHATML_TEMPLATE + " ")
    assert tk._recipe() != CACHE_NAME.rsplit("-", 1)[1]
    monkeypatch.undo()
    monkeypatch.setattr(tk, "build_qwen_tokenizer", slow_build)
    old, fresh = tmp_path / f".{CACHE_NAME}-host-1-aaaa", tmp_path / f".{CACHE_NAME}-host-2-bbbb"
    for d in (old, fresh):
        d.mkdir()
        (d / "tokenizer.json").write_bytes(b"partial")
    os.utime(old, (time.time() - 2 * tk.STALE_BUILD_S,) * 2)
    assert tk.qwen_tokenizer_dir(tmp_path) == str(tmp_path / CACHE_NAME)
    assert not old.exists() and fresh.exists()  # a recent one may be a live build: kept
