"""Package faces that import their children on first use (PEP 562).

A package ``__init__`` that re-exports its children would run every child (and all
they import: torchtune, Lightning, ...) whenever any one submodule is imported, and
would tie the package's layers into one circle: ``import treelit.models.config`` ran
``treelit.models``, which ran the decoder, the Hugging Face I/O and the presets. The
faces of ``treelit``, ``treelit.models``, ``treelit.loss`` and ``treelit.partition``
instead name where each export lives; ``treelit.X`` imports it on first access
(``from treelit import tree_loss`` works as before) and keeps it.

Like :mod:`treelit.registry`, this module imports nothing of treelit.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for package ``package`` whose name ``n`` lives in module
    ``exports[n]`` (``n`` itself when ``exports[n]`` is ``package.n``: a subpackage reached as an
    attribute, ``treelit.models`` after ``import treelit``). Unknown names raise
    :class:`AttributeError` (so ``from package import submodule`` still finds submodules)."""

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where)
        value = module if where == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)  # the next access does not come here
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
