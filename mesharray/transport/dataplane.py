"""The network data plane: authenticated point-to-point links for bulk data between hosts.

Control messages (calls, replies, supervision) travel on the framed channels of
:mod:`.connection`. Bulk data between processes of *different hosts* —
collectives between host leaders, ``Buffer`` reads and writes — travels on
*links* of a data plane, so that a large transfer never sits in front of a
small control message. Processes of one host use shared memory instead
(:mod:`.shm`, ``collectives.shm``).

Two implementations share one interface:

- :class:`TcpPlane` (built in): one TCP listener per process; each link is one
  TCP connection, authenticated with the job secret (the HMAC challenge of
  :mod:`.auth`) before its tag is read.
- ``UcxPlane`` (:mod:`.ucx`, the ``ucx`` extra): the same over UCX (UCP's C
  API through the compiled ``_ucp``), RDMA where the hardware has it, TCP
  otherwise; one-sided ``Buffer`` transfers and the ring's loop run in C.

A *link* is full duplex: one thread may :meth:`Link.send` while another
:meth:`Link.recv_into` on the same link (ring collectives need both at once).
Both move whole buffers and block until done.

Who connects to whom: the connecting side names a *tag* (bytes, at most
:data:`MAX_TAG`) that the accepting side's ``on_link(link, tag)`` callback
receives, in a thread of the plane's own (it may block: a ``Buffer`` read is
served right there). :class:`Rendezvous` turns tags into a table that the
accepting side's code waits on (``take(tag)``), which is how the members of a
collective group find each other's links.

``MESHARRAY_DATA_PLANE`` (or ``transport=``) selects ``auto`` (shared memory
on a host; between hosts UCX where there is RDMA hardware and the UCX plane
loads, else TCP), ``shm``,
``tcp`` or ``ucx``; :func:`plane_kind` resolves it.
"""

from __future__ import annotations

import importlib
import os
import socket
import struct
import threading
import time
from typing import Callable, Protocol

from ..errors import BootstrapError
from . import auth
from .address import dial, parse_address
from .listener import Listener
from .sockio import recv_exactly, recv_exactly_into, shut_and_close

__all__ = ["Link", "DataPlane", "TcpPlane", "TcpLink", "Rendezvous", "plane_kind", "ucx_status", "MAX_TAG",
           "KINDS", "start_process_plane", "process_plane", "rendezvous", "on_tag"]

#: the longest tag a link may carry
MAX_TAG = 256
KINDS = ("auto", "shm", "tcp", "ucx")
_TAG = struct.Struct("!H")
#: size of one send/recv call on a TCP link: large enough to keep the kernel busy
CHUNK = 4 << 20
#: seconds a link may go without progress before a send or receive fails (env
#: ``MESHARRAY_COLLECTIVE_TIMEOUT``, the bound the shared-memory collectives use too)
LINK_TIMEOUT = float(os.environ.get("MESHARRAY_COLLECTIVE_TIMEOUT", "60"))


class Link(Protocol):
    """One authenticated, full-duplex point-to-point link of a data plane."""

    def send(self, data: memoryview | bytes | bytearray) -> None: ...
    def recv_into(self, view: memoryview) -> None: ...
    def close(self) -> None: ...


class DataPlane(Protocol):
    """A process's endpoint of a data plane: accepts links (``on_link``) and opens them (:meth:`connect`)."""

    kind: str
    address: str

    def connect(self, address: str, tag: bytes, timeout: float = 30.0) -> Link: ...
    def close(self) -> None: ...


