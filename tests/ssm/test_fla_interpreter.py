"""fla's real Triton kernels (``chunk_gated_delta_rule``, ``chunk_kda``) under Triton's interpreter on CPU,
through treelit's ``ssm=fla`` routing (level by level, per-segment initial states, partition boundary
states), against the exact ``ssm=torch`` scans: loss and every parameter gradient to 1e-5 (float32,
IEEE dots), unpartitioned and partitioned. Each case runs in a process of its own
(``tests/ssm/fla_interpreter_check.py``; the shims are in ``tests/triton_interpreter.py``). A routing
defect (a segment started from zero instead of its parent's state) must fail the comparison.

mamba-ssm's ``mamba_chunk_scan_combined`` is not covered here: its sdist builds without CUDA only with
build isolation off, which a project's test extra cannot ask of pip (see the issue notes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("fla_interpreter_check.py")


def run(case: str, *flags: str):
    res = subprocess.run([sys.executable, str(SCRIPT), case, *flags], capture_output=True, text=True, timeout=900,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["budget"] for r in rows] == [None, 12]
    return rows


@pytest.mark.parametrize("case", ["gdn_tiny", pytest.param("qwen3_5", marks=pytest.mark.slow),
                                  pytest.param("kimi_linear", marks=pytest.mark.slow)])
def test_fla_kernels_through_the_routing_equal_the_torch_scans(case):
    for row in run(case):
        assert row["min_grad_norm"] > 0
        assert row["loss_rel_diff"] <= 1e-5 and row["max_rel_grad_diff"] <= 1e-5, row


def test_a_segment_started_from_zero_instead_of_its_parent_fails_the_comparison():
    rows = run("gdn_tiny", "--mutate")
    assert all(row["max_rel_grad_diff"] > 1e-2 for row in rows), rows
