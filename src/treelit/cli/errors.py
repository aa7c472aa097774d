"""The command line's own error type (below every cli module that raises it)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An invalid or incompatible combination of options (names the option)."""
