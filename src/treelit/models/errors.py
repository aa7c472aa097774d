"""Errors of the model layer, below every module that raises them."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a supported model."""
