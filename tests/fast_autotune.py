"""``TREELIT_TEST_AUTOTUNE=first``: Triton's autotuner keeps each kernel's first config, for the CUDA tests.

fla's and mamba-ssm's kernels are autotuned: on first use each one compiles and times every config
(on an H200, fla's chunk kernels spent more than 4 minutes in those compiles, cold). A test compares
results, and a kernel's results do not depend on its config, only its speed does; with one config
left after pruning, a kernel compiles once per shape and nothing is timed. Opt-in (``tests/conftest.py``
installs it when the variable is set), because a first config that does not fit the device would fail
where autotuning would have skipped it.
"""

from __future__ import annotations

__all__ = ["install"]


def install() -> None:
    """Make ``Autotuner.prune_configs`` return only the first of the configs it would keep."""
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs
    if getattr(prune, "first_only", False):
        return

    def first(self, kwargs):
        return prune(self, kwargs)[:1]

    first.first_only = True
    autotuner.Autotuner.prune_configs = first
