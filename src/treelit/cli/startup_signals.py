"""Preemption signals that come before training starts.

A run spends its first seconds (several on a busy machine) importing, reading its data,
building the model and opening the MLflow store. The preemption callback
(:class:`treelit.lightning.faults.Preemption`) takes SIGTERM and SIGUSR1 only once training
starts; before that the default action killed the process with code 143 and no word, and a
job script that requeues on code 75 lost the job. ``treelit-train`` therefore installs
:func:`install` first thing, when its module is imported (only Python's own start, a tenth
of a second, comes before): a preemption signal during start-up ends the run at once with
one line and code 75. There is nothing to save (no step has run); the requeued job starts
again - from the newest checkpoint with ``resume_from=auto``. What start-up creates survives
being stopped anywhere: the MLflow store is built under another name and renamed, the output
folder's lock is released by the kernel. Ctrl-C (SIGINT) is taken the same way, with code 130
(the shell's code for it) instead of Python's traceback of ``KeyboardInterrupt``; a second
Ctrl-C, should the first one's way out hang, ends the process at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Dict

__all__ = ["StartupPreempted", "install", "uninstall", "running", "EXIT_CODE", "INTERRUPTED_EXIT_CODE", "keep_only"]

EXIT_CODE = 75  # = treelit.lightning.faults.PREEMPTED_EXIT_CODE (EX_TEMPFAIL); not imported: that module is heavy
INTERRUPTED_EXIT_CODE = 130  # = treelit.lightning.faults.INTERRUPTED_EXIT_CODE (128 + SIGINT)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_before: Dict[int, Any] = {}
_fired = [0]  # the signal taken (0: none yet)
_running = [False]


class StartupPreempted(SystemExit):
    """A preemption signal before training began: exit code 75, ``str()`` the one line."""

    preempted = True  # an MLflow run it interrupts ends KILLED

    def __init__(self, signum: int) -> None:
        code = exit_code_for(signum)
        super().__init__(code)
        self.exit_code = code
        what = ("interrupted by Ctrl-C (SIGINT)" if signum == signal.SIGINT
                else f"preempted by {signal.Signals(signum).name}")
        self.message = (f"{what} during start-up, before training began: "
                        f"nothing to save; exit code {code}: run again (resume_from=auto continues from the "
                        "newest checkpoint of the output_dir, if there is one)")

    def __str__(self) -> str:
        return self.message


def exit_code_for(signum: int) -> int:
    return INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else EXIT_CODE


def _handler(signum: int, frame: Any) -> None:
    if _fired[0]:
        if signum == signal.SIGINT and _fired[0] == signal.SIGINT:  # a second Ctrl-C: at once
            os.write(2, b"error: interrupted by a second Ctrl-C (SIGINT) during start-up: stopped at once\n")
            os._exit(INTERRUPTED_EXIT_CODE)
        return  # the first one is on its way out
    _fired[0] = int(signum)
    exc = StartupPreempted(signum)
    if not _running[0]:  # still importing: nothing opened yet, and no handler above to print the line
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        os._exit(exc.exit_code)
    raise exc


def running() -> None:
    """The command's ``main`` has started: from now on the signal is raised there as
    :class:`StartupPreempted` (and reported by it), so what start-up opened is closed."""
    _running[0] = True


def install() -> None:
    """Take SIGTERM, SIGUSR1 and SIGINT until :func:`uninstall` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _fired[0] = 0
    for s in SIGNALS:
        _before.setdefault(s, signal.getsignal(s))
        signal.signal(s, _handler)


def uninstall() -> None:
    """The handlers from before :func:`install`, where this module's is still the one set."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s, h in list(_before.items()):
        if signal.getsignal(s) is _handler:
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        del _before[s]


def keep_only(names: Any) -> None:
    """Give back the signals not named in ``names`` (``callbacks.preemption.signals``, names
    such as ``SIGTERM`` or ``USR1``): the run's preemption callback takes only those once
    training starts, and a signal it does not take must not be reported as one during start-up."""
    wanted = set()
    for n in names or ():
        text = str(n).upper()
        sig = getattr(signal, text if text.startswith("SIG") else f"SIG{text}", None)
        if isinstance(sig, signal.Signals):
            wanted.add(int(sig))
    if threading.current_thread() is not threading.main_thread():
        return
    for s, h in list(_before.items()):
        if s in wanted:
            continue
        if signal.getsignal(s) is _handler:
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        del _before[s]
