"""Context parallelism's point-to-point messages: receives waited for, sends left in flight.

Under context parallelism (:mod:`treelit.partition.context_parallel`) the ranks exchange, per
layer, path rows (attention K/V, a recurrent layer's convolution inputs) and a recurrent
layer's states, and in the backward their gradients. A rank needs what it receives before it
can go on; it never needs a send to have completed. With gloo, though, a send completes only
once the receiving rank has posted the matching receive: waiting for every send where it is
posted ties a rank to the ranks it sends to. Rank r, having sent layer l's states to rank
r + 1, would wait until r + 1 reaches layer l's scan, so the ranks would run the layers in
lock-step and each layer's scans one rank after another (and the backward likewise, the other
way round).

So a send is posted and left in flight: its work and its buffer (which must live until it
completes) are kept in :data:`SENDS` and waited on at the end of the pass: after a forward
pass (:func:`drain`, called by its caller) and at the end of the backward run that posted
them (an autograd final callback, queued by the first exchange of that backward). Every
handle is waited on exactly once (it leaves the list as it is waited on); on an error path
each is waited on once with a bounded timeout and its errors are dropped
(:func:`abandon`), so the error that ended the pass is the one raised. A rank still waits
for every receive where it is posted. What remains is the pipeline itself: rank r + 1 starts
a layer's scan once rank r has finished its own and sent the states.

The dependencies stay one-way (the forward receives from earlier ranks only, the backward
from later ranks only), and a rank that sends does not wait, so no rank waits on one that
waits on it. Message tags repeat from pass to pass (each pass numbers its exchanges from the
same start); every send of a pass is waited on before the next pass posts any (the drain at
each pass's start and end, and at each backward's end), so a message can only match the
receive of its own pass.

:data:`BLOCKING` true waits for every send where it is posted (the lock-step hand-off), for
comparison (``benchmarks/bench_cp_recurrent.py``); the gradients are the same either way.
:data:`WAITS` adds up the seconds spent waiting, by kind, for that benchmark.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

__all__ = ["BLOCKING", "SENDS", "WAITS", "abandon", "drain", "post"]

BLOCKING = False
"""True: every send is waited on where it is posted (the ranks then run each exchange in lock-step)."""

ABANDON_TIMEOUT = timedelta(seconds=30)  # the wait for each send still in flight when a pass fails


class Waits:
    """Seconds this process spent waiting in point-to-point exchanges since the last :meth:`take`,
    by kind: ``rows`` (path rows and their gradients), ``states`` (recurrent states and their
    gradients), each the waits where the messages are posted (receives; sends too when
    :data:`BLOCKING`), and ``drain`` (sends still in flight at the end of a pass)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def take(self) -> Dict[str, float]:
        got, self.seconds = self.seconds, {}
        return got


WAITS = Waits()


class _InFlight:
    """Sends posted and not yet waited on, with their buffers."""

    def __init__(self) -> None:
        self.works: List[Tuple[Any, torch.Tensor]] = []
        self.task = -1  # the backward run whose end drains them (its graph task id; -1: none queued)
        self.deferred = 0  # sends left in flight so far (a count for tests)

    def __len__(self) -> int:
        return len(self.works)


SENDS = _InFlight()
_LOST: List[Tuple[Any, torch.Tensor]] = []  # sends abandoned before they completed (their buffers kept)


def post(ops: List[dist.P2POp], kind: str) -> None:
    """Post ``ops`` (sends and receives), wait for the receives, and keep the sends in flight
    (unless :data:`BLOCKING`); inside a backward run, queue the drain for its end."""
    if ops:
        works = dist.batch_isend_irecv(ops)
        t0 = time.perf_counter()
        for op, work in zip(ops, works):
            if BLOCKING or op.op is not dist.isend:
                work.wait()
            else:
                SENDS.works.append((work, op.tensor))
                SENDS.deferred += 1
        WAITS.add(kind, time.perf_counter() - t0)
    task = torch._C._current_graph_task_id()
    if SENDS.works and task != -1 and SENDS.task != task:
        SENDS.task = task
        torch.autograd.Variable._execution_engine.queue_callback(drain)


def drain() -> None:
    """Wait for every send in flight, each once."""
    SENDS.task = -1
    if not SENDS.works:
        return
    t0 = time.perf_counter()
    while SENDS.works:
        work, _ = SENDS.works.pop(0)
        work.wait()
    WAITS.add("drain", time.perf_counter() - t0)


def abandon() -> None:
    """On an error path: wait for every send in flight once, at most :data:`ABANDON_TIMEOUT`
    each, dropping their errors (the receiver may be gone). A send that did not complete keeps
    its buffer referenced (in ``_LOST``) so that no transfer reads freed memory."""
    SENDS.task = -1
    while SENDS.works:
        work, buf = SENDS.works.pop(0)
        try:
            done = work.wait(ABANDON_TIMEOUT)
        except Exception:  # noqa: BLE001 - the pass's own error is the one to raise
            done = False
        if not done:
            _LOST.append((work, buf))
