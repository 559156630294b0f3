"""The UCX data plane: :class:`UcxPlane` and :class:`UcxLink`, over UCP's C API (:mod:`._ucp`).

Same interface and semantics as :class:`~.dataplane.TcpPlane` /
:class:`~.dataplane.TcpLink`: blocking whole-buffer ``send`` / ``recv_into``,
full duplex (one thread sends while another receives on the same link), a
tag announced by the connecting side and handed to ``on_link(link, tag)`` in a
thread of the plane's own, links authenticated with the job secret first. On
top of that, one-sided ``Buffer`` transfers (:meth:`UcxPlane.buffer_transfer`)
and the ring collectives' send/receive loop (:func:`ring_run`) run in C.

The compiled half
-----------------
``mesharray.transport._ucp`` (Cython over ``ucp.h``; the C in
``_ucp_engine.h``) is built by ``setup.py`` wherever the ``libucx`` wheel (the
``ucx`` extra) is installed. Each plane has one UCP context and one worker in
multi-thread mode, and a native progress thread that never takes the GIL. The
thread that waits for a request drives the worker (posting, progress, and when
idle ``ucp_worker_arm`` + ``epoll`` on the worker's event fd, in one ``nogil``
section); other waiting threads sleep on a condition variable of their own
until a pass of the leader completes something. The progress thread leads
only once callers have been quiet for a grace period (2 ms), sleeping in
``epoll`` meanwhile, so an idle process uses no CPU and a busy one does not
pay a thread switch per operation. Whoever leads also serves this process's
registered ``Buffer`` blocks to other processes (below), so those are served
while this process's Python is busy, even holding the GIL.

Links and the handshake
-----------------------
A link starts as a TCP connection to the plane's listener (the address is
``ucx:HOST:PORT``), authenticated with the mutual HMAC challenge of
:mod:`.auth` before a byte of anything else is read. Over that socket the two
sides exchange the tag, their UCP worker addresses and a 48-bit receive id each
(a table slot and 32 random bits); then each creates an endpoint to the
other's worker (``ucp_ep_create`` from the address, error handling mode
``PEER``) and the socket is closed. No UCP endpoint exists before the peer
proved the secret. Messages are tag messages: ``id << 16 | sequence << 8 |
kind``, matched worker-wide, so a message reaches a link only with its
receive id. ``send`` is one tag message; ``recv_into`` probes the link's next
message and receives it straight into the caller's memory (a message longer
than what is asked for keeps its tail for the next call): an ordered byte
stream, as a TCP link. Closing sends a FIN message after the data (tags of one
endpoint arrive in order), then flushes and closes the endpoint; a receiver
learns of a close from the FIN, of a dead peer from UCX's error callback.

Buffers: what one-sided means here
----------------------------------
A registered block is mapped once (``ucp_mem_map``) and its packed remote key
travels only inside the ``Buffer`` handle, next to the token that is checked
before every transfer. Two ways to move the bytes, both without the owner's
Python:

- **RMA** (``ucp_get_nbx`` / ``ucp_put_nbx`` after a ``ucp_get_nbx`` of the
  owner's token word; a put is followed by a flush) where the endpoint has a
  transport that does RMA natively: ``rc``/``dc`` on an InfiniBand or RoCE
  NIC (no CPU of the owner at all), ``cma``/``knem``/``xpmem`` between
  processes of one machine (the kernel copies). With ``ud`` or ``tcp``, UCX
  emulates RMA in software: the *owner's* worker must progress to serve it.
- **Served** (tag messages): a 64-byte request (slot, token, 128-bit secret,
  offset, size) goes to the owner's worker, whose leader — its native progress
  thread when its Python is busy — checks it and answers with the bytes as one
  tag message (a read), or posts a receive into the block and says go (a
  write). Over TCP a read is then one tagged rendezvous, where software RMA
  would need the owner's worker to progress every fragment.

``MESHARRAY_UCX_RMA`` picks: ``auto`` (the default: RMA where it is native,
served otherwise), ``get`` (always RMA: what a NIC runs, testable over TCP)
or ``served``. ``drop()`` of the owner stops serving the block at once and
unmaps it only after the served transfers in flight finished or failed;
hardware RMA to an unmapped block fails at the reader (the NIC refuses the
stale key). Transfers between two processes reuse one link, opened when the
first handle arrives (:meth:`UcxPlane.prepare_link`, in the background) or at
the first transfer: that opening runs the owner's Python (its listener's
handshake), no transfer does.

Configuration
-------------
Before the first engine of the process, :func:`ucx_defaults` sets (only where
the user has not) ``UCX_TLS=tcp`` when the machine has no RDMA device
(``/sys/class/infiniband`` empty) — two host ids on one machine must not take
shared memory, which UCX would pick between processes of one kernel — and 512
KiB TCP segments (``UCX_TCP_RX_SEG_SIZE`` / ``UCX_TCP_TX_SEG_SIZE``). Importing
this module loads the ``libucx`` wheel's libraries (``libucx.load_library``)
and the compiled module, never ``ucxx``; importing :mod:`mesharray` does
neither. Import it before ``mpi4py`` where both are used: Open MPI's pip wheel
bundles an older UCX under the same library names, and whichever loads first
is the one both get.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import socket
import struct
import threading
import weakref
from typing import Any, Callable

from . import auth
from .address import dial, parse_address
from .listener import Listener
from .sockio import recv_exactly

# Read by libucs when it loads: UCX >= 1.19 warns in every process about variables it does not know
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _foreign_ucx() -> list[str]:
    """UCX libraries already mapped into this process from outside the ``libucx`` wheel."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libucs.so" in line}
    except OSError:  # not Linux
        return []
    return sorted(p for p in paths if "/libucx/" not in p)


