"""``Launch``: what every bootstrap returns.

A bootstrap starts (or finds) worker processes and lets a
:class:`~mesharray.runtime.controller.Controller` adopt them; it hands the
result up as a :class:`Launch`, and :mod:`mesharray.proc` makes the
``ProcMesh`` from it. No bootstrap imports ``proc``.

Bootstraps that learn of their workers' exits from reports (the local zygote,
host agents) answer the controller's ``exit_status`` hook with
:func:`wait_exit_status` over their reports, as an :func:`exit_pair`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Mapping

from .._core import Shape
from ..runtime.controller import Controller

__all__ = ["Launch", "exit_pair", "wait_exit_status"]


def exit_pair(wait_status: int) -> tuple[int | None, int | None]:
    """``(exitcode, None)`` or ``(None, signal)`` of a ``waitpid`` status (what ``exit_status`` hooks return).

    Examples
    --------
    >>> exit_pair(3 << 8), exit_pair(9)
    ((3, None), (None, 9))
    """
    code = os.waitstatus_to_exitcode(wait_status)
    return (None, -code) if code < 0 else (code, None)


def wait_exit_status(cond: threading.Condition, status: Mapping[int, tuple], rank: int, timeout: float,
                     gone: Callable[[], bool]) -> tuple[int | None, int | None] | None:
    """The :func:`exit_pair` of ``rank``'s exit report, waiting at most ``timeout`` s for it; None if none came.

    ``status`` maps a rank to ``(pid, wait status)`` and is filled, under
    ``cond``, by the thread that reads the reports, which notifies ``cond``
    after each one and when the reports end; ``gone()`` (called under
    ``cond``) says they ended (the zygote or the agent is gone), so no
    report can come any more and the wait stops early.
    """
    deadline = time.monotonic() + timeout
    with cond:
        while rank not in status and not gone():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            cond.wait(left)
        st = status.get(rank)
    return None if st is None else exit_pair(st[1])


class Launch:
    """Workers adopted by a controller, laid out as a mesh.

    Attributes
    ----------
    controller : Controller
        Adopted the workers of global ranks ``0 .. shape.size - 1``.
    shape : Shape
        The root mesh's dims over those ranks (``{hosts, procs}`` for a local
        launch; the MPI topology under mpirun).
    mesh : object or None
        Kept by the layer above: the ``ProcMesh`` made from this launch (the
        MPI bootstrap hands the same launch to a second ``proc_mesh()``).
    """

    __slots__ = ("controller", "shape", "mesh", "_close", "_restart")

    def __init__(self, controller: Controller, shape: Shape, close: Callable[[], None] | None = None,
                 restart: Callable[[int], None] | None = None) -> None:
        self.controller = controller
        self.shape = shape
        self.mesh: Any = None
        self._close = close
        self._restart = restart

    @property
    def can_restart(self) -> bool:
        """Whether a dead rank's process can be started again (the local bootstrap can)."""
        return self._restart is not None

    def restart(self, rank: int) -> None:
        """Start a new process for the dead ``rank``; it joins the controller as that rank."""
        if self._restart is None:
            raise NotImplementedError("this bootstrap cannot restart a rank's process")
        self._restart(rank)

    def close(self) -> None:
        """After the controller stopped the workers: reap them, kill what is left, join threads."""
        if self._close is not None:
            self._close()

    def __repr__(self) -> str:
        return f"<Launch {self.shape} at {self.controller.address}>"
