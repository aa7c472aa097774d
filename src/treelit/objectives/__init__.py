"""Training objectives (registry kind ``objective``)."""

from treelit.objectives.base import OBJECTIVES, Objective, make_objective

__all__ = ["OBJECTIVES", "Objective", "make_objective"]