def _load():
    """Load the wheel's UCX libraries, then the compiled module (``ImportError`` says what is missing)."""
    try:
        import libucx  # the ucx extra: the libucx wheel
    except ImportError as exc:
        raise ImportError(f"the libucx wheel is not installed ({exc}); pip install 'mesharray[ucx]'") from exc
    other = _foreign_ucx()
    if other:
        # Open MPI's pip wheel bundles an older UCX; once mpi4py has loaded it, the wheel's
        # libraries bind to that libucs.so.0 and miss symbols: say so, not just the symbol
        raise OSError(f"cannot load the libucx wheel's UCX: another UCX ({', '.join(other)}) was loaded into "
                      f"this process first, e.g. by mpi4py with Open MPI's wheel; import "
                      f"mesharray.transport.ucx (or call dataplane.ucx_status()) before mpi4py")
    libucx.load_library()
    try:
        from . import _ucp
    except ImportError as exc:
        raise ImportError(f"mesharray's UCX extension (mesharray.transport._ucp) is not built ({exc}): pip install "
                          f"'mesharray[ucx]', then rebuild (python setup.py build_ext --inplace)") from exc
    return _ucp


_ucp = _load()

__all__ = ["UcxPlane", "UcxLink", "ucx_defaults", "parse_ucx_address", "rdma_available", "ring_run",
           "rma_mode", "ucx_version", "describe"]

_TAG = struct.Struct("!H")
_ADDR = struct.Struct("!I")
_ID = struct.Struct("!Q")
#: the longest tag a link may carry: ``dataplane.MAX_TAG`` (not imported: dataplane imports this module)
MAX_TAG = 256
#: the longest UCP worker address a peer may send in the handshake
MAX_ADDRESS = 1 << 16
#: seconds one link send/receive (or Buffer transfer) may take (env ``MESHARRAY_COLLECTIVE_TIMEOUT``, the
#: collectives' bound, as TCP links'; a ring step: without any of its requests completing)
LINK_TIMEOUT = float(os.environ.get("MESHARRAY_COLLECTIVE_TIMEOUT", "60"))
#: links a plane opens for Buffer transfers are tagged with this; the plane keeps them (never ``on_link``)
BUFFER_TAG = b"\x00ucx-buffer"
#: microseconds callers must have been quiet before the progress thread leads (env ``MESHARRAY_UCX_GRACE_US``)
GRACE_US = int(os.environ.get("MESHARRAY_UCX_GRACE_US", "2000"))
#: microseconds a caller waiting for at most 64 KiB polls before it sleeps (env ``MESHARRAY_UCX_SPIN_US``;
#: adaptive: skipped after a run of polls that caught nothing)
SPIN_US = int(os.environ.get("MESHARRAY_UCX_SPIN_US", "25"))
RMA_MODES = ("auto", "get", "served")
#: every engine of this process: closed at exit, before UCX's own destructors run under its progress thread
_ENGINES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_engines() -> None:
    for engine in list(_ENGINES):
        engine.close()


