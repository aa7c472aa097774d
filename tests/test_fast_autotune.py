"""``TREELIT_TEST_AUTOTUNE=first`` (tests/fast_autotune.py): an autotuned Triton kernel keeps its first config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import triton, triton.language as tl
from triton.runtime import autotuner
from fast_autotune import install

def kernel(x, n, B: tl.constexpr):
    pass

configs = [triton.Config({"B": 16}, num_warps=1), triton.Config({"B": 32}, num_warps=2), triton.Config({"B": 64})]
tuned = triton.autotune(configs=configs, key=["n"])(triton.jit(kernel))
assert [c.kwargs["B"] for c in tuned.prune_configs({})] == [16, 32, 64]
install()
install()  # twice: still the first config only, not a wrapper of a wrapper
assert [c.kwargs["B"] for c in tuned.prune_configs({})] == [16]
assert autotuner.Autotuner.prune_configs.first_only
print("ok")
"""


def test_first_config_only(tmp_path):
    script = tmp_path / "first_config.py"  # @triton.jit reads its kernel's source from a file
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
