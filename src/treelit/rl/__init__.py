"""Reinforcement-learning helpers: advantage estimators."""

from treelit.rl.advantages import ADVANTAGES, compute_advantages

__all__ = ["ADVANTAGES", "compute_advantages"]
