"""The spin policy: how long a thread polls a socket, without waiting, before it blocks.

A message that comes while its reader polls needs no wake-up of that reader,
which on a machine whose idle CPUs halt is the larger part of a round trip's
latency; polling while nothing comes burns a CPU. Two settings, one per kind
of waiting thread, both ``0`` (block at once) unless set:

- :func:`set_read_spin`: a thread-mode reader
  (:meth:`~mesharray.transport.connection.Connection.start`) before each
  blocking ``recv`` (compiled: :func:`mesharray.transport._wire.spin_recv`,
  run by its reader loop). Workers set it from ``MESHARRAY_WORKER_SPIN_US``.
- :func:`set_reply_spin`: a caller waiting for the reply of its call
  (:meth:`~mesharray.transport.connection.Connection.read_until`,
  :class:`~mesharray.transport.poller.ReadSet`) before each blocking ``poll``
  or ``recv`` (:func:`_spin_poll`). The controller sets it from
  ``MESHARRAY_CALLER_SPIN_US``.

Both loops back off: after a wait whose polling found nothing, the next 1, 2,
4 ... 64 waits block at once, so that a thread polls in a stream of messages
and hardly ever when idle. The rules and why: ``docs/internals.md``,
"Threads" (readers and callers "poll before they block").

The per-message paths of :mod:`.connection` and :mod:`.poller` test a
setting before they call in here, as a global of their own module (one
dictionary lookup, no attribute of this module): :func:`mirror` gives a module
its copies and the setters keep every copy equal to the setting.
"""

from __future__ import annotations

import os
import time

__all__ = ["set_read_spin", "set_reply_spin", "mirror"]

#: how long a reader thread polls its socket before it blocks in ``recv`` (seconds; see set_read_spin)
_spin = 0.0
#: how long a caller waiting for a reply polls before it blocks (seconds; see set_reply_spin)
_reply_spin = 0.0
_clock = time.perf_counter
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
#: the globals of the modules that keep copies of ``_spin`` and ``_reply_spin`` (see mirror)
_mirrors: list[dict] = []


def mirror(namespace: dict) -> None:
    """Give ``namespace`` (a module's ``globals()``) its own ``_spin`` and ``_reply_spin``, kept equal
    to this module's by the setters from now on: for code that tests a setting on every message."""
    namespace["_spin"] = _spin
    namespace["_reply_spin"] = _reply_spin
    _mirrors.append(namespace)


def _publish(name: str, value: float) -> None:
    globals()[name] = value
    for namespace in _mirrors:
        namespace[name] = value


def set_reply_spin(seconds: float) -> None:
    """Make this process's callers poll for their replies for up to ``seconds`` before blocking.

    A thread waiting for the reply of a call (:meth:`Connection.read_until
    <mesharray.transport.connection.Connection.read_until>`,
    :meth:`Connection.read_all <mesharray.transport.connection.Connection.read_all>`,
    :class:`~mesharray.transport.poller.ReadSet`) tries ``poll`` without
    waiting, yielding the CPU between tries, and blocks once nothing came
    within ``seconds``; after a wait whose polling found nothing, its next 1,
    2, 4 ... 64 waits block at once (a caller of long calls hardly polls). A
    reply that comes while it polls needs no wake-up of the caller.
    ``0`` (the default) blocks at once; the controller's
    ``proc_mesh``/``attach`` set ``MESHARRAY_CALLER_SPIN_US``
    (:func:`~mesharray._platform.caller_spin`).
    """
    if not seconds >= 0:
        raise ValueError(f"reply spin must be >= 0 seconds, got {seconds!r}")
    _publish("_reply_spin", float(seconds))


def set_read_spin(seconds: float) -> None:
    """Make this process's reader threads poll their sockets for up to ``seconds`` before blocking.

    After a read, a thread-mode reader (:meth:`Connection.start
    <mesharray.transport.connection.Connection.start>`) tries its
    socket without waiting, yielding the CPU between tries (so that any thread
    that wants it runs), and blocks in ``recv`` once nothing came within
    ``seconds``; it then blocks at once for its next 1, 2, 4 ... 64 reads, and
    polls every read again once a message comes while it polls: it polls in a
    loop of messages, hardly ever when idle. A message that comes while it
    polls needs no wake-up (which costs both the sender and the reader).
    Readers sharing a core poll in turns, which keeps that core awake through
    a ``call()`` to all of them. ``0`` (the default) blocks at once; a
    worker sets ``MESHARRAY_WORKER_SPIN_US``
    (:func:`~mesharray.runtime.worker.set_spin`).
    """
    if not seconds >= 0:
        raise ValueError(f"read spin must be >= 0 seconds, got {seconds!r}")
    _publish("_spin", float(seconds))


def _spin_poll(p, state: list, deadline: float | None = None) -> list:
    """A waiting caller's polling (:func:`set_reply_spin`): what ``p.poll(0)`` found ready, or
    ``[]`` (block). ``state``: the waiter's ``[waits left to block at once, back-off]``;
    ``deadline`` (``time.monotonic()``): the wait's, which the polling never passes."""
    if state[0]:
        state[0] -= 1
        return []
    spin = _reply_spin if deadline is None else min(_reply_spin, deadline - time.monotonic())
    end = _clock() + spin
    while True:
        ready = p.poll(0)
        if ready:
            state[1] = 0
            return ready
        if _clock() > end:
            break
        _yield()  # (a thread that wants this CPU runs: see set_read_spin)
    state[0] = state[1] = min(64, 2 * state[1] or 1)
    return ready
