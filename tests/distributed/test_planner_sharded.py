"""The memory planner's arithmetic on an accelerator, per rank after sharding, without one:
``torch.cuda``'s memory statistics are simulated for one rank of 4 processes holding
parameters + gradients + AdamW state (16 bytes per float32 parameter) as FSDP2 (1 x 4:
a quarter per rank), HSDP 2 x 2 (``replicate_degree=2``: half per rank - the shard group
is world/R = 2 ranks, not 4) and DDP (4 x 1: all of it). The resident shards are allocated
before every step, a step allocates ``A`` bytes per token of its chain on top of them and
frees them into torch's cache. The planner must count the resident state once (out of the
memory available) and calibrate exactly ``A`` per token, so its budget is
``(capacity - resident) * fraction / (A * margin)`` for every layout, step after step.
(The shards' sizes under HSDP are measured on real processes in ``test_hsdp.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treelit.lightning.planner import MemoryPlanner

GiB = 2**30
PARAMS = 1_000_000_000  # a 1B-parameter model, float32 weights, gradients and two AdamW moments
STATE_BYTES = 16 * PARAMS
CAPACITY = 80 * GiB
PER_TOKEN = 2 * 2**20  # what a step allocates per token along its chain of partitions


def resident_per_rank(world: int, replicas: int) -> int:
    """Parameters + gradients + optimizer state one rank holds: sharded over world/replicas ranks."""
    return STATE_BYTES // (world // replicas)


class FakeDevice:
    """One rank's device as torch's caching allocator reports it."""

    def __init__(self, resident: int, fraction: float = 1.0) -> None:
        self.allocated = self.reserved = self.peak = resident
        self.fraction = fraction  # torch.cuda.set_per_process_memory_fraction

    def step(self, tokens: int) -> None:
        self.peak = max(self.peak, self.allocated + PER_TOKEN * tokens)
        self.reserved = max(self.reserved, self.peak)  # freed into the cache, not to the device

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda dev=None: (CAPACITY - self.reserved, CAPACITY))
        monkeypatch.setattr(cuda, "memory_allocated", lambda dev=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda dev=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda dev=None: self.peak)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda dev=None: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda dev=None: self.fraction)


class OneRank:
    """What the planner reads from the module (one process: the min over ranks is its own)."""

    device = torch.device("cuda", 0)
    budget_tokens = None
    last_partition_stats = None

    def _comm(self):
        return SimpleNamespace(rank=0, min=lambda v: v, max=lambda v: v)

    def log_dict(self, metrics) -> None:
        self.logged = metrics


def plan_steps(monkeypatch, resident: int, steps: int = 4, fraction: float = 1.0):
    dev = FakeDevice(resident, fraction)
    dev.install(monkeypatch)
    planner = MemoryPlanner(fraction=0.9, margin=1.1, initial_bytes_per_token=64 * 2**20)
    module = OneRank()
    batch = SimpleNamespace(micro_batches=[SimpleNamespace(position_ids=torch.arange(100))])
    budgets = []
    for step in range(steps):
        planner.on_train_batch_start(None, module, batch, step)
        budgets.append(module.budget_tokens)
        dev.step(module.budget_tokens)  # the plan fills its budget
        module.last_partition_stats = SimpleNamespace(max_chain_tokens=module.budget_tokens)
        planner.on_train_batch_end(SimpleNamespace(global_step=step + 1), module, None, batch, step)
    return budgets, planner


@pytest.mark.parametrize("world,replicas", [(4, 1), (4, 2), (4, 4)], ids=["fsdp2-1x4", "hsdp-2x2", "ddp-4x1"])
def test_the_budget_is_the_memory_left_by_this_ranks_shards(monkeypatch, world, replicas):
    resident = resident_per_rank(world, replicas)
    assert resident == {1: 4, 2: 8, 4: 16}[replicas] * PARAMS  # GB: a quarter, half, all of 16 bytes per parameter
    budgets, planner = plan_steps(monkeypatch, resident)
    assert planner.bytes_per_token == PER_TOKEN, "the resident shards counted again per token"
    expected = int((CAPACITY - resident) * 0.9 / (PER_TOKEN * 1.1))
    assert budgets[1:] == [expected] * 3, budgets  # step 1 plans with the initial guess, then with the measurement
    assert planner.history[-1]["peak"] == PER_TOKEN * expected  # the step's own peak, above the resident state


def test_hsdp_budget_between_fsdp2_and_ddp(monkeypatch):
    """Per-rank memory after sharding: HSDP 2 x 2 leaves this rank less than FSDP2 over 4 (its
    shards are twice as large) and more than DDP, by exactly the state's difference."""
    budget = {r: plan_steps(monkeypatch, resident_per_rank(4, r))[0][-1] for r in (1, 2, 4)}
    assert budget[1] > budget[2] > budget[4]
    per_token = PER_TOKEN * 1.1 / 0.9
    assert budget[1] - budget[2] == pytest.approx(4 * PARAMS / per_token, abs=1)  # 16 B / 4 vs 16 B / 2 per parameter
    assert budget[2] - budget[4] == pytest.approx(8 * PARAMS / per_token, abs=1)


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_a_per_process_memory_fraction_caps_the_budget(monkeypatch, fraction):
    """``torch.cuda.set_per_process_memory_fraction``: the allocator stops at fraction x capacity,
    while the device's free memory does not show it; the plan fills what the cap leaves above
    the resident state."""
    resident = resident_per_rank(4, 1)
    budgets, planner = plan_steps(monkeypatch, resident, fraction=fraction)
    assert planner.bytes_per_token == PER_TOKEN
    expected = int((fraction * CAPACITY - resident) * 0.9 / (PER_TOKEN * 1.1))
    assert budgets[1:] == [expected] * 3, budgets
    uncapped = plan_steps(monkeypatch, resident)[0][-1]
    assert expected < uncapped
