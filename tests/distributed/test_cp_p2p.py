"""Context parallelism's sends left in flight (:mod:`treelit.partition.p2p`): a hybrid model
(Gated DeltaNet, attention, Mamba2) over three gloo processes equals one process (float64, loss
and every parameter gradient, 1e-9), with the sends waited on at the end of each pass; and the
lock-step hand-off (``p2p.BLOCKING``, every send waited on where it is posted) gives bitwise the
same loss and gradients. At C = 3 the middle rank both receives (from rank 0) and sends (to rank
2) in every exchange, so receives are waited on while its own sends are still in flight."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_context_parallel import ONE_TOKEN, _batch, _difference, _model, _objective, _port, one_process_result
from treelit.partition import p2p
from treelit.partition.context_parallel import cp_micro_batch
from treelit.partition.engine import run_micro_batch
from harness import end_rank  # noqa: E402


def _step(model, batch, obj, partitioned: bool) -> float:
    Z = obj.norm_contribution(batch, "token-mean")
    model.zero_grad(set_to_none=True)
    if partitioned:
        return run_micro_batch(model, obj, batch, aggregation="token-mean", normalizer=Z, budget_tokens=3,
                               attention="sdpa_dense", cp_group=dist.group.WORLD).loss
    return cp_micro_batch(model, obj, batch, None, aggregation="token-mean", normalizer=Z, attention="sdpa_dense")[0]


def _worker(rank, C, port, case, partitioned, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=C)
    try:
        name, forest, objective, window, *ckpt = case
        model = _model(name, window, *ckpt)
        batch = _batch(forest, objective)
        obj = _objective(objective)
        got = {}
        for blocking in (False, True):  # sends in flight (the default), then the lock-step hand-off
            p2p.BLOCKING = blocking
            deferred = p2p.SENDS.deferred
            value = _step(model, batch, obj, partitioned)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            left = torch.tensor([float(p2p.SENDS.deferred - deferred), float(len(p2p.SENDS))])
            for g in grads:
                dist.all_reduce(g)
            dist.all_reduce(left)
            got[blocking] = {"value": value, "grads": [g.clone() for g in grads], "deferred": left[0].item(),
                             "in_flight": left[1].item()}
        p2p.BLOCKING = False
        if rank == 0:
            torch.save(got, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_rank()


def _compare(case, C, partitioned, tmp_path):
    out = tmp_path / "p2p.pt"
    mp.spawn(_worker, args=(C, _port(), case, partitioned, str(out)), nprocs=C, join=True)
    got = torch.load(out, weights_only=True)
    res, grads = one_process_result(case)
    assert any(g.abs().max() > 0 for g in grads), "the case must train something"
    new, old = got[False], got[True]
    assert new["deferred"] > 0 and old["deferred"] == 0, (new["deferred"], old["deferred"])
    assert new["in_flight"] == old["in_flight"] == 0, "every send waited on by the end of the step"
    loss_err, err = _difference(new, res.loss, grads)
    assert loss_err <= 1e-9, (new["value"], res.loss)
    assert err <= 1e-9, f"max relative gradient difference {err:.2e}"
    assert old["value"] == new["value"]
    assert all(torch.equal(a, b) for a, b in zip(old["grads"], new["grads"])), "the two hand-offs differ"


def test_hybrid_sends_in_flight_equal_one_process_and_lock_step(tmp_path):
    _compare(("hybrid_tiny", ONE_TOKEN, "sft", False), 3, False, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case,C,partitioned", [
    (("hybrid_tiny", ONE_TOKEN, "sft", False, True), 3, False),   # each layer recomputed (and re-sent) in the backward
    (("hybrid_tiny", ONE_TOKEN, "grpo", False), 4, False),
    (("hybrid_tiny", ONE_TOKEN, "sft", False), 3, True),          # partitioned passes, each split over the ranks
], ids=["checkpointing", "grpo-c4", "partitioned"])
def test_hybrid_sends_in_flight_more(case, C, partitioned, tmp_path):
    _compare(case, C, partitioned, tmp_path)
