"""Ctrl-C in a controller: a ``KeyboardInterrupt`` only where it leaves every connection whole.

Python raises ``KeyboardInterrupt`` in the main thread between two bytecodes
of whatever it runs, or out of the blocking call it was in. In the caller's
read and write paths that can break a connection for good: raised just after
``recv_into`` returned, the bytes it read are lost and the stream is out of
step; just after a ``send`` took part of a frame, the rest is never written;
between two bookkeeping steps (a connection disarmed and not yet marked
parked, corked frames taken and not yet written), replies are never read or
calls never sent. Before this module the reader took the interrupt for the
end of the connection, and the next call failed with ``ActorDiedError``
although the worker was alive.

The guard costs nothing per message: no flag is set or tested on those paths,
no signal mask changes. Instead the SIGINT handler (:func:`install`, put in
place by the controller, in the main thread, where the handler is Python's
default) looks at the interrupted thread's stack when a Ctrl-C comes:

- Functions whose state an interrupt could break are *guarded*
  (:func:`guard`, at the bottom of their modules). In them, the lines where
  an interrupt may land are marked ``# ^C``: a blocking wait that consumes
  nothing (``poll``, a lock, a condition), a call whose callee decides for
  itself, or a point where everything is consistent. Other frames (user
  code, the standard library) are neutral.
- If every guarded frame on the stack is at a marked line, the handler raises
  ``KeyboardInterrupt`` as Python's default handler would.
- Otherwise the interrupt is *deferred*: the handler returns, asks to be run
  again (``_thread.interrupt_main``: at the next point where Python checks
  for signals) and so follows the thread until it reaches a marked line,
  where it raises (the request to run again comes from a helper thread:
  tripped from inside the handler, it would run the handler again at once,
  nested). A caller blocked in ``recv`` on its reply (a ``get()``
  without a timeout) is woken for this: the handler gives that socket a
  receive timeout of 1 ms (``SO_RCVTIMEO``), taken off again when the
  interrupt is raised.

A waiter interrupted this way hands its connections back to the poller
thread (:func:`unwinding`, run by the handler as it raises: an ``except``
clause would cost a jump on every normal exit), which reads the late reply
and completes the future (a later
``get()`` returns it; nobody else sees it). The call may still run remotely;
a call interrupted while its frame was being written is finished by the
process's writer thread (a frame is never cut), and its reply is dropped.
"""

from __future__ import annotations

import _thread
import linecache
import signal
import socket
import struct
import threading
import time
from types import CodeType, FrameType
from typing import Any, Callable

__all__ = ["guard", "blocking_read", "unwinding", "install", "installed", "MARK"]

#: the comment that marks a line of a guarded function where a KeyboardInterrupt may be raised
MARK = "# ^C"

_funcs: list[tuple[Callable[..., Any], str]] = []  # guarded functions, and the text that marks their safe lines
_table: dict[CodeType, frozenset[int]] | None = None  # code -> its safe line numbers (built at the first Ctrl-C)
_woken: list[socket.socket] = []  # sockets given a receive timeout to wake a blocked reader
_readers: dict[CodeType, Callable[[dict], Any]] = {}  # code of a blocking read -> its socket, from its locals
_unwinds: dict[CodeType, Callable[[dict], Any]] = {}  # code -> what to do as the interrupt leaves its frame
_WAKE = struct.pack("ll", 0, 1000)  # struct timeval: 1 ms
_BLOCK = struct.pack("ll", 0, 0)


def guard(*funcs: Callable[..., Any], mark: str = MARK) -> None:
    """Guard ``funcs``: a Ctrl-C lands in them only on lines whose source holds ``mark``.

    For methods, pass the function (``Connection.send``). ``mark`` other than
    :data:`MARK`: a piece of source text that marks the safe lines, for code
    that cannot carry the comment (the standard library's).
    """
    global _table
    for f in funcs:
        _funcs.append((getattr(f, "__func__", f), mark))
    _table = None


def blocking_read(func: Callable[..., Any], sock_of: Callable[[dict], Any]) -> None:
    """``func`` may block in ``recv`` on the socket that ``sock_of(its frame's locals)`` names (or None):
    a deferred Ctrl-C wakes it with a receive timeout."""
    _readers[getattr(func, "__func__", func).__code__] = sock_of


def unwinding(func: Callable[..., Any], fix: Callable[[dict], Any]) -> None:
    """Call ``fix(locals of func's frame)`` when a Ctrl-C is raised while a frame of ``func`` is on the stack.

    From the handler, just before it raises: for what the frame would otherwise do in an
    ``except`` clause, which costs a jump on every normal exit in CPython 3.11. It runs at a
    marked line of every guarded frame, so the state it looks at is consistent.
    """
    _unwinds[getattr(func, "__func__", func).__code__] = fix


