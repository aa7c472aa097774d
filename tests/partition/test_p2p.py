"""The sends context parallelism leaves in flight (:mod:`treelit.partition.p2p`): each waited on
exactly once, at a pass's end, at the end of the backward run that posted it, and on an error
path (a bounded wait whose failure does not hide the pass's own error). Stand-in work handles:
the exchanges themselves run in tests/distributed/test_cp_p2p.py."""

from __future__ import annotations

import pytest
import torch

from treelit.partition import context_parallel, p2p


class _Work:
    def __init__(self, fails: bool = False, done: bool = True):
        self.waits, self.timeouts, self.fails, self.done = 0, [], fails, done

    def wait(self, timeout=None):
        self.waits += 1
        self.timeouts.append(timeout)
        if self.fails:
            raise RuntimeError("peer gone")
        return self.done


@pytest.fixture
def in_flight():
    saved = list(p2p.SENDS.works), list(p2p._LOST)
    p2p.SENDS.works.clear()
    yield p2p.SENDS.works
    p2p.SENDS.works[:] = saved[0]
    p2p._LOST[:] = saved[1]


def test_drain_waits_each_send_once(in_flight):
    works = [_Work() for _ in range(3)]
    in_flight.extend((w, torch.zeros(2)) for w in works)
    p2p.drain()
    p2p.drain()
    assert [w.waits for w in works] == [1, 1, 1] and not in_flight
    assert p2p.WAITS.take().get("drain", -1.0) >= 0.0


def test_a_failing_pass_abandons_its_sends_and_raises_its_own_error(in_flight):
    ok, failing, stuck = _Work(), _Work(fails=True), _Work(done=False)

    def forward():
        in_flight.extend([(ok, torch.zeros(1)), (failing, torch.zeros(1)), (stuck, torch.zeros(1))])
        raise ValueError("the pass's own error")

    with pytest.raises(ValueError, match="own error"):
        context_parallel._drained(forward)
    assert [w.waits for w in (ok, failing, stuck)] == [1, 1, 1] and not in_flight
    assert all(w.timeouts == [p2p.ABANDON_TIMEOUT] for w in (ok, failing, stuck))
    # the sends that did not complete keep their buffers (no transfer reads freed memory)
    assert [w for w, _ in p2p._LOST[-2:]] == [failing, stuck]


def test_a_backward_drains_the_sends_it_leaves_in_flight(in_flight):
    """An exchange inside a backward run queues the drain for that run's end, once."""
    works, calls = [_Work(), _Work()], []

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            in_flight.append((works[len(calls)], g))
            calls.append(1)
            p2p.post([], "states")  # (what an exchange calls after posting its sends)
            assert works[0].waits == 0  # not before the run's end
            return g

    x = torch.ones(2, requires_grad=True)
    Exchange.apply(Exchange.apply(x)).sum().backward()
    assert [w.waits for w in works] == [1, 1] and not in_flight and p2p.SENDS.task == -1