def ucx_version() -> str:
    """The UCX version the plane runs with."""
    return _ucp.version()


def describe() -> dict[str, Any]:
    """What this process's UCX would use (for ``info``): version, ``UCX_TLS``, transports/devices, RMA mode.

    Applies :func:`ucx_defaults` (as a plane would) and starts one engine briefly to ask UCX
    which transport resources it found (``ucp_context_print_info``), limited by ``UCX_TLS``.
    """
    ucx_defaults()
    engine = _ucp.Engine(GRACE_US, SPIN_US, int(LINK_TIMEOUT))
    try:
        resources = engine.resources()
    finally:
        engine.close()
    return {"version": _ucp.version(), "UCX_TLS": os.environ.get("UCX_TLS", "all"), "transports": resources,
            "rma": rma_mode(), "rdma_device": rdma_available()}


def rma_mode(environ=os.environ) -> str:
    """How Buffer transfers move (``MESHARRAY_UCX_RMA``): ``auto``, ``get`` or ``served``.

    Examples
    --------
    >>> rma_mode({}), rma_mode({"MESHARRAY_UCX_RMA": "GET"})
    ('auto', 'get')
    >>> rma_mode({"MESHARRAY_UCX_RMA": "rdma"})
    Traceback (most recent call last):
    ...
    ValueError: MESHARRAY_UCX_RMA must be one of ('auto', 'get', 'served'), got 'rdma'
    """
    mode = environ.get("MESHARRAY_UCX_RMA", "auto").lower()
    if mode not in RMA_MODES:
        raise ValueError(f"MESHARRAY_UCX_RMA must be one of {RMA_MODES}, got {mode!r}")
    return mode


def ucx_defaults(environ=os.environ) -> dict[str, str]:
    """Set the UCX environment defaults this plane is fast with; return what was set.

    Only variables the user has not set are written: ``UCX_TLS=tcp`` where the
    machine has no RDMA device, and 512 KiB TCP segments (UCX receives each
    segment of a rendezvous into a buffer of its own and copies it out of it:
    the segment size is the size of that copy).

    Examples
    --------
    >>> env = {"UCX_TLS": "rc,sm", "UCX_TCP_RX_SEG_SIZE": "1m"}
    >>> sorted(ucx_defaults(env))
    ['UCX_TCP_TX_SEG_SIZE']
    >>> env["UCX_TLS"], env["UCX_TCP_RX_SEG_SIZE"], env["UCX_TCP_TX_SEG_SIZE"]
    ('rc,sm', '1m', '512k')
    """
    want = {"UCX_TCP_RX_SEG_SIZE": "512k", "UCX_TCP_TX_SEG_SIZE": "512k"}
    if not rdma_available():
        want["UCX_TLS"] = "tcp"
    done = {}
    for key, value in want.items():
        if key not in environ:
            environ[key] = value
            done[key] = value
    return done


