"""Shared fixtures (helpers live in helpers.py) and the hypothesis profiles.

``ci`` (the default) is derandomized and keeps no example database, so every run draws
the same examples; each test item is seeded from its id, so the combinations of a
parametrized property test (family x backend x dtype x aggregation) draw different
forests. ``--hypothesis-profile=thorough`` draws ten times as many, randomly, for long
local runs. Tests size their example counts with ``strategies.examples(n)``.
"""

from __future__ import annotations

import logging
import os
import sys
import zlib

import pytest
from hypothesis import HealthCheck, seed, settings

sys.path.insert(0, os.path.dirname(__file__))

# The CUDA tests compare fla's / mamba-ssm's float32 kernels with IEEE torch: Triton's tl.dot defaults
# to TF32 on NVIDIA (~1e-3 off), so float32 dots are IEEE here, set before anything imports Triton; and
# fla's optional FlashQLA / FlashKDA backends stay off (ssm=fla is tested on fla's own Triton kernels).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_FLASH_KDA", "0")

from helpers import EXAMPLES, FAMILIES  # noqa: E402

if os.environ.get("TREELIT_TEST_AUTOTUNE") == "first":  # the CUDA tests in minutes: see fast_autotune.py
    from fast_autotune import install as _first_config_only

    _first_config_only()

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile("ci")


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    fn = getattr(item, "obj", None)
    if settings.default.derandomize and getattr(fn, "is_hypothesis_test", False):
        seed(zlib.crc32(item.nodeid.encode()))(fn)


def pytest_terminal_summary(terminalreporter):
    n = EXAMPLES["compared"]
    if n:
        terminalreporter.write_line(
            f"equivalence checks: {n} compared, {EXAMPLES['vacuous']} vacuous (asserted 0), "
            f"{EXAMPLES['vacuous_allowed']} zero on both sides where allowed "
            f"(require_grad=False: clipped RL objectives, the untrained-tree case)"
        )


@pytest.fixture
def cli_main(monkeypatch):
    """Run ``treelit-train ARGS`` in this process: returns the exit status (0 when it returns).
    Hydra's logging setup and global state are undone afterwards."""
    from hydra.core.global_hydra import GlobalHydra

    from treelit.cli import train

    root = logging.getLogger()
    level, before = root.level, list(root.handlers)

    def call(*args: str) -> int:
        monkeypatch.setattr(sys, "argv", ["treelit-train", *args])
        GlobalHydra.instance().clear()
        try:
            train.main()
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    yield call
    GlobalHydra.instance().clear()
    for h in list(root.handlers):
        if h not in before:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _autograd_left_on():
    """A test (or the code it runs) must not leave autograd switched off for the tests after it
    in the same worker: that once failed unrelated exactness tests far from the cause."""
    import torch

    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("autograd was left switched off (torch.set_grad_enabled(False) outside a context)")


@pytest.fixture(autouse=True)
def _torch_defaults_left_alone():
    """The default dtype and the torch-function mode stack are process-wide: a test that leaves
    float64 as the default (a ``KeepFloat64`` entered and not left) changes how every later test in
    the worker initialises its models, far from the cause."""
    import torch
    from torch.overrides import _get_current_function_mode_stack

    dtype, modes = torch.get_default_dtype(), len(_get_current_function_mode_stack())
    yield
    left = torch.get_default_dtype()
    stack = _get_current_function_mode_stack()
    if left != dtype or len(stack) != modes:
        torch.set_default_dtype(dtype)
        pytest.fail(f"left the default dtype {left} (was {dtype}) and {len(stack)} torch-function modes "
                    f"(were {modes}) behind")
