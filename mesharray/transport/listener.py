"""The listening side: a :class:`Listener` accepts connections on a unix or TCP address and
authenticates each one (:mod:`.auth`) before it hands the socket over.

Addresses are described in :mod:`.address`. The bounds that keep peers from
exhausting a listener (one thread, a deadline per handshake, a cap on pending
handshakes, the peer's uid on unix sockets) are in :class:`Listener`'s
docstring and ``docs/internals.md``, "Wire".
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import socket
import struct
import threading
import time

from .. import _platform
from ..errors import AuthenticationError, BrokenTransportError
from . import auth
from .sockio import shut

__all__ = ["Listener", "peer_uid", "MAX_HANDSHAKES"]

log = logging.getLogger("mesharray.transport")

#: connections a listener may hold unauthenticated at once (env ``MESHARRAY_MAX_HANDSHAKES``);
#: more wait in the listen backlog, or close the oldest once it has waited :data:`EVICT_AFTER`
MAX_HANDSHAKES = int(os.environ.get("MESHARRAY_MAX_HANDSHAKES", "128"))
#: seconds a pending handshake is safe from eviction: a peer answers in microseconds on an idle
#: machine, but in a good fraction of a second on one saturated by a thousand workers starting
EVICT_AFTER = 1.0


class Listener:
    """Accepts connections on a unix or TCP address; authenticates each one.

    ``on_connection(sock)`` receives every authenticated socket (a blocking
    socket, in the accept thread: it must return quickly). One thread per
    process accepts for all its listeners and runs every pending handshake
    without blocking (one selector: a worker's unix, TCP and data-plane
    listeners cost one thread, not three), so that peers cannot exhaust it:

    - a unix-socket peer of another uid (``SO_PEERCRED``; root excepted) is
      closed before the handshake: abstract sockets have no file permissions;
    - each peer has ``handshake_timeout`` seconds (:data:`auth.HANDSHAKE_TIMEOUT`,
      env ``MESHARRAY_HANDSHAKE_TIMEOUT``) for the *whole* exchange, however
      it trickles its bytes in;
    - at most ``max_handshakes`` (:data:`MAX_HANDSHAKES`, env
      ``MESHARRAY_MAX_HANDSHAKES``) handshakes are pending at once. While
      that many are, the listener stops accepting (new peers wait in the
      kernel's listen backlog) until one finishes, or until the oldest has
      waited ``evict_after`` seconds (:data:`EVICT_AFTER`): then the next
      connection closes that oldest one (an idle socket, most likely). A
      young handshake is never closed for a newer one: on a machine saturated
      by a thousand workers starting at once, real peers answer slowly, and
      closing them would fail their start;
    - a peer that fails the challenge, or stays silent, is logged and dropped,
      and no exception (not even a failed ``accept`` or ``on_connection``)
      ends the thread: it logs and keeps accepting.

    A TCP listener binds loopback by default; one bound elsewhere needs a
    secret (``ValueError`` without), and one bound to every interface
    (``0.0.0.0``, ``::``, ``""``) warns (``RuntimeWarning``).
    """

    def __init__(self, secret: bytes, on_connection, kind: str = "unix", host: str = "127.0.0.1",
                 path: str | None = None, port: int = 0, handshake_timeout: float | None = None,
                 max_handshakes: int | None = None, evict_after: float | None = None) -> None:
        if kind == "tcp":
            _check_bind(host, secret)
        self.secret = secret
        self.on_connection = on_connection
        self.refused = 0
        self.handshake_timeout = auth.HANDSHAKE_TIMEOUT if handshake_timeout is None else handshake_timeout
        self.max_handshakes = MAX_HANDSHAKES if max_handshakes is None else max(1, max_handshakes)
        self.evict_after = EVICT_AFTER if evict_after is None else max(0.0, evict_after)
        self._path: str | None = None
        if kind == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if path is None and _platform.abstract_sockets():
                # abstract socket: no file is left behind by a killed process; no file
                # permissions either, hence the peer's uid check and the HMAC challenge
                name = f"mesharray-{os.getpid()}-{os.urandom(6).hex()}"
                self.sock.bind("\0" + name)
                self.address = "unix:@" + name
            else:
                # default: a socket file in this user's 0700 runtime directory (only this user
                # reaches it; a killed process's file is swept by the next one)
                self._dir = os.path.dirname(path) if path is not None else None
                if path is None:
                    path = _platform.socket_file("l")
                self.sock.bind(path)
                self.address = "unix:" + path
                self._path = path
        elif kind == "tcp":
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            h, p = self.sock.getsockname()[:2]
            self.address = f"tcp:{h}:{p}"
        else:
            raise ValueError(f"listener kind must be 'unix' or 'tcp', got {kind!r}")
        self.sock.listen(512)
        self.sock.setblocking(False)
        # unauthenticated sockets, oldest first (so also in order of their deadlines)
        self._pending: dict[socket.socket, auth.ServerHandshake] = {}
        self._evicted = 0
        self._t_evict_log = 0.0
        self._paused = False  # (its listening socket out of the selector: at the cap, all young)
        self._closed = False
        self._dropped = threading.Event()
        self._acc = _acceptor()
        self._sel = self._acc.sel
        self._acc.post(self._join)  # (peers that come first wait in the listen backlog)

    # -- in the accept thread ----------------------------------------------------------
    def _join(self) -> None:
        if self._closed:  # (closed before the accept thread got to it)
            self._drop()
            return
        self._sel.register(self.sock, selectors.EVENT_READ, self)
        self._acc.listeners.append(self)

    def _drop(self) -> None:
        """Leave the accept thread: the listening socket and the pending handshakes closed."""
        try:
            self._sel.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()
        for s in list(self._pending):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self._pending.clear()
        if self in self._acc.listeners:
            self._acc.listeners.remove(self)
        self._dropped.set()

    def _expire(self, now: float) -> None:
        while self._pending and not self._closed:  # deadlines passed (the oldest first)
            s, hs = next(iter(self._pending.items()))
            if hs.deadline > now:
                break
            got = len(hs.buf)
            self._refuse(s, f"handshake not finished within {self.handshake_timeout:g} s "
                            f"({got} of {auth.CLIENT_MSG} bytes received; MESHARRAY_HANDSHAKE_TIMEOUT)")

    def _accept(self) -> None:
        for _ in range(64):  # a batch, then the pending handshakes get their turn
            if self._closed or not self._room(time.monotonic()):
                return
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                # out of descriptors or memory: the kernel keeps the connection queued
                # (listen backlog); retry shortly rather than spin, and never stop accepting
                log.warning("listener %s: accept failed (%s); retrying", self.address, exc)
                time.sleep(0.05)
                return
            try:
                self._admit(s)
            except Exception as exc:
                self._pending.pop(s, None)
                log.warning("refused a connection on %s: %s", self.address, exc)
                self.refused += 1  # after the warning: whoever watches the count finds it logged
                try:
                    self._sel.unregister(s)
                except (KeyError, ValueError):
                    pass
                s.close()

    def _admit(self, s: socket.socket) -> None:
        if s.family == socket.AF_UNIX:
            uid = peer_uid(s)
            if uid is not None and uid != os.geteuid() and uid != 0:
                log.warning("refused a connection on %s from uid %d (this process runs as uid %d)",
                            self.address, uid, os.geteuid())
                self.refused += 1
                s.close()
                return
        s.setblocking(False)
        hs = auth.ServerHandshake(self.secret, time.monotonic() + self.handshake_timeout)
        if s.send(hs.hello) != len(hs.hello):  # a fresh socket takes 36 bytes at once
            raise BrokenTransportError("peer does not take the handshake's first message")
        self._pending[s] = hs
        self._sel.register(s, selectors.EVENT_READ, self)

    def _room(self, now: float) -> bool:
        """Whether one more handshake may start: under the cap, or at it with the oldest evicted
        (once it has waited ``evict_after``); otherwise accepting pauses (:meth:`_resume`)."""
        if len(self._pending) < self.max_handshakes:
            return True
        if now - self._started(next(iter(self._pending.values()))) >= self.evict_after:
            self._evict()
            return True
        if not self._paused:
            self._paused = True
            self._sel.unregister(self.sock)
        return False

    def _started(self, hs: auth.ServerHandshake) -> float:
        return hs.deadline - self.handshake_timeout

    def _wake_at(self) -> float | None:
        """When the accept thread must look at this listener again: its oldest handshake's
        deadline, or, paused, the moment that handshake may be evicted."""
        if not self._pending:
            return None
        hs = next(iter(self._pending.values()))
        return min(hs.deadline, self._started(hs) + self.evict_after) if self._paused else hs.deadline

    def _resume(self, now: float) -> None:
        """Accept again once a handshake ended or the oldest may be evicted."""
        if self._paused and not self._closed and (
                len(self._pending) < self.max_handshakes
                or now - self._started(next(iter(self._pending.values()))) >= self.evict_after):
            self._paused = False
            self._sel.register(self.sock, selectors.EVENT_READ, self)

    def _evict(self) -> None:
        oldest = next(iter(self._pending))
        self._refuse(oldest, None)
        self._evicted += 1
        now = time.monotonic()
        if now - self._t_evict_log > 1.0:  # a flood of idle sockets: one line a second, not one each
            self._t_evict_log = now
            log.warning("listener %s: over %d pending handshakes (MESHARRAY_MAX_HANDSHAKES); closed the "
                        "oldest, pending for %g s or more (%d so far)", self.address, self.max_handshakes,
                        self.evict_after, self._evicted)

    def _advance(self, s: socket.socket) -> None:
        hs = self._pending.get(s)
        if hs is None:
            return
        try:
            data = s.recv(auth.CLIENT_MSG - len(hs.buf))
            if not data:
                raise BrokenTransportError("peer closed the connection during the handshake")
            answer = hs.feed(data)
        except (BlockingIOError, InterruptedError):
            return
        except (AuthenticationError, OSError, BrokenTransportError) as exc:
            self._refuse(s, str(exc))
            return
        if answer is None:
            return
        del self._pending[s]
        self._sel.unregister(s)
        try:
            if s.send(answer) != len(answer):
                raise BrokenTransportError("peer does not take the handshake's answer")
            s.setblocking(True)
        except OSError as exc:
            log.warning("refused a connection on %s: %s", self.address, exc)
            self.refused += 1
            s.close()
            return
        try:
            self.on_connection(s)
        except Exception:
            log.exception("connection handler failed on %s", self.address)
            s.close()

    def _refuse(self, s: socket.socket, why: str | None) -> None:
        self._pending.pop(s, None)
        try:
            self._sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()
        if why is not None:
            log.warning("refused a connection on %s: %s", self.address, why)
        self.refused += 1

    @property
    def pending_handshakes(self) -> int:
        """Connections accepted and not yet authenticated."""
        return len(self._pending)

    def close(self) -> None:
        """Stop accepting: new peers are refused from now on, pending handshakes are closed, and
        ``on_connection`` is not called again once this returns (within 2 s of any listener's
        handler that holds the accept thread)."""
        if self._closed:
            return
        self._closed = True
        acc = self._acc
        if not acc.thread.is_alive():
            # inherited by a fork: the socket, its file and the selector are the parent's too (the
            # same open files): close this process's descriptors, and leave the parent listening
            self.sock.close()
            for s in list(self._pending):
                s.close()
            self._pending.clear()
            self._dropped.set()
            return
        # new peers are refused from now on (Linux; where a listening socket cannot be shut down,
        # from _drop on, which closes it in the accept thread: never under a selector that holds it)
        shut(self.sock)
        if threading.current_thread() is acc.thread:
            self._drop()
        else:
            acc.post(self._drop)
            self._dropped.wait(2.0)
        if self._path is not None:
            try:
                os.unlink(self._path)
                if self._dir is not None:
                    os.rmdir(self._dir)
            except OSError:
                pass


class _Acceptor:
    """The accept thread of this process: one selector over the listening sockets of every
    :class:`Listener` and their pending handshakes (a key's data is its listener).

    Only this thread touches the selector; other threads hand it work with :meth:`post`
    (a listener joining or leaving). Nothing ends the thread: an error is logged, naming
    the listener where it has one, and it goes on accepting.
    """

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.listeners: list[Listener] = []
        self._todo: collections.deque = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._loop, name="mesharray-accept", daemon=True)
        self.thread.start()

    def post(self, fn) -> None:
        """Run ``fn()`` in the accept thread, soon."""
        self._todo.append(fn)
        try:
            self._wake_w.send(b"x")
        except OSError:  # (its buffer is full of wake-ups: it is awake anyway)
            pass

    def _loop(self) -> None:
        while True:
            try:
                self._step()
            except BaseException:  # nothing may end the thread: every later peer would time out
                log.exception("accept thread: unexpected error; still accepting")
                time.sleep(0.01)

    def _step(self) -> None:
        while self._todo:
            self._todo.popleft()()
        deadline = None
        for lst in self.listeners:
            first = lst._wake_at()
            if first is not None:
                deadline = first if deadline is None else min(deadline, first)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        for key, _ in self.sel.select(timeout):
            lst = key.data
            if lst is None:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
                continue
            if lst._closed:
                continue
            try:
                if key.fileobj is lst.sock:
                    lst._accept()
                else:
                    lst._advance(key.fileobj)
            except Exception:
                log.exception("listener %s: unexpected error; still accepting", lst.address)
                time.sleep(0.01)
        now = time.monotonic()
        for lst in list(self.listeners):
            try:
                lst._expire(now)
                lst._resume(now)
            except Exception:
                log.exception("listener %s: unexpected error; still accepting", lst.address)


_acc: _Acceptor | None = None
_acc_lock = threading.Lock()


def _acceptor() -> _Acceptor:
    global _acc
    acc = _acc
    if acc is None:
        with _acc_lock:
            if _acc is None:
                _acc = _Acceptor()
            acc = _acc
    return acc


def _forget_acceptor() -> None:
    # a fork has no accept thread (and a lock another thread held stays held): it starts its own
    global _acc, _acc_lock
    _acc = None
    _acc_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_acceptor)


_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (``None`` where the OS does not say)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _PEERCRED.size))
    except OSError:
        return None
    return uid


def _check_bind(host: str, secret: bytes) -> None:
    """Refuse a TCP listener reachable from other hosts without a secret; warn for all interfaces."""
    import ipaddress

    wildcard = host in ("", "0.0.0.0", "::")
    try:
        loopback = not wildcard and (host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback)
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if loopback:
        return
    if not secret:
        raise ValueError(f"refusing to listen on {host or 'every interface'!r} without a secret: other hosts "
                         f"could connect; give a secret, or bind 127.0.0.1")
    if wildcard:
        import warnings

        warnings.warn(f"listening on every interface ({host or '0.0.0.0'!r}): any host that reaches the port can "
                      f"try the handshake (the job secret still protects it); bind the one interface the "
                      f"peers use instead", RuntimeWarning, stacklevel=3)