def rdma_available() -> bool:
    """Whether this machine has an RDMA device (``/sys/class/infiniband`` lists one).

    Without one, UCX runs over TCP; ``auto`` (:func:`~.dataplane.plane_kind`)
    then keeps the built-in TCP plane.
    """
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def parse_ucx_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``ucx:HOST:PORT`` address.

    Examples
    --------
    >>> parse_ucx_address("ucx:10.0.0.7:26601")
    ('10.0.0.7', 26601)
    >>> parse_ucx_address("tcp:10.0.0.7:26601")
    Traceback (most recent call last):
    ...
    ValueError: bad ucx address 'tcp:10.0.0.7:26601'; expected 'ucx:HOST:PORT'
    """
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, got {type(address).__name__}")
    host, _, port = address[4:].rpartition(":")
    if not address.startswith("ucx:") or not host or not port.isdigit():
        raise ValueError(f"bad ucx address {address!r}; expected 'ucx:HOST:PORT'")
    return host.strip("[]"), int(port)


def _tcp_address(address: str) -> str:
    """The listener's ``tcp:HOST:PORT`` for a ``ucx:HOST:PORT`` address.

    Examples
    --------
    >>> _tcp_address("ucx:127.0.0.3:7"), _tcp_address("ucx:[::1]:7")
    ('tcp:127.0.0.3:7', 'tcp:[::1]:7')
    """
    host, port = parse_ucx_address(address)
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"tcp:[{host}]:{port}" if v6 else f"tcp:{host}:{port}"


def _recv_msg(sock: socket.socket, head: struct.Struct, limit: int, what: str) -> bytes:
    (n,) = head.unpack(recv_exactly(sock, head.size))
    if n > limit:
        raise ValueError(f"{what} of {n} bytes; at most {limit}")
    return recv_exactly(sock, n) if n else b""


# --------------------------------------------------------------------------- link
class UcxLink:
    """A data-plane link over a pair of UCP endpoints (tag messages read as an ordered byte stream)."""

    def __init__(self, native, peer: str = "") -> None:
        self._native = native
        self.peer = peer
        self._closed = False

    def send(self, data) -> None:
        """Send all of ``data`` as one message (blocks until UCX is done with it: a large one until
        the peer receives it; the GIL is released meanwhile)."""
        self._move(self._native.send, data)

    def recv_into(self, view) -> None:
        """Fill all of ``view`` (``ConnectionError`` if the peer goes away first, or after
        :data:`LINK_TIMEOUT` seconds without data)."""
        self._move(self._native.recv_into, view)

    def _move(self, op, data) -> None:
        """``op(bytes, timeout)`` (the native link's send or recv_into) on all of ``data``, its errors
        as a TcpLink's: ``ConnectionError`` naming the peer, a timeout included."""
        view = memoryview(data).cast("B")
        if self._closed:
            raise ConnectionError(f"data link to {self.peer or 'peer'} is closed")
        if view.nbytes:
            try:
                op(view, LINK_TIMEOUT)
            except (ConnectionError, TimeoutError) as exc:
                raise ConnectionError(f"data link to {self.peer or 'peer'}: {exc}") from None

    @property
    def broken(self) -> bool:
        """Whether the link failed or was closed, here or by the peer."""
        return self._closed or self._native.broken or self._native.peer_closed

    #: the reductions :meth:`ring_run` does in C (``dtype.str`` without the byte order)
    ring_dtypes = frozenset(_ucp.DTYPES)

    def ring_run(self, left: UcxLink, steps, dtype: str = "u1", op: str = "sum", chunk: int = 1 << 20) -> None:
        """Run a ring collective's plan in C with this link as the right one (see :func:`ring_run`)."""
        ring_run(self, left, steps, dtype, op, chunk)

    def transports(self) -> list[str]:
        """The UCP transports and devices of this link's endpoint, e.g. ``['tcp/eth0']``."""
        return [] if self._closed else self._native.transports()

    def close(self) -> None:
        """Close the link: what was sent still arrives (FIN after it, then a flush)."""
        if not self._closed:
            self._closed = True
            self._native.close()

    def __repr__(self) -> str:
        return f"UcxLink({self.peer!r})"


def ring_run(right: UcxLink, left: UcxLink, steps, dtype: str, op: str, chunk: int) -> None:
    """Run a ring collective's plan in C (``_ucp.ring_run``): no Python, no GIL, per chunk.

    ``steps`` is a ``(n, 4)`` uint64 array of ``(address, nbytes, flags, source)``; ``dtype`` a
    NumPy ``dtype.str`` without the byte order (``"f4"``), ``op`` one of ``sum``,
    ``prod``, ``min``, ``max``.
    """
    _ucp.ring_run(right._native, left._native, steps, _ucp.DTYPES[dtype], _ucp.OPS[op], chunk, LINK_TIMEOUT)


#: the ring's reductions that run in C (``dtype.str[1:]`` of native-order dtypes)
RING_DTYPES = frozenset(_ucp.DTYPES)


# --------------------------------------------------------------------------- plane
class UcxPlane:
    """The UCX data plane: a TCP listener for the handshake; links are pairs of UCP endpoints.

    Parameters
    ----------
    secret : bytes
        The job secret (links prove it with the HMAC challenge of :mod:`.auth`).
    host : str
        The interface the handshake listener binds (the host's advertised address).
    on_link : callable
        ``on_link(link, tag)``, called in a new thread for each accepted, authenticated link.

    Examples
    --------
    :class:`~.dataplane.TcpPlane`'s example runs as is with ``UcxPlane`` in its place (the planes are
    interchangeable); here the accepting side waits on an event instead of polling:

    >>> import threading
    >>> accepted, got = threading.Event(), {}
    >>> def on_link(link, tag):
    ...     got[tag] = link
    ...     accepted.set()
    >>> plane = UcxPlane(b"k" * 32, "127.0.0.1", on_link)
    >>> link = plane.connect(plane.address, b"hello"); link.send(b"abc")
    >>> accepted.wait(5), got[b"hello"].recv_into(memoryview(buf := bytearray(3))), bytes(buf)
    (True, None, b'abc')
    >>> link.close(); got[b"hello"].close(); plane.close()
    """

    kind = "ucx"

    def __init__(self, secret: bytes, host: str, on_link: Callable[[UcxLink, bytes], None]) -> None:
        ucx_defaults()
        self.secret = secret
        self.on_link = on_link
        self._engine = _ucp.Engine(GRACE_US, SPIN_US, int(LINK_TIMEOUT))
        _ENGINES.add(self._engine)
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._closed = False
        self._links: set[UcxLink] = set()   # links held by the plane: Buffer links, both ends
        self._to: dict[str, UcxLink] = {}   # this process's Buffer link per owner plane
        self._preparing: set[str] = set()   # owner planes a link is being opened to (prepare_link)
        self._token_rkey: bytes | None = None
        self._listener = Listener(secret, self._on_socket, kind="tcp", host=host)
        h, p = parse_address(self._listener.address)[1][:2]
        self.address = f"ucx:[{h}]:{p}" if ":" in h else f"ucx:{h}:{p}"

    # -- handshake ------------------------------------------------------------------
    def _on_socket(self, sock: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(sock,), name="mesharray-ucx-link", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            with sock:
                sock.settimeout(auth.HANDSHAKE_TIMEOUT)
                tag = _recv_msg(sock, _TAG, MAX_TAG, "tag")
                addr = _recv_msg(sock, _ADDR, MAX_ADDRESS, "worker address")
                (send_id,) = _ID.unpack(recv_exactly(sock, _ID.size))
                native = self._engine.new_link(secrets.randbits(32))
                native.connect(addr, send_id)
                me = self._engine.address
                sock.sendall(_ADDR.pack(len(me)) + me + _ID.pack(native.recv_id))
                try:
                    peer = "%s:%s" % sock.getpeername()[:2]
                except OSError:
                    peer = ""
        except (OSError, EOFError, ValueError, ConnectionError):
            return  # a broken or refused peer: nothing was created for it, or its link just closes
        link = UcxLink(native, peer)
        if tag == BUFFER_TAG:
            with self._lock:
                self._links = {k for k in self._links if not k.broken}
                self._links.add(link)  # the engine serves Buffer requests on it, in C
            return
        self.on_link(link, tag)

    def connect(self, address: str, tag: bytes, timeout: float = 30.0, retry: bool = True) -> UcxLink:
        """Open a link to the plane at ``address`` (``ucx:HOST:PORT``), announcing ``tag``.

        A refused connection is retried until ``timeout`` (a peer still starting) unless ``retry``
        is false (a peer known to have listened: refused means gone).
        """
        if len(tag) > MAX_TAG:
            raise ValueError(f"tag of {len(tag)} bytes; at most {MAX_TAG}")
        sock = dial(_tcp_address(address), self.secret, timeout, retry, name=address)
        try:
            # the workers' addresses and link ids, over the authenticated socket; then UCP only
            native = self._engine.new_link(secrets.randbits(32))
            me = self._engine.address
            sock.sendall(_TAG.pack(len(tag)) + tag + _ADDR.pack(len(me)) + me + _ID.pack(native.recv_id))
            addr = _recv_msg(sock, _ADDR, MAX_ADDRESS, "worker address")
            (send_id,) = _ID.unpack(recv_exactly(sock, _ID.size))
            native.connect(addr, send_id)
            return UcxLink(native, address)
        except EOFError as exc:
            raise ConnectionError(f"cannot open a data link to {address}: the listener closed the "
                                  f"connection during the handshake") from exc
        except socket.timeout as exc:
            raise ConnectionError(f"cannot open a data link to {address}: {exc} during the handshake") from exc
        finally:
            sock.close()

    # -- Buffer ---------------------------------------------------------------------
    def register_block(self, slot: int, addr: int, nbytes: int, readonly: bool, token: int, token_word: int,
                       secret: bytes) -> bytes:
        """Map a registered block (``ucp_mem_map``) and serve it; return its packed remote key."""
        return self._engine.register(slot, addr, nbytes, readonly, token, token_word, secret)

    def unregister_block(self, slot: int, timeout: float = 5.0) -> bool:
        """Stop serving ``slot``; unmap it once the transfers in flight finished or failed (False: not yet)."""
        return self._engine.unregister(slot, timeout)

    def token_rkey(self, addr: int, nbytes: int) -> bytes:
        """The packed remote key of the owner's token table (mapped once)."""
        with self._lock:
            if self._token_rkey is None:
                self._token_rkey = self._engine.token_table(addr, nbytes)
            return self._token_rkey

    def _buffer_link(self, address: str) -> UcxLink:
        with self._lock:
            link = self._to.get(address)
        if link is not None and not link.broken:
            return link
        with self._connecting:  # one link per owner, even when several threads start at once
            with self._lock:
                link = self._to.get(address)
            if link is not None and not link.broken:
                return link
            # the owner's plane listened before any handle left its process: refused means it is gone
            new = self.connect(address, BUFFER_TAG, timeout=LINK_TIMEOUT, retry=False)
            with self._lock:
                self._to[address] = new
        if link is not None:
            link.close()  # (broken)
        return new

    def prepare_link(self, address: str) -> None:
        """Open the Buffer link to the plane at ``address`` in a background thread, unless one is open
        or opening (errors are left to the first transfer, which tries again)."""
        with self._lock:
            if address in self._preparing or (address in self._to and not self._to[address].broken):
                return
            self._preparing.add(address)

        def run() -> None:
            try:
                self._buffer_link(address)
            except Exception:  # pragma: no cover - the first transfer says why
                pass
            finally:
                with self._lock:
                    self._preparing.discard(address)

        threading.Thread(target=run, name="mesharray-ucx-prepare", daemon=True).start()

    def buffer_transfer(self, address: str, handle: dict, op: int, local: int, nbytes: int) -> int:
        """Read (``op`` 0) into, or write (1) from, ``nbytes`` at ``local``, or drop (2), a block
        of the plane at ``address``; ``handle`` carries slot, token, secret and the remote keys.

        Returns 0, or 1 when the owner no longer has the block. The owner's Python never runs
        (after the first transfer between the two processes, which opens their link).
        """
        link = self._buffer_link(address)
        use_rma = handle.get("rkey") is not None and (
            rma_mode() == "get" or (rma_mode() == "auto" and link._native.rma_native))
        try:
            if use_rma:
                return link._native.buffer_rma(op, handle["token"], handle["token_addr"], handle["token_rkey"],
                                               handle["addr"], handle["rkey"], local, nbytes, LINK_TIMEOUT)
            return link._native.buffer_served(op, handle["slot"], handle["token"], handle["secret"], 0, local, nbytes,
                                              LINK_TIMEOUT)
        except ConnectionError:
            if link.broken:
                with self._lock:
                    if self._to.get(address) is link:
                        del self._to[address]
                link.close()
            raise

    @property
    def served(self) -> int:
        """Buffer requests of other processes this plane answered (in C)."""
        return self._engine.served

    def transports(self) -> list[str]:
        """The UCP transports/devices of this plane's live links (``info`` shows them)."""
        with self._lock:
            links = list(self._links) + list(self._to.values())
        return sorted({t for link in links for t in link.transports()})

    def close(self) -> None:
        """Stop accepting, and close every link this plane opened or accepted."""
        if self._closed:
            return
        self._closed = True
        self._listener.close()
        with self._lock:
            links = list(self._links) + list(self._to.values())
            self._links.clear()
            self._to.clear()
        for link in links:
            link.close()
        self._engine.close()

    def __repr__(self) -> str:
        return f"UcxPlane({self.address!r})"
