"""A KL penalty to a frozen copy of the initial model (``objective.reference=initial``) under
FSDP2, with a rank that runs a padding micro-batch (no targets: it has fewer micro-batches than
another rank). The copy is sharded like the policy, so each of its forwards all-gathers: the
padding pass runs it too (``ReferenceModel.pad_loss``), else the ranks' collectives differ. Held
against one unpartitioned process in float64, <= 1e-9 (the loss and every gradient). Likewise
``objective.reference=base`` with LoRA: the reference is a second forward of the sharded policy
itself, its adapters off."""

from __future__ import annotations

import pytest
import torch

from composition_cases import cell_step, cell_steps
from harness import launch
from helpers import grad_floor, max_rel_grad_diff, negligible_grad

TOL = 1e-9

pytest.importorskip("torch.distributed.fsdp")

STRATEGIES = ["fsdp2", "fsdp2_partitioned"]


def _padded_runs_equal_one_process(features) -> None:
    """``features`` on each of STRATEGIES (two ranks, small micro-batches: the ranks pack their
    trees into different numbers of them, so one runs a padding micro-batch) against one process."""
    specs = [{"features": features, "strategy": s, "micro_tokens": 30} for s in STRATEGIES]
    results = launch(cell_steps, 2, specs, deadline=600)
    want = cell_step(0, 1, {"features": features, "strategy": "one_process", "reference": "one_process",
                            "micro_tokens": 30})
    for s, got in zip(STRATEGIES, results):
        assert "error" not in got, f"{s}:\n{got['error']}"
        assert got["padding"] > 0, f"{s}: no rank ran a padding micro-batch"
        assert abs(got["loss"] - want["loss"]) <= TOL * abs(want["loss"]), (s, got["loss"], want["loss"])
        err = max_rel_grad_diff(got["grads"], want["grads"], grad_floor(torch.float64), negligible_grad(torch.float64))
        assert err <= TOL, f"{s}: gradient differs from one process by {err:.2e}"


def test_fsdp2_reference_kl_with_a_padding_micro_batch_equals_one_process():
    _padded_runs_equal_one_process(["reference_kl"])


def test_fsdp2_lora_base_reference_kl_with_a_padding_micro_batch_equals_one_process():
    """``objective.reference=base`` (LoRA): the reference is the sharded policy with its adapters
    off, a second forward of it per micro-batch; a padding micro-batch runs it too, else the rank
    with the padding micro-batch all-gathers the policy's parameters fewer times than the other."""
    _padded_runs_equal_one_process(sorted({"lora", "reference_base_kl"}))
