"""Imports every module that defines a registry, so that listing them is complete."""

from treelit.attention import base as _attention  # noqa: F401
from treelit.builders import base as _builders  # noqa: F401
from treelit.data import sources as _data_sources  # noqa: F401
from treelit.models import registry as _models  # noqa: F401
from treelit.objectives import base as _objectives  # noqa: F401
from treelit.partition import PARTITIONS as _partitions  # noqa: F401
from treelit.rl import advantages as _advantages  # noqa: F401
from treelit.ssm import SSM_BACKENDS as _ssm  # noqa: F401
