"""The releases of treelit's fast-moving dependencies that the test suite passed on.

``pyproject.toml`` bounds each of these packages at the newest release listed here, so a fresh
install resolves to a tested set. ``python -m treelit.cli.compat`` (docs/compatibility.md) installs the
newest releases the package index offers into a fresh virtual environment, runs the adapter and
hybrid exactness tests there and prints which releases pass; a bound is raised, and the release
added here, only when it does. The adapter names these releases when it refuses a kernel it does
not know (:mod:`treelit.models.hf_kernels`).
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["TESTED"]

TESTED: Dict[str, Tuple[str, ...]] = {
    "transformers": ("5.24.0", "5.25.0"),
    "kernels": ("0.19.1",),
    "flash-linear-attention": ("0.6.0",),
    "lightning": ("2.6.6",),
    "mlflow": ("3.17.2",),
    "peft": ("0.18.1",),  # exact pin: 0.19+ refuses to wrap layers with the torchao torchtune imports with
}
