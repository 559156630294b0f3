"""The one :class:`Future` of mesharray: ``get``, ``await``, callbacks.

A future is completed exactly once, usually by a connection's reader thread.
Waiting uses a raw lock that is held until completion (the cheapest wake-up
CPython has: no Condition, no event loop). ``await`` works inside any running
event loop without blocking it: the completion is handed to the loop with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import _thread
import asyncio
from collections.abc import Callable, Generator
from time import monotonic as _monotonic
from typing import Any, Generic, TypeVar

from ..transport.interrupt import guard
from .channel import Channel
from .channel import dirty as _dirty
from .channel import flush_all as _flush_all

__all__ = ["Future", "completed_future", "is_done", "new_future", "reply_on", "set_exception", "set_result"]

T = TypeVar("T")

_cb_lock = _thread.allocate_lock()
_PENDING: Any = object()


class Future(Generic[T]):
    """The result of an actor call, available later: ``Future[T]`` gives a ``T``.

    Futures are made by the runtime (``call()``, ``call_one()``, ...); there is
    no public constructor.

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.proc_mesh(hosts=1, procs=1) as procs:   # doctest: +SKIP
    ...     fut = procs.spawn("e", Echo).echo.call_one(3)
    ...     fut.get(timeout=5)
    3
    """

    __slots__ = ("_lock", "_value", "_exc", "_callbacks", "_chan", "__weakref__")

    _lock: _thread.LockType
    _value: Any  # T once done, _PENDING before
    _exc: BaseException | None
    _callbacks: list[Callable[[Future[T]], object]] | None
    _chan: Any  # the polled channel(s) its reply comes on: one, a tuple or a Fanout (call()), or None

    def __init__(self) -> None:
        raise TypeError("Future has no public constructor; futures come from endpoint adverbs")

    @classmethod
    def _new(cls) -> Future[Any]:
        f = object.__new__(cls)
        f._lock = _thread.allocate_lock()
        f._lock.acquire()
        f._value = _PENDING
        f._exc = None
        f._callbacks = None
        f._chan = None  # the polled channel(s) its reply comes on: one, or a tuple (call())
        return f

    @classmethod
    def _completed(cls, value: Any = None, exc: BaseException | None = None) -> Future[Any]:
        f = cls._new()
        if exc is not None:
            f._set_exception(exc)
        else:
            f._set_result(value)
        return f

    # -- completion (runtime side) ----------------------------------------
    def _set_result(self, value: T) -> bool:
        with _cb_lock:
            if self._value is not _PENDING:
                return False
            self._value = value
            cbs, self._callbacks = self._callbacks, None
        self._lock.release()
        if cbs:
            self._run(cbs)
        return True

    # _set_exception is _set_result's twin, kept whole rather than sharing a helper:
    # _set_result completes every reply, and a call less there is worth the six lines
    def _set_exception(self, exc: BaseException) -> bool:
        with _cb_lock:
            if self._value is not _PENDING:
                return False
            self._exc = exc
            self._value = None
            cbs, self._callbacks = self._callbacks, None
        self._lock.release()
        if cbs:
            self._run(cbs)
        return True

    def _run(self, cbs: list[Callable[[Future[T]], object]]) -> None:
        for cb in cbs:
            try:
                cb(self)
            except Exception:  # a user's callback must not break the runtime
                import logging

                logging.getLogger("mesharray").exception("future callback failed")

    # -- public API -------------------------------------------------------
    def done(self) -> bool:
        """Whether the result (or an exception) is available."""
        if self._value is not _PENDING:
            return True
        self._unpark()  # someone polls done(): let the poller thread read the reply
        return self._value is not _PENDING

    def _done(self) -> bool:
        return self._value is not _PENDING

    def _unpark(self) -> None:
        chan = self._chan
        if chan is not None:
            for c in chan if type(chan) is tuple else (chan,):
                c.unpark()

    def _wait(self, timeout: float | None) -> None:
        if self._value is not _PENDING:
            return
        asked = timeout
        if _dirty:
            _flush_all()  # ^C
        chan = self._chan
        if chan is not None:
            # read the reply ourselves rather than be woken by the poller thread
            if timeout is not None and timeout < 0:
                raise ValueError(f"timeout must be >= 0, got {timeout}")
            deadline = None if timeout is None else _monotonic() + timeout
            if type(chan) is tuple:  # the replies of a call(): read them all here
                read = Channel.wait_all(chan, self._done, deadline)  # ^C
            else:  # one channel, or a Fanout (a call() in a loop)
                read = chan.wait(self._done, deadline)  # ^C
            if read:
                if self._value is not _PENDING:
                    return  # read here and done (the completion released the lock: nothing to wait on)
                if deadline is not None:
                    timeout = max(0.0, deadline - _monotonic())
            else:
                self._unpark()  # another thread reads: make sure the poller does too  # ^C
        if timeout is None:
            ok = self._lock.acquire()  # ^C
        else:
            if timeout < 0:
                raise ValueError(f"timeout must be >= 0, got {timeout}")
            ok = self._lock.acquire(True, timeout)  # ^C
        if not ok:
            raise TimeoutError(f"future not done after {asked:g} s (get(timeout={asked:g})); "
                               f"{_may_have_run(self._chan)}")
        self._lock.release()  # let other waiters through

    def get(self, timeout: float | None = None) -> T:
        """Block until done and return the value (or raise the remote error).

        Raises the builtin ``TimeoutError`` if not done within ``timeout`` seconds;
        the remote work goes on.
        """
        self._wait(timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def result(self, timeout: float | None = None) -> T:
        """Same as :meth:`get` (``concurrent.futures`` spelling)."""
        return self.get(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until done; return the exception, or ``None`` on success."""
        self._wait(timeout)
        return self._exc

    def add_done_callback(self, fn: "Callable[[Future[T]], object]") -> None:
        """Call ``fn(future)`` when done (at once, in this thread, if already done)."""
        if self._chan is not None:
            self._unpark()  # nobody may ever call get(): the poller thread must read the reply
        with _cb_lock:
            if self._value is _PENDING:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self) -> Generator[Any, None, T]:
        if self._value is _PENDING:
            if _dirty:
                _flush_all()
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_f, loop=loop, waiter=waiter):
                loop.call_soon_threadsafe(_wake, waiter)

            self.add_done_callback(wake)
            yield from waiter.__await__()
        if self._exc is not None:
            raise self._exc
        return self._value

    @classmethod
    def _show_after_wait(cls, fn: Callable[[], object]) -> None:
        """Have every wait (``get``, ``result``, ``exception``, ``await``) call ``fn()`` when it ends.

        For a controller in a notebook (``runtime.notebook``): ``fn`` prints the
        workers' output of the call before ``get()`` returns. The methods are
        rebound (once), so a program outside notebooks runs the same code as before.
        """
        if getattr(cls._wait, "_shows", False):
            return
        plain_wait, plain_await = cls._wait, cls.__await__

        def _wait(self: Future[Any], timeout: float | None) -> None:
            try:
                plain_wait(self, timeout)
            finally:
                fn()

        def __await__(self: Future[Any]) -> Generator[Any, None, Any]:
            try:
                return (yield from plain_await(self))
            finally:
                fn()

        _wait._shows = True  # type: ignore[attr-defined]
        cls._wait = _wait  # type: ignore[method-assign]
        cls.__await__ = __await__  # type: ignore[method-assign]

    def __repr__(self) -> str:
        if self._value is _PENDING:
            state = "pending"
        elif self._exc is not None:
            state = f"raised {type(self._exc).__name__}"
        else:
            state = "done"
        return f"<mesharray.Future {state}>"


