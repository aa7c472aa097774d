"""Streaming through ``treelit-train``: kill -9 mid-shard then resume equals the uninterrupted run
bit for bit; two processes (ddp_cpu) train exactly as one process with the same readers; a
streamed run trains as the in-memory path when both serve the trees in the same order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import treelit
from app_helpers import SMALL, STALL
from treelit.cli.config import compose
from treelit.cli.train import run

EXE = str(Path(sys.executable).with_name("treelit-train"))
BASE = [o for o in SMALL if not o.startswith("callbacks.checkpoint")]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(5)
    system = rng.integers(16, 500, 30).tolist()
    for f in range(4):
        with open(d / f"part-{f}.jsonl", "w") as fh:
            for i in range(40):
                task = rng.integers(16, 500, int(rng.integers(3, 9))).tolist()
                branches = [{"input_ids": system + task + rng.integers(16, 500, int(rng.integers(2, 12))).tolist()}
                            for _ in range(int(rng.integers(1, 4)))]
                fh.write(json.dumps({"id": f"{f}-{i}", "branches": branches}) + "\n")
    return d


def common(shards, *extra):
    return [*BASE, "data=stream", f"data.source.paths={shards}/*.jsonl", "data.shuffle_buffer=12",
            "data.micro_batch_tokens=300", "data.micro_batches_per_step=2", "optimizer=sgd", "optimizer.lr=0.3",
            "grad_clip=0", *extra]


def weights(out: Path):
    return treelit.load_hf_checkpoint(out / "hf_checkpoint").state_dict()


def one_thread(cfg):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(threads)


def test_kill_9_mid_shard_then_resume_is_bit_exact(tmp_path, shards):
    (tmp_path / "stall.py").write_text(STALL)
    marker = tmp_path / "stalled"
    args = common(shards, "trainer.max_steps=6", "callbacks.checkpoint.every_n_train_steps=1")
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    victim = subprocess.Popen([EXE, *args, f"output_dir={tmp_path / 'killed'}", "+callbacks.stall._target_=stall.Stall",
                               "+callbacks.stall.at_step=3", f"+callbacks.stall.marker={marker}"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    one_thread(compose([*args, f"output_dir={tmp_path / 'full'}"]))
    deadline = time.monotonic() + 300
    while not marker.exists():
        if victim.poll() is not None:
            pytest.fail(victim.stdout.read()[-3000:])
        assert time.monotonic() < deadline, "the run never reached step 4"
        time.sleep(0.2)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    ck = torch.load(last, map_location="cpu", weights_only=True)
    assert ck["global_step"] == 3
    (state,) = [v for k, v in ck.items() if k.endswith("StreamingTreeDataModule")]
    reader = state["readers"]["0"]["reader"]
    assert state["consumed_steps"] == 3 and reader["cursor"] is not None and reader["epoch"] == 0  # mid-shard
    assert reader["buffer"], "trees wait in the shuffle buffer at the cut"
    one_thread(compose([*args, f"output_dir={tmp_path / 'resumed'}", f"resume_from={last}"]))
    a, b = weights(tmp_path / "full"), weights(tmp_path / "resumed")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_processes_train_exactly_as_one_with_the_same_readers(tmp_path, shards):
    args = common(shards, "trainer.max_steps=3", "data.num_readers=2")
    r = subprocess.run([EXE, *args, "trainer=ddp_cpu", f"output_dir={tmp_path / 'ddp'}"], cwd=tmp_path,
                       env={**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    one_thread(compose([*args, f"output_dir={tmp_path / 'one'}"]))
    # two processes did run (Lightning's DDP banner is kept out of the console, in train.log)
    assert "MEMBER: 1/2" in (tmp_path / "ddp" / "train.log").read_text()
    m = json.loads((tmp_path / "ddp" / "summary.json").read_text())["metrics"]
    assert m["load_imbalance"] < 1.3, m  # nearly full micro-batches from each reader: balanced ranks
    a, b = weights(tmp_path / "one"), weights(tmp_path / "ddp")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_streamed_training_equals_in_memory_training_in_the_same_order(tmp_path, shards):
    """One file, no shuffling: the stream serves the trees in file order, as the in-memory path
    does, so the two runs take the same steps."""
    path = shards / "part-0.jsonl"
    opts = [*BASE, "data.shuffle=false", "data.micro_batch_tokens=300", "data.micro_batches_per_step=2",
            "optimizer=sgd", "optimizer.lr=0.3", "grad_clip=0", "trainer.max_steps=4"]
    one_thread(compose([*opts, "data=jsonl", f"data.train_path={path}", f"output_dir={tmp_path / 'mem'}"]))
    one_thread(compose([*opts, "data=stream", f"data.source.paths={path}", f"output_dir={tmp_path / 'stream'}"]))
    a, b = weights(tmp_path / "mem"), weights(tmp_path / "stream")
    for k in a:
        assert torch.equal(a[k], b[k]), k
