"""Run a function on several CPU processes (gloo) with a deadline, and collect rank 0's result.

``launch(fn, world, *args)`` spawns ``world`` processes running ``fn(rank, world, *args)``
inside an initialised gloo process group whose collectives time out after
``collective_timeout`` seconds; the whole launch is killed after ``deadline`` seconds, so
a test never hangs. ``fn`` returns a picklable value on rank 0 (other ranks' returns are
ignored); an exception on any rank fails the launch with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str, collective_timeout: float):
    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout))
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            torch.save({"ok": True, "result": result}, out)
        # every rank finishes before any tears its process group down: in one CI run a rank
        # that returns early (test_publish_fsdp's rank 1) aborted in C++ ("terminate called
        # without an active exception", SIGABRT) while rank 0 was still working
        dist.barrier()
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, f"{out}.rank{rank}")
        raise
    finally:
        dist.destroy_process_group()
    end_rank()


def end_rank() -> None:
    """End a spawned rank's process that finished its work (results saved, process group
    destroyed) without the interpreter's teardown: gloo's objects destroyed there now and then
    abort the process ("terminate called without an active exception", SIGABRT) after every
    rank has destroyed its group, which fails a test whose work was done. Call it after the
    worker's ``try``/``finally``, so that a rank that raised still reports its error."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable, world: int, *args: Any, deadline: float = 300, collective_timeout: float = 60) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        ctx = mp.start_processes(_worker, args=(world, _free_port(), fn, args, out, collective_timeout),
                                 nprocs=world, join=False, start_method="spawn")
        end = time.monotonic() + deadline
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > end:
                    raise TimeoutError(f"{world} processes still running after {deadline}s")
        except mp.ProcessRaisedException as exc:
            errors = [torch.load(os.path.join(tmp, f), weights_only=False)["error"]
                      for f in sorted(os.listdir(tmp)) if ".rank" in f]
            raise AssertionError("a rank failed:\n" + "\n".join(errors or [str(exc)])) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        res = torch.load(out, weights_only=False)
    if not res["ok"]:
        raise AssertionError(res["error"])
    return res["result"]