# --------------------------------------------------------------------------- TCP
class TcpLink:
    """A data-plane link over one TCP connection (``TCP_NODELAY``, large socket buffers)."""

    __slots__ = ("sock", "peer")

    def __init__(self, sock: socket.socket, peer: str = "") -> None:
        # a peer that goes silent without closing (its host vanished) fails the transfer after
        # this long without a byte, instead of hanging it (the collectives' bound, 60 s)
        sock.settimeout(LINK_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:  # pragma: no cover - best effort
            pass
        self.sock = sock
        self.peer = peer

    def send(self, data) -> None:
        """Send all of ``data`` (the GIL is released while the kernel copies)."""
        view = memoryview(data).cast("B")
        try:
            for off in range(0, view.nbytes, CHUNK):
                self.sock.sendall(view[off:off + CHUNK])
        except OSError as exc:
            raise ConnectionError(f"data link to {self.peer or 'peer'} broke while sending: {exc}") from exc

    def recv_into(self, view: memoryview) -> None:
        """Fill all of ``view`` (``ConnectionError`` if the peer goes away first)."""
        view = memoryview(view).cast("B")
        try:
            recv_exactly_into(self.sock, view)
        except (EOFError, OSError) as exc:
            raise ConnectionError(f"data link to {self.peer or 'peer'} broke while receiving: {exc}") from exc

    def close(self) -> None:
        shut_and_close(self.sock)

    def __repr__(self) -> str:
        return f"TcpLink({self.peer!r})"


class TcpPlane:
    """The built-in data plane: a TCP listener on ``host``; links are authenticated TCP connections.

    Parameters
    ----------
    secret : bytes
        The job secret (links prove it with the HMAC challenge).
    host : str
        Interface to listen on (the host's advertised address; loopback by default).
    on_link : callable
        ``on_link(link, tag)``, called in a new thread for each accepted link.

    Examples
    --------
    >>> import threading
    >>> got = {}
    >>> plane = TcpPlane(b"k" * 32, "127.0.0.1", lambda link, tag: got.setdefault(tag, link))
    >>> link = plane.connect(plane.address, b"hello")
    >>> link.send(b"abc")
    >>> deadline = time.monotonic() + 5
    >>> while b"hello" not in got and time.monotonic() < deadline:
    ...     time.sleep(0.01)
    >>> buf = bytearray(3)
    >>> got[b"hello"].recv_into(memoryview(buf)); bytes(buf)
    b'abc'
    >>> link.close(); got[b"hello"].close(); plane.close()
    """

    kind = "tcp"

    def __init__(self, secret: bytes, host: str, on_link: Callable[[Link, bytes], None]) -> None:
        self.secret = secret
        self.on_link = on_link
        self._listener = Listener(secret, self._on_socket, kind="tcp", host=host)
        self.address = self._listener.address

    def _on_socket(self, sock: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(sock,), name="mesharray-data-link", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(auth.HANDSHAKE_TIMEOUT)
            (n,) = _TAG.unpack(recv_exactly(sock, _TAG.size))
            if n > MAX_TAG:
                raise ValueError(f"tag of {n} bytes; at most {MAX_TAG}")
            tag = recv_exactly(sock, n)
        except (OSError, EOFError, ValueError):
            sock.close()
            return
        try:
            peer = "%s:%s" % sock.getpeername()[:2]
        except OSError:
            peer = ""
        self.on_link(TcpLink(sock, peer), tag)

    def connect(self, address: str, tag: bytes, timeout: float = 30.0) -> TcpLink:
        """Open a link to the plane at ``address``, announcing ``tag``."""
        if len(tag) > MAX_TAG:
            raise ValueError(f"tag of {len(tag)} bytes; at most {MAX_TAG}")
        sock = dial(address, self.secret, timeout)
        try:
            sock.sendall(_TAG.pack(len(tag)) + tag)
        except BaseException:
            sock.close()
            raise
        return TcpLink(sock, address)

    def close(self) -> None:
        self._listener.close()

    def __repr__(self) -> str:
        return f"TcpPlane({self.address!r})"


# --------------------------------------------------------------------------- rendezvous
class Rendezvous:
    """Links accepted by a plane, by tag, until the code that expects them takes them.

    Pass :meth:`put` as (or from) a plane's ``on_link``; :meth:`take` waits for
    the link with a given tag. Links nobody took within ``ttl`` seconds are
    closed when the next one arrives (a peer that gave up must not leak sockets).
    """

    def __init__(self, ttl: float = 300.0) -> None:
        self.ttl = ttl
        self._links: dict[bytes, tuple[Link, float]] = {}
        self._cond = threading.Condition()

    def put(self, link: Link, tag: bytes) -> None:
        now = time.monotonic()
        with self._cond:
            for t, (old, at) in list(self._links.items()):
                if now - at > self.ttl:
                    del self._links[t]
                    old.close()
            prev = self._links.pop(tag, None)
            self._links[tag] = (link, now)
            self._cond.notify_all()
        if prev is not None:
            prev[0].close()

    def take(self, tag: bytes, timeout: float, alive: Callable[[], bool] | None = None) -> Link:
        """The link announced with ``tag``; ``TimeoutError`` after ``timeout`` s (or once ``alive()`` is false)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while tag not in self._links:
                left = deadline - time.monotonic()
                if left <= 0 or (alive is not None and not alive()):
                    raise TimeoutError(f"no data link with tag {tag!r} arrived within {timeout:g} s")
                self._cond.wait(min(left, 0.05))
            return self._links.pop(tag)[0]


# --------------------------------------------------------------------------- the process's plane
_PLANE: DataPlane | None = None
_RENDEZVOUS = Rendezvous()
_HANDLERS: dict[bytes, Callable[[Link, bytes], None]] = {}
_PLANE_LOCK = threading.Lock()


def on_tag(prefix: bytes, handler: Callable[[Link, bytes], None]) -> None:
    """Hand accepted links whose tag starts with ``prefix`` to ``handler`` (else they wait in the rendezvous)."""
    _HANDLERS[prefix] = handler


def _dispatch(link: Link, tag: bytes) -> None:
    for prefix, handler in _HANDLERS.items():
        if tag.startswith(prefix):
            handler(link, tag)
            return
    _RENDEZVOUS.put(link, tag)


def start_process_plane(secret: bytes, host: str, kind: str = "tcp") -> DataPlane:
    """Start this process's data plane (once): its address goes in the worker's hello."""
    global _PLANE
    with _PLANE_LOCK:
        if _PLANE is None:
            if kind == "ucx":
                ucx = importlib.import_module(".ucx", __package__)  # the ucx extra: libucx + _ucp
                _PLANE = ucx.UcxPlane(secret, host, _dispatch)
            else:
                _PLANE = TcpPlane(secret, host, _dispatch)
        return _PLANE


def process_plane() -> DataPlane | None:
    """This process's data plane, if it started one (workers launched by a host agent do)."""
    return _PLANE


def rendezvous() -> Rendezvous:
    """Where accepted links wait for the code that expects them."""
    return _RENDEZVOUS


# --------------------------------------------------------------------------- selection
def ucx_status() -> tuple[bool, str]:
    """Whether the UCX data plane can be used here, and why (for ``info`` and errors)."""
    try:
        ucx = importlib.import_module(".ucx", __package__)  # loads libucx and the compiled _ucp
    except ImportError as exc:
        return False, f"{exc}"
    except Exception as exc:  # a broken install: say what broke
        return False, f"UCX failed to load: {type(exc).__name__}: {exc}"
    return True, f"UCX {ucx.ucx_version()} (compiled plane)"


def plane_kind(requested: str | None = None) -> str:
    """The data plane to use between hosts: ``"tcp"`` or ``"ucx"``, from ``requested`` or the environment.

    ``auto`` (the default) picks UCX when this machine has an RDMA device and
    the UCX plane loads, else TCP (over plain TCP the built-in plane is as
    fast); ``ucx`` without it raises :class:`BootstrapError` naming the
    extra; ``shm``
    is only a choice for one host, and means TCP between hosts.

    Examples
    --------
    >>> plane_kind("tcp")
    'tcp'
    >>> plane_kind("shm")
    'tcp'
    >>> plane_kind("carrier-pigeon")
    Traceback (most recent call last):
    ...
    ValueError: data plane must be one of ('auto', 'shm', 'tcp', 'ucx'), got 'carrier-pigeon'
    """
    kind = (requested or os.environ.get("MESHARRAY_DATA_PLANE") or "auto").lower()
    if kind not in KINDS:
        raise ValueError(f"data plane must be one of {KINDS}, got {kind!r}")
    if kind in ("tcp", "shm"):
        return "tcp"
    if kind == "auto":
        # UCX only where it has RDMA to offer: over plain TCP the built-in plane serves
        # collectives faster (docs/internals.md, "Many hosts": the UCX plane)
        if not _rdma_present():
            return "tcp"
        return "ucx" if ucx_status()[0] else "tcp"
    ok, why = ucx_status()
    if not ok:
        raise BootstrapError(f"data plane 'ucx' requested but {why}")
    return "ucx"


def _rdma_present() -> bool:
    """Whether the kernel lists an RDMA device (checked without loading UCX)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def split_host(address: str) -> str:
    """The host part of a ``tcp:HOST:PORT`` address (for messages)."""
    try:
        return parse_address(address)[1][0]
    except Exception:
        return address
