"""The releases of treelit's dependencies that the test suite passed on, and the ranges declared.

``pyproject.toml`` bounds each fast-moving package at the newest release listed in
:data:`TESTED`, so a fresh install resolves to a tested set (the slow-moving ones, Hydra and
OmegaConf, are bounded below their next minor release). ``python -m treelit.cli.compat``
(docs/compatibility.md) installs the newest releases the package index offers into a fresh
virtual environment, runs the adapter and hybrid exactness tests there and prints which releases
pass; a bound is raised, and the release added here, only when it does. The adapter names these
releases when it refuses a kernel it does not know (:mod:`treelit.models.hf_kernels`).

:data:`DECLARED` holds the version specifiers ``pyproject.toml`` declares for the bounded
dependencies (a test checks the two agree). torch is a range, so treelit installs beside
another torch of it; the reproducible CPU install (README: ``pip install -e . -c
constraints.txt``) takes the release the whole suite runs on, ``TESTED["torch"][0]``. An end of
a range the suite has not been run on is listed in :data:`NOT_RUN`, never in :data:`TESTED`.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["TESTED", "DECLARED", "NOT_RUN", "TORCH_RANGE"]

TESTED: Dict[str, Tuple[str, ...]] = {
    "torch": ("2.13.0",),  # the CPU build: the whole suite, every CI run (constraints.txt)
    "transformers": ("5.24.0", "5.25.0"),
    "kernels": ("0.19.1",),
    "flash-linear-attention": ("0.6.0",),
    "lightning": ("2.6.6",),
    "mlflow": ("3.17.2",),
    "peft": ("0.18.1",),  # exact pin: 0.19+ refuses to wrap layers with the torchao torchtune imports with
    "torchtune": ("0.6.1",),
    "torchao": ("0.13.0",),  # the newest torchtune 0.6.1 imports with (docs/compatibility.md, "What holds peft")
    "hydra-core": ("1.3.8",),
    "omegaconf": ("2.3.1",),
}

# the lowest and highest torch release pyproject.toml admits
TORCH_RANGE: Tuple[str, str] = ("2.13.0", "2.14.1")

# what pyproject.toml declares for each bounded dependency (tests/utils/test_versions.py)
DECLARED: Dict[str, str] = {
    "torch": f">={TORCH_RANGE[0]},<={TORCH_RANGE[1]}",
    "torchtune": "==0.6.1",
    "torchao": ">=0.10,<0.14",  # torchtune 0.6.1 imports with these
    "lightning": ">=2.5,<=2.6.6",
    "hydra-core": ">=1.3.2,<1.4",
    "omegaconf": ">=2.3,<2.4",
    "mlflow": ">=2.16,<=3.17.2",
    "transformers": ">=5.24,<=5.25.0",
    "kernels": "<=0.19.1",
    "peft": "==0.18.1",
}

# ends of a declared range the suite has not been run on yet (the newest torch this CI
# machine's index offers is a CUDA build of several GB: `python -m treelit.cli.compat --pin
# torch==2.14.1` runs the exactness tests on it where it can be installed)
NOT_RUN: Dict[str, Tuple[str, ...]] = {
    "torch": (TORCH_RANGE[1],),
}
