"""Every registry of treelit, complete: the one place that knows all component kinds.

:mod:`treelit.registry` is the bottom of the package and knows no entries; each kind's
registry is created by the module that defines its built-ins. This module imports
those, so ``treelit list`` and :func:`all_registries` see every kind.
"""

from __future__ import annotations

from typing import Dict

from treelit.attention import base as _attention  # noqa: F401
from treelit.builders import base as _builders  # noqa: F401
from treelit.data import sources as _data_sources  # noqa: F401
from treelit.models import registry as _models  # noqa: F401
from treelit.objectives import base as _objectives  # noqa: F401
from treelit.partition import plan as _partitions  # noqa: F401
from treelit.registry import Registry, registries
from treelit.rl import advantages as _advantages  # noqa: F401
from treelit.rl import rewards as _rewards  # noqa: F401
from treelit.ssm import SSM_BACKENDS as _ssm  # noqa: F401

__all__ = ["all_registries"]


def all_registries() -> Dict[str, Registry]:
    """Every registry treelit knows, by kind (plugins of each are loaded when it is listed)."""
    return registries()