def _may_have_run(chan: Any) -> str:
    """What a timed-out caller can know: its request went out, so the call may have run.

    A lost request, a lost reply and a slow call look alike from here;
    mesharray sends a call at most once, so it never runs twice, and a reply
    that comes later still completes the future.
    """
    ranks: list = []
    slow: list[str] = []
    chans = () if chan is None else chan if type(chan) is tuple else getattr(chan, "chans", (chan,))  # (a Fanout's)
    for c in chans:
        if c.pending:
            ranks.extend(c.peer.get("ranks", ()))
            info = c.peer.get("info")  # the controller's view of that worker
            paused = getattr(info, "paused", None)
            if paused:
                slow.append(f"rank {info.rank} is paused in the debugger at {', '.join(paused.values())}")
                continue
            since = getattr(info, "unresponsive_since", None)
            if since is not None:
                slow.append(f"rank {info.rank} is unresponsive (no heartbeat for "
                            f"{_monotonic() - info.last_seen:.1f} s; heartbeat_timeout of proc_mesh)")
    where = ""
    if ranks:
        where = (" on rank " if len(ranks) == 1 else " on ranks ") + ", ".join(map(str, ranks))
    text = (f"the call may have run{where}: its request was sent and no reply came (lost, late, or the call "
            f"is still running); it is never sent twice, and a reply that comes later completes this future")
    return text + ("; " + "; ".join(slow) if slow else "")


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


Future.__module__ = "mesharray"  # public as mesharray.Future (the runtime is internal)


# The runtime side of a future, for the layers that make and complete futures
# (actor, proc, buffer): plain aliases of the methods, so no call costs more.
new_future = Future._new
completed_future = Future._completed
set_result = Future._set_result
set_exception = Future._set_exception
is_done = Future._done


def reply_on(fut: Future[Any], chan: Any) -> None:
    """Say which polled channel(s) ``fut``'s reply comes on: ``get()`` then reads it in its own thread."""
    fut._chan = chan


# a Ctrl-C in the caller's thread lands where waiting can stop (see transport.interrupt)
guard(Future._wait, Future._set_result, Future._set_exception, Future.add_done_callback, Future._unpark)
