"""Peak tensor memory of a call (see :mod:`treelit.utils.memory`)."""

from treelit.utils.memory import peak_memory  # noqa: F401
