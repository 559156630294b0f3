"""A controller in a Jupyter notebook (an IPython kernel): what changes there, and only there.

:func:`attach` (called by every :class:`~mesharray.runtime.controller.Controller`)
does nothing outside a kernel. In one:

- **A call's output shows in the cell that made it.** The controller asks its
  workers to send their output before each reply (``sync_output``: see
  :func:`~mesharray.runtime.logs.sync_replies`), so the LOG frames of a call
  come before its REPLY on the same connection; and a future's waits
  (``get()``, ``result()``, ``exception()``, ``await``) print what the
  controllers' log sinks hold (:meth:`~mesharray.runtime.logs.LogSink.show`)
  before they return: rank-prefixed and aggregated as in a terminal, inside the
  cell still running. Both are put in place here, by rebinding methods, so a
  program outside notebooks runs exactly the code it ran before.
- **Kernel interrupts.** IPython gives each cell Python's default SIGINT handler;
  a hook before each cell puts the Ctrl-C guard of
  :mod:`mesharray.transport.interrupt` back in its place, so an interrupt
  during a ``get()`` interrupts the cell, never a connection. The workers run
  in sessions of their own (``bootstrap.local``), out of reach of the
  kernel's process-group interrupt.
- **Actor classes defined in cells** travel by value (cloudpickle, as any
  class of ``__main__``); a class redefined in a cell is a new class, which the
  next ``spawn`` sends.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from ..transport import interrupt
from .future import Future

__all__ = ["in_kernel", "attach", "show_output"]

_sinks: weakref.WeakSet = weakref.WeakSet()  # the log sinks of this kernel's controllers
_hooked = False


def in_kernel() -> bool:
    """Whether this process is an IPython kernel (a Jupyter notebook's, or a console's)."""
    if "ipykernel" not in sys.modules:
        return False
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def attach(controller: Any) -> bool:
    """Give ``controller`` the notebook behaviour when this process is a kernel; whether it is."""
    if not in_kernel():
        return False
    _sinks.add(controller.sink)
    Future._show_after_wait(show_output)
    _hook_cells()
    return True


def show_output() -> None:
    """Print the worker output the kernel's controllers hold (what a call produced, before its ``get()`` returns)."""
    for sink in list(_sinks):
        sink.show()


def _hook_cells() -> None:
    global _hooked
    if _hooked:
        return
    try:
        shell = sys.modules["IPython"].get_ipython()
        shell.events.register("pre_run_cell", _before_cell)
        _hooked = True
    except Exception:  # (an IPython without events: interrupts then behave as in plain Python)
        pass


def _before_cell(*_: Any) -> None:
    interrupt.install()