def _unwind(frame: FrameType | None) -> None:
    f = frame
    while f is not None:
        fix = _unwinds.get(f.f_code)
        if fix is not None:
            try:
                fix(f.f_locals)
            except Exception:  # (a fix must not turn the interrupt into another error)
                pass
        f = f.f_back


def _build() -> dict[CodeType, frozenset[int]]:
    global _table
    table: dict[CodeType, frozenset[int]] = {}
    for f, mark in _funcs:
        code = f.__code__
        lines = linecache.getlines(code.co_filename)
        numbers = [n for _, _, n in code.co_lines() if n is not None]
        if not lines or not numbers:  # no source (a frozen build): unguarded, as before
            continue
        last = min(max(numbers), len(lines))
        table[code] = frozenset(n for n in range(code.co_firstlineno, last + 1) if mark in lines[n - 1])
    _table = table
    return table


def _deferred(frame: FrameType | None) -> bool:
    """Whether a guarded frame of this stack is at a line where an interrupt must not land."""
    table = _table if _table is not None else _build()
    f = frame
    while f is not None:
        safe = table.get(f.f_code)
        if safe is not None and f.f_lineno not in safe:
            return True
        f = f.f_back
    return False


def _wake_readers(frame: FrameType | None) -> None:
    """Give the sockets that frames of this stack may block on in ``recv`` (:func:`blocking_read`) a receive
    timeout."""
    f = frame
    while f is not None:
        sock_of = _readers.get(f.f_code)
        if sock_of is not None:
            sock = sock_of(f.f_locals)
            if sock is not None and sock not in _woken:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _WAKE)
                    _woken.append(sock)
                except (OSError, ValueError):
                    pass
        f = f.f_back


def _unwake() -> None:
    while _woken:
        sock = _woken.pop()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _BLOCK)
        except (OSError, ValueError):
            pass


_busy = False  # the handler runs
_retry = threading.Event()
_retrier: threading.Thread | None = None


def _retry_loop() -> None:
    while True:
        _retry.wait()
        _retry.clear()
        while _busy:  # (tripped while the handler runs, it would run it again nested in itself)
            time.sleep(0.0002)
        _thread.interrupt_main(signal.SIGINT)


def _again() -> None:
    """Have the handler run again soon. From another thread: a signal tripped from inside the handler
    would run it again at once, nested, at the handler's own next check for signals."""
    global _retrier
    t = _retrier
    if t is None or not t.is_alive():  # (first use, or after a fork)
        t = _retrier = threading.Thread(target=_retry_loop, name="mesharray-interrupt", daemon=True)
        t.start()
    _retry.set()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler: Python's default (raise ``KeyboardInterrupt``) where that is safe, else later."""
    global _busy
    if _busy:  # a Ctrl-C while the handler runs: the outer one raises it, or defers it for both
        return
    _busy = True
    try:
        try:
            deferred = _deferred(frame)
        except Exception:  # (a RecursionError on a deep stack...): never raised where it would break state
            deferred = True
        if deferred:
            try:
                _wake_readers(frame)
            finally:
                _again()  # run again at the next check for signals, once this handler returned
        else:
            _unwake()
            _unwind(frame)
    finally:
        _busy = False  # (no check for signals between here and the return or the raise)
    if not deferred:
        raise KeyboardInterrupt


def install() -> bool:
    """Make Ctrl-C safe for this process's connections (see the module's docstring).

    Done by the controller when it starts, in the main thread, and only where
    SIGINT has Python's default handler (a handler of the program's own is
    left alone). Returns whether the guard is in place.
    """
    if threading.current_thread() is not threading.main_thread():
        return installed()
    try:
        h = signal.getsignal(signal.SIGINT)
        if h is _on_sigint:
            return True
        if h is not signal.default_int_handler:
            return False
        if _table is None:
            _build()  # (here, not in the handler: it reads the guarded functions' source)
        signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError):  # (no signals here: an embedded interpreter)
        return False
    return True


def installed() -> bool:
    """Whether SIGINT is handled by this module now."""
    try:
        return signal.getsignal(signal.SIGINT) is _on_sigint
    except (ValueError, OSError):
        return False


# the standard library's condition variable, waited on by a sender whose frame waits for the
# writer: interrupted anywhere but in its blocking acquire, it could leave the lock released
guard(threading.Condition.wait, mark="waiter.acquire(")
