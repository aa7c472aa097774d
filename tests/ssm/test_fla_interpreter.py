"""fla's real Triton kernels (``chunk_gated_delta_rule``, ``chunk_kda``) under Triton's interpreter on CPU,
through treelit's ``ssm=fla`` routing (level by level, per-segment initial states, partition boundary
states), against the exact ``ssm=torch`` scans: loss and every parameter gradient to 1e-5 (float32,
IEEE dots), unpartitioned and partitioned. Each case runs in a process of its own
(``tests/ssm/fla_interpreter_check.py``; the shims are in ``tests/triton_interpreter.py``). A routing
defect (a segment started from zero instead of its parent's state) must fail the comparison.

mamba-ssm's ``mamba_chunk_scan_combined`` runs for Nemotron-H (slow): its sdist builds without CUDA only
with ``MAMBA_SKIP_CUDA_BUILD`` and build isolation off, which a package's extras cannot ask of pip, so
the test session builds it into a folder of its own (the environment is left as it is) unless the
environment has it already. A padded mamba-ssm row whose dt is left non-zero must fail the comparison.

    python -m pytest -q -m slow tests/ssm/test_fla_interpreter.py   # every case (about 3 min)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("fla_interpreter_check.py")


MAMBA_SSM = "mamba-ssm==2.3.2.post1"
_PROBE = ("import sys, types; sys.modules['selective_scan_cuda'] = types.ModuleType('selective_scan_cuda'); "
          "import mamba_ssm.ops.triton.ssd_combined")


@pytest.fixture(scope="session")
def mamba_path(tmp_path_factory) -> str:
    """A folder to put on PYTHONPATH for mamba-ssm built without CUDA ("" when the environment has it)."""
    if subprocess.run([sys.executable, "-c", _PROBE], capture_output=True).returncode == 0:
        return ""
    target = tmp_path_factory.mktemp("mamba_ssm")
    env = {**os.environ, "MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE"}
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                          "--target", str(target), MAMBA_SSM], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"building {MAMBA_SSM} without CUDA failed:\n{res.stderr[-3000:]}"
    return str(target)


def run(case: str, *flags: str, path: str = ""):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    res = subprocess.run([sys.executable, str(SCRIPT), case, *flags], capture_output=True, text=True, timeout=900,
                         env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["budget"] for r in rows] == [None, 12]
    return rows


@pytest.mark.parametrize("case", ["gdn_tiny", "mamba2_tiny", pytest.param("qwen3_5", marks=pytest.mark.slow),
                                  pytest.param("kimi_linear", marks=pytest.mark.slow)])
def test_fla_kernels_through_the_routing_equal_the_torch_scans(case):
    _check(run(case))


def _check(rows):
    for row in rows:
        assert row["min_grad_norm"] > 0
        assert row["loss_rel_diff"] <= 1e-5 and row["max_rel_grad_diff"] <= 1e-5, row


@pytest.mark.slow
def test_mamba_ssm_kernel_through_the_routing_equals_the_torch_scan(mamba_path):
    _check(run("nemotron_h", path=mamba_path))


def test_a_segment_started_from_zero_instead_of_its_parent_fails_the_comparison():
    rows = run("gdn_tiny", "--mutate")
    assert all(row["max_rel_grad_diff"] > 1e-2 for row in rows), rows


@pytest.mark.slow
def test_a_padded_mamba_row_with_dt_left_non_zero_fails_the_comparison(mamba_path):
    rows = run("nemotron_h", "--mutate-padding", path=mamba_path)  # (the unpartitioned run has a padded row)
    assert max(row["max_rel_grad_diff"] for row in rows) > 1e-2, rows


def run_cp(case: str, *flags: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(SCRIPT), case, "--cp", "2", *flags], capture_output=True, text=True,
                         timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gdn_tiny", "mamba2_tiny", "qwen3_5", "kimi_linear"])
def test_fla_kernels_under_context_parallelism_equal_the_torch_scans(case):
    """``ssm=fla`` with the row split over 2 gloo processes (the second rank's segments start from
    the states the first sends: several initial states in one call) against ``ssm=torch`` on one;
    native layers, and Qwen3.5 (Gated DeltaNet) and Kimi-Linear (KDA) through the adapter."""
    rows = run_cp(case)
    assert len(rows) == 1
    _check(rows)


@pytest.mark.slow
def test_a_dropped_state_under_context_parallelism_fails_the_comparison():
    rows = run_cp("gdn_tiny", "--mutate")
    assert rows[0]["max_rel_grad_diff"] > 1e-2, rows
