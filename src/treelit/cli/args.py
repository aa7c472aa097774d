"""Command-line parsing whose errors are one line, as every treelit error is."""

from __future__ import annotations

import argparse

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reports a usage error in one line (argparse prints the
    usage first): ``treelit: error: argument cmd: invalid choice: 'bogus' ... (treelit --help)``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} ({self.prog.split()[0]} --help shows the usage)\n")
