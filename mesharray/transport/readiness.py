"""The operating system's readiness notification, for the transport's threads: ``epoll`` on Linux,
:mod:`selectors` elsewhere.

A :class:`ReadinessSet` is a set of file descriptors watched for one kind of
readiness. The :class:`~mesharray.transport.poller.Poller` needs *one-shot*
read readiness (a connection reported once stays quiet until whoever read it
arms it again, so that a caller reading its own connection is not raced by the
poller thread), and the :class:`~mesharray.transport.poller.Writer` needs
level-triggered write readiness. Both get theirs from :func:`readiness_set`:

- Linux (native): ``epoll``, ``EPOLLONESHOT`` for one-shot; arming and
  disarming are ``epoll_ctl`` from any thread, seen at once by a thread
  blocked in ``epoll_wait``.
- Elsewhere, or with ``MESHARRAY_PORTABLE=1``: a :mod:`selectors` selector
  (kqueue on macOS and the BSDs), one-shot emulated: a reported fd is
  unregistered before it is handed out, and ``arm`` registers it again. On
  Linux in portable mode the selector is ``poll(2)``-based, whose waiting
  thread does *not* see registrations made meanwhile: every arm from another
  thread then wakes it (a pipe), which is the most general behaviour, so that
  CI exercises it; kqueue sees them at once and skips the wake-up.
"""

from __future__ import annotations

import os
import select
import selectors
import threading

from .. import _platform

__all__ = ["ReadinessSet", "readiness_set", "READ", "WRITE"]

READ = "read"
WRITE = "write"


class ReadinessSet:
    """A set of file descriptors watched for one kind of readiness.

    ``register(fd)`` starts watching (armed); ``poll(timeout)`` waits up to
    ``timeout`` seconds (``None`` or negative: forever) and returns the ready
    fds. A one-shot set disarms every fd it returns until ``arm(fd)``.
    ``disarm``/``arm`` are cheap no-ops when the state does not change.
    ``wake()`` makes a blocked ``poll`` return (with nothing, if nothing is
    ready). Methods may be called from any thread while one thread polls.
    """

    kind = "?"

    def register(self, fd: int) -> None:
        raise NotImplementedError

    def arm(self, fd: int) -> None:
        raise NotImplementedError

    def disarm(self, fd: int) -> None:
        raise NotImplementedError

    def unregister(self, fd: int) -> None:
        raise NotImplementedError

    def poll(self, timeout: float | None) -> list[int]:
        raise NotImplementedError

    def wake(self) -> None:
        raise NotImplementedError


class _Wake:
    """A pipe whose read end a readiness set watches: a byte written makes ``poll`` return."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def wake(self) -> None:
        try:
            os.write(self.w, b"x")
        except BlockingIOError:  # full: a wake-up is pending anyway
            pass

    def drain(self) -> None:
        try:
            os.read(self.r, 4096)
        except BlockingIOError:
            pass


class _EpollSet(ReadinessSet):
    kind = "epoll"

    def __init__(self, event: str, oneshot: bool) -> None:
        self._ep = select.epoll()
        base = select.EPOLLIN if event == READ else select.EPOLLOUT
        self._flags = base | select.EPOLLONESHOT if oneshot else base
        self._wake = _Wake()
        self._ep.register(self._wake.r, select.EPOLLIN)

    def register(self, fd: int) -> None:
        self._ep.register(fd, self._flags)

    def arm(self, fd: int) -> None:
        self._ep.modify(fd, self._flags)

    def disarm(self, fd: int) -> None:
        self._ep.modify(fd, 0)

    def unregister(self, fd: int) -> None:
        self._ep.unregister(fd)

    def poll(self, timeout: float | None) -> list[int]:
        events = self._ep.poll(-1 if timeout is None else timeout)
        w = self._wake.r
        out = [fd for fd, _ in events if fd != w]
        if len(out) != len(events):
            self._wake.drain()
        return out

    def wake(self) -> None:
        self._wake.wake()


#: selectors whose waiting thread sees registrations made by other threads meanwhile
_LIVE = tuple(getattr(selectors, n) for n in ("EpollSelector", "KqueueSelector", "DevpollSelector")
              if hasattr(selectors, n))


class _SelectorSet(ReadinessSet):
    def __init__(self, event: str, oneshot: bool, selector: selectors.BaseSelector) -> None:
        self._sel = selector
        self.kind = type(selector).__name__
        self._event = selectors.EVENT_READ if event == READ else selectors.EVENT_WRITE
        self._oneshot = oneshot
        self._live = isinstance(selector, _LIVE)
        self._lock = threading.Lock()
        self._fds: set[int] = set()
        self._armed: set[int] = set()
        self._poll_thread: int | None = None
        self._wake = _Wake()
        self._sel.register(self._wake.r, selectors.EVENT_READ)

    def _arm_locked(self, fd: int) -> None:
        if fd in self._armed:
            return
        self._sel.register(fd, self._event)
        self._armed.add(fd)
        if not self._live and threading.get_ident() != self._poll_thread:
            self._wake.wake()  # poll(2)/select(2): a waiting poll() would not see it

    def _disarm_locked(self, fd: int) -> None:
        if fd in self._armed:
            self._armed.discard(fd)
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass

    def register(self, fd: int) -> None:
        with self._lock:
            if fd in self._fds:
                raise FileExistsError(f"fd {fd} is already registered")
            self._fds.add(fd)
            self._arm_locked(fd)

    def arm(self, fd: int) -> None:
        with self._lock:
            if fd not in self._fds:
                raise FileNotFoundError(f"fd {fd} is not registered")  # as epoll_ctl says (ENOENT)
            self._arm_locked(fd)

    def disarm(self, fd: int) -> None:
        with self._lock:
            self._disarm_locked(fd)

    def unregister(self, fd: int) -> None:
        with self._lock:
            self._disarm_locked(fd)
            self._fds.discard(fd)

    def poll(self, timeout: float | None) -> list[int]:
        self._poll_thread = threading.get_ident()
        events = self._sel.select(None if timeout is None or timeout < 0 else timeout)
        out = []
        w = self._wake.r
        with self._lock:
            for key, _ in events:
                fd = key.fd
                if fd == w:
                    self._wake.drain()
                elif fd in self._armed:  # not disarmed since the selector reported it
                    if self._oneshot:
                        self._disarm_locked(fd)
                    out.append(fd)
        return out

    def wake(self) -> None:
        self._wake.wake()


def readiness_set(event: str, oneshot: bool = False) -> ReadinessSet:
    """A new :class:`ReadinessSet` for ``event`` (:data:`READ` or :data:`WRITE`) readiness.

    ``epoll`` on Linux; in portable mode or where there is no ``epoll``, a
    :mod:`selectors` one (``poll(2)`` on Linux, the platform's best elsewhere).
    """
    if event not in (READ, WRITE):
        raise ValueError(f"event must be {READ!r} or {WRITE!r}, got {event!r}")
    if _platform.LINUX_NATIVE and hasattr(select, "epoll"):
        return _EpollSet(event, oneshot)
    if hasattr(select, "epoll") and hasattr(selectors, "PollSelector"):
        sel: selectors.BaseSelector = selectors.PollSelector()  # forced portable on Linux: see the docstring
    else:
        sel = selectors.DefaultSelector()
    return _SelectorSet(event, oneshot, sel)
