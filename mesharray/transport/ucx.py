"""The UCX data plane: :class:`UcxPlane` and :class:`UcxLink`, over ``ucxx`` (the ``ucx`` extra).

Same interface and semantics as :class:`~.dataplane.TcpPlane` /
:class:`~.dataplane.TcpLink`: blocking whole-buffer ``send`` / ``recv_into``,
full duplex (one thread sends while another receives on the same link), a
tag announced by the connecting side and handed to ``on_link(link, tag)`` in a
thread of the plane's own, links authenticated with the job secret first
(:mod:`.auth`'s challenge, over the endpoint's stream, before its tag is read).

ucxx's low-level API is driven from plain threads, without asyncio: one UCX
worker per plane in blocking progress mode, and the **thread that waits drives
the progress** (leader/follower). The leader runs ``ucp_worker_progress``; for a
request of at most 64 KiB it first polls for up to ``MESHARRAY_UCX_SPIN_US``
(adaptive: skipped while spins keep missing), then arms the worker and sleeps
in ``epoll`` on its event fd. Other waiters sleep on an event of their own, set
when their request is done or the lead is theirs; a background thread takes
the lead when no caller has for a few milliseconds. Links use UCX's *stream*
API (a per-endpoint ordered byte stream: ``TcpLink``'s semantics, and nothing
another endpoint can match). :func:`ucx_defaults` sets UCX's environment before
the first context (``UCX_TLS=tcp`` without an RDMA device, 4 MiB TCP segments,
``UCXX_LOG_LEVEL=FATAL``). Addresses look like ``ucx:HOST:PORT``.

Importing this module imports ``ucxx``; importing :mod:`mesharray` never does.
Import it before ``mpi4py`` where both are used: Open MPI's pip wheel bundles an
older UCX under the same library names, and whichever loads first is the one
both get. Why this design, what it costs (every ucxx call releases the GIL; a
stream has no flow control; the listener binds every interface) and what it was
measured against: ``docs/internals.md``, "Many hosts" ("The UCX plane").
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import select
import struct
import threading
import time
import weakref
from typing import Callable

from ..errors import AuthenticationError
from . import auth

# Read by libucs when ucxx loads it, so it must be set before the import: ucxx itself sets
# UCX_MEMTYPE_CACHE, which UCX >= 1.19 no longer knows and warns about in every process.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _foreign_ucx() -> list[str]:
    """UCX libraries already mapped into this process from outside the ``libucx`` wheel."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libucs.so" in line}
    except OSError:  # not Linux
        return []
    return sorted(p for p in paths if "/libucx/" not in p)


try:
    import ucxx._lib.libucxx as _ucx
    from ucxx._lib.arr import Array
except OSError as _exc:
    # Seen here: Open MPI's pip wheel bundles an older UCX; once mpi4py has loaded it, the
    # wheel's libuct.so binds to that libucs.so.0 and misses symbols. Say so, not just the symbol.
    _other = _foreign_ucx()
    if not _other:
        raise
    raise OSError(f"ucxx cannot load its UCX: another UCX ({', '.join(_other)}) was loaded into this "
                  f"process first, e.g. by mpi4py with Open MPI's wheel; import mesharray.transport.ucx "
                  f"(or call dataplane.ucx_status()) before mpi4py ({_exc})") from _exc

__all__ = ["UcxPlane", "UcxLink", "ucx_defaults", "parse_ucx_address", "rdma_available"]

_TAG = struct.Struct("!H")
#: the longest tag a link may carry: ``dataplane.MAX_TAG`` (not imported: dataplane imports this module)
MAX_TAG = 256
#: seconds a leader sleeps in epoll before it looks around again (a safety net, not a poll)
_POLL_S = 0.5
#: seconds a waiting thread polls before it sleeps in epoll (env ``MESHARRAY_UCX_SPIN_US``)
SPIN_S = float(os.environ.get("MESHARRAY_UCX_SPIN_US", "25")) * 1e-6
#: the largest request that spins (a large transfer is better served asleep: the cores copy the data)
SPIN_MAX = 64 << 10
#: how often a waiter asks UCX whether the endpoint is alive (its close callback usually says first)
_ALIVE_EVERY_S = 0.25
#: how long the idle progress thread lets callers come back before it takes the lead
_IDLE_GRACE_S = 0.005
#: after a peer failure, how long a waiter lets UCX cancel its request before it raises anyway
_CANCEL_GRACE_S = 2.0
#: a link whose last sends went unanswered waits before it closes (see _linger) until its peer
#: closed, or UCX made no progress for LINGER_IDLE_S, or LINGER_MAX_S passed
LINGER_IDLE_S = 0.05
LINGER_MAX_S = 2.0


def ucx_defaults(environ=os.environ) -> dict[str, str]:
    """Set the UCX environment defaults this plane is fast with; return what was set.

    Only variables the user has not set are written: ``UCX_TLS=tcp`` where the
    machine has no RDMA device, 4 MiB TCP segments, and ucxx's own log at FATAL.

    Examples
    --------
    >>> env = {"UCX_TLS": "rc,sm", "UCX_TCP_RX_SEG_SIZE": "1m"}
    >>> sorted(ucx_defaults(env))
    ['UCXX_LOG_LEVEL', 'UCX_TCP_TX_SEG_SIZE']
    >>> env["UCX_TLS"], env["UCX_TCP_RX_SEG_SIZE"], env["UCX_TCP_TX_SEG_SIZE"]
    ('rc,sm', '1m', '4m')
    """
    # ucxx logs every endpoint failure at ERROR on stderr; here a peer that goes away is
    # a ConnectionError raised to the caller, with UCX's reason in its message
    want = {"UCX_TCP_RX_SEG_SIZE": "4m", "UCX_TCP_TX_SEG_SIZE": "4m", "UCXX_LOG_LEVEL": "FATAL"}
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

    Without one, UCX runs over TCP, where two threads driving links at once (a ring
    collective's sender and receiver) contend for the GIL that every ucxx call releases,
    and the built-in TCP plane serves collectives faster; so an automatic choice of plane
    picks UCX only where this is true (``docs/internals.md``, "Many hosts").
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


def _dial_host(host: str) -> str:
    """The address to connect to for ``host``: ``127.0.0.1`` for any loopback address.

    UCX's TCP transport looks up the network device that holds the address a connection
    request arrived on; the loopback device holds 127.0.0.1 only, so a connection to
    127.0.0.3 (how tests run several "hosts" on one machine) is refused as "not
    connected". Every 127.x address reaches the same listener, which binds all interfaces.

    Examples
    --------
    >>> _dial_host("127.0.0.3"), _dial_host("10.1.2.3"), _dial_host("node7")
    ('127.0.0.1', '10.1.2.3', 'node7')
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if ip.is_loopback:
        return "127.0.0.1" if ip.version == 4 else "::1"
    return host


# --------------------------------------------------------------------------- progress
class _Follower:
    """A thread waiting while another leads: woken when ``done()`` or to take the lead."""

    __slots__ = ("done", "woken")

    def __init__(self, done: Callable[[], bool]) -> None:
        self.done = done
        self.woken = threading.Event()


class _Engine:
    """One UCX context and worker in blocking mode, progressed by whichever thread waits."""

    def __init__(self) -> None:
        ucx_defaults()
        self.context = _ucx.UCXContext(
            feature_flags=(_ucx.Feature.STREAM, _ucx.Feature.TAG, _ucx.Feature.WAKEUP))
        self.worker = _ucx.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._lock = threading.Lock()
        self._leader = False
        self._waiters = 0     # callers inside wait()
        self._followers: list[_Follower] = []  # callers asleep while another leads
        self._activity = 0    # bumps on every wait(): the idle thread's sign that callers are busy
        self.links: weakref.WeakSet[UcxLink] = weakref.WeakSet()
        self._spin_hits = 1.0  # moving average: how often a spin caught the answer
        self.progressed = 0  # progress passes that did something (a lingering close watches it)
        self._spin_probe = 0
        self.closed = False
        self._idle = threading.Thread(target=self._idle_loop, name="mesharray-ucx-progress", daemon=True)
        self._idle.start()

    def kick(self) -> None:
        """Wake the leader out of epoll (a request was posted, or a link failed)."""
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:  # pragma: no cover - closed during shutdown
            pass

    def _pass(self, timeout: float, spin: float = 0.0) -> None:
        """One progress pass; sleep in epoll (at most ``timeout`` s) if there was nothing to do.

        With ``spin``, keep polling that many seconds before sleeping: an answer that is
        already on its way comes back without the epoll wake-up's latency.
        """
        worker = self.worker
        if worker.progress_once():
            while worker.progress_once():
                pass
            self.progressed += 1
            return
        if spin and (self._spin_hits >= 0.3 or not self._spin_probe & 31):
            # Adaptive: a spin that keeps missing (the peer is slow, or the cores are busy and
            # spinning would steal the peer's) is skipped, and retried every 32nd pass.
            self._spin_probe += 1
            end = time.perf_counter() + spin
            hit = False
            while time.perf_counter() < end:
                if worker.progress_once():
                    hit = True
                    break
            self._spin_hits = 0.75 * self._spin_hits + 0.25 * hit
            if hit:
                while worker.progress_once():
                    pass
                self.progressed += 1
                return
        elif spin:
            self._spin_probe += 1
        if not worker.arm():  # events pending: progress again at once
            return
        if self._epoll.poll(timeout):
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass

    def wait(self, done: Callable[[], bool], deadline: float | None = None, spin: float = 0.0) -> bool:
        """Progress (or let the leader progress) until ``done()``; ``False`` if ``deadline`` passed first.

        ``spin``: seconds to poll before each sleep in epoll (small messages: see :meth:`_pass`).
        """
        lock = self._lock
        me: _Follower | None = None
        kicked = False
        with lock:
            self._waiters += 1
            self._activity += 1
        try:
            while True:
                if done():
                    return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                left = _POLL_S if deadline is None else min(_POLL_S, deadline - now)
                with lock:
                    lead = not self._leader
                    if lead:
                        self._leader = True
                    else:
                        if me is None:
                            me = _Follower(done)
                        me.woken.clear()
                        self._followers.append(me)
                        if not kicked:  # the leader may be asleep in epoll: it must see our request
                            self.kick()
                            kicked = True
                if not lead:
                    assert me is not None
                    if not me.woken.wait(left):
                        with lock:
                            if me in self._followers:
                                self._followers.remove(me)
                    continue
                try:
                    while not done():
                        self._pass(left, spin)
                        if self._followers:  # racy read: a follower missed here waits left s at most
                            self._wake_followers(False)
                        if deadline is not None and time.monotonic() >= deadline:
                            break
                finally:
                    self._step_down()
        finally:
            with lock:
                self._waiters -= 1

    def _wake_followers(self, hand_over: bool) -> None:
        """Wake the followers whose requests are done; with ``hand_over``, one more to lead."""
        with self._lock:
            keep = []
            for f in self._followers:
                if f.done():
                    f.woken.set()
                elif hand_over:
                    f.woken.set()
                    hand_over = False
                else:
                    keep.append(f)
            self._followers[:] = keep

    def _step_down(self) -> None:
        with self._lock:
            self._leader = False
        if self._followers:
            self._wake_followers(True)

    def _idle_loop(self) -> None:
        # Not a follower: waking it at every hand-over would cost each operation a thread
        # switch. It looks every few ms whether callers went quiet, and then leads.
        lock = self._lock
        seen = -1
        while not self.closed:
            with lock:
                idle = not (self._leader or self._waiters) and self._activity == seen
                seen = self._activity
                if idle:
                    self._leader = True
            if not idle:
                time.sleep(_IDLE_GRACE_S)
                continue
            try:
                self._pass(_POLL_S)
            except Exception:  # pragma: no cover - keep serving; the failing link reports its own error
                pass
            finally:
                self._step_down()

    def close(self) -> None:
        """Close every link of this engine and stop the idle thread.

        The file descriptors are closed with the engine object (:meth:`__del__`), not here: a
        thread may still be inside ``kick()``, and a closed descriptor number can be reused.
        """
        links = list(self.links)
        _linger(self, [link for link in links if link._unanswered() and not link._closed])
        for link in links:
            link.close(linger=False)
        self.closed = True
        self.kick()
        if self._idle is not threading.current_thread():
            self._idle.join(timeout=2 * _POLL_S + 1)

    def __del__(self) -> None:
        try:
            self._epoll.close()
            os.close(self._wake_fd)
        except (AttributeError, OSError):  # pragma: no cover - half-built
            pass


# --------------------------------------------------------------------------- link
class UcxLink:
    """A data-plane link over one UCX endpoint (stream API: an ordered byte stream, like TCP)."""

    def __init__(self, engine: _Engine, endpoint, peer: str = "") -> None:
        self._engine = engine
        self._ep = endpoint
        self.peer = peer
        self._error: str | None = None
        self._closed = False
        self._orphans: list = []  # (request, buffer) pairs given up on but not yet cancelled
        # sends completed, and how many of them the peer had provably read: those done before a
        # receive was posted that then completed (it answered them). A close with sends beyond
        # that lingers (see _linger): a request/answer link's asking side closes at once
        self._sends = 0
        self._answered = 0
        self._alive_checked = 0.0
        endpoint.set_close_callback(self._on_close)
        engine.links.add(self)

    def _on_close(self, *args) -> None:
        # runs inside a progress pass, in whichever thread leads: mark and wake, nothing more
        if self._error is None:
            self._error = "closed" if self._closed else "the peer closed the link or went away"
        self._engine.kick()

    def _broken(self) -> bool:
        # The close callback sets _error; ``ep.alive`` is the fallback. It is asked rarely:
        # every call into ucxx releases the GIL, and with a second busy thread in the
        # process (a ring's sender) each release can cost a GIL hand-over of tens of µs.
        if self._error is not None:
            return True
        now = time.monotonic()
        if now - self._alive_checked < _ALIVE_EVERY_S:
            return False
        self._alive_checked = now
        return not self._ep.alive

    def _run(self, post, view, what: str, deadline: float | None = None) -> None:
        peer = self.peer or "peer"
        if self._closed or self._engine.closed:
            raise ConnectionError(f"data link to {peer} is closed")
        if self._broken():
            raise ConnectionError(f"data link to {peer} broke before {what}: {self._error or 'endpoint error'}")
        try:
            req = post(Array(view))
        except Exception as exc:  # ucxx raises on a dead endpoint
            raise ConnectionError(f"data link to {peer} broke while {what}: {exc}") from exc
        engine = self._engine
        failed_at: list[float] = []

        def done() -> bool:
            if req.completed:
                return True
            if self._broken():
                now = time.monotonic()
                if not failed_at:
                    failed_at.append(now)
                return now - failed_at[0] > _CANCEL_GRACE_S
            return False

        try:
            finished = engine.wait(done, deadline, SPIN_S if view.nbytes <= SPIN_MAX else 0.0)
        except (OSError, ValueError) as exc:  # the plane was closed under us (its epoll is gone)
            raise ConnectionError(f"data link to {peer} closed while {what}") from exc
        if not finished:
            self._abort()
            if not req.completed:
                self._orphans.append((req, view))
            raise TimeoutError(f"data link to {peer}: {what} not finished in time")
        if not req.completed:
            # UCX has not let go of the buffer yet: keep it alive until close() cancels the request
            self._orphans.append((req, view))
            raise ConnectionError(f"data link to {peer} broke while {what}: {self._error}")
        try:
            req.check_error()
        except Exception as exc:
            why = f"{self._error} ({exc})" if self._error else str(exc)
            raise ConnectionError(f"data link to {peer} broke while {what}: {why}") from exc

    def send(self, data) -> None:
        """Send all of ``data`` (blocks until UCX has taken it; the GIL is released meanwhile)."""
        view = memoryview(data).cast("B")
        if view.nbytes:
            self._run(self._ep.stream_send, view, "sending")
            self._sends += 1

    def recv_into(self, view: memoryview) -> None:
        """Fill all of ``view`` (``ConnectionError`` if the peer goes away first)."""
        view = memoryview(view).cast("B")
        if view.nbytes:
            sends = self._sends
            self._run(self._ep.stream_recv, view, "receiving")
            if sends > self._answered:
                self._answered = sends

    # handshake helpers: the same calls, with a deadline
    def _send_before(self, data: bytes, deadline: float) -> None:
        self._run(self._ep.stream_send, memoryview(data), "handshaking", deadline)

    def _recv_before(self, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        self._run(self._ep.stream_recv, memoryview(buf), "handshaking", deadline)
        return bytes(buf)

    def _abort(self) -> None:
        if self._error is None:
            self._error = "aborted"
        self.close()

    def _unanswered(self) -> bool:
        # a send the peer may not have read yet (see _sends), on a link still up
        return self._sends > self._answered and self._error is None

    def close(self, linger: bool = True) -> None:
        """Close the link; one whose last sends went unanswered first lets them reach the peer
        (:func:`_linger`)."""
        if self._closed:
            return
        if linger and self._unanswered() and not self._engine.closed:
            _linger(self._engine, [self])
        self._closed = True
        self._engine.links.discard(self)
        try:
            # cancels this endpoint's requests (their waiters raise ConnectionError), then closes it
            self._ep.close_blocking(period=1_000_000_000, max_attempts=1)
        except Exception:  # pragma: no cover - already broken
            pass
        self._orphans = [(req, view) for req, view in self._orphans if not req.completed]
        try:
            self._ep.remove_close_callback()  # the callback holds the link: no cycle left for the GC
        except Exception:  # pragma: no cover
            pass
        if not self._engine.closed:
            self._engine.kick()

    def __repr__(self) -> str:
        return f"UcxLink({self.peer!r})"


def _linger(engine: _Engine, links: list) -> None:
    """Let what ``links`` sent reach their peers before they close: until each peer closed its end,
    or UCX made no progress for :data:`LINGER_IDLE_S`, or :data:`LINGER_MAX_S` passed.

    A UCX stream send is complete once UCX has taken the buffer, not once the peer has it, and
    ucxx closes an endpoint with error handling (what this plane makes, to hear of dead peers)
    by force: the close could cut off the tail of the data (the peer's receive ended short,
    "length mismatch"). A peer that got what it wanted closes its end, which ends the wait at
    once; a peer that closes nothing (both sides closing at once) costs one idle window. A
    link whose sends were all answered (a request whose answer came) closes without waiting.
    """
    if not links:
        return
    end = time.monotonic() + LINGER_MAX_S
    seen, quiet_since = engine.progressed, time.monotonic()
    while any(link._error is None for link in links):
        now = time.monotonic()
        if now >= end or now - quiet_since >= LINGER_IDLE_S:
            return
        try:  # (short steps: a progress pass with nothing to do sleeps until its deadline)
            engine.wait(lambda: all(link._error is not None for link in links), min(end, now + 0.005))
        except (OSError, ValueError):  # the engine was closed under us
            return
        if engine.progressed != seen:
            seen, quiet_since = engine.progressed, time.monotonic()


# --------------------------------------------------------------------------- plane
class UcxPlane:
    """The UCX data plane: a ucxx listener; links are authenticated UCX endpoints.

    Parameters
    ----------
    secret : bytes
        The job secret (links prove it with the HMAC challenge of :mod:`.auth`).
    host : str
        The address other hosts reach this one at (the listener binds every interface).
    on_link : callable
        ``on_link(link, tag)``, called in a new thread for each accepted, authenticated link.

    Examples
    --------
    >>> got = {}
    >>> plane = UcxPlane(b"k" * 32, "127.0.0.1", lambda link, tag: got.setdefault(tag, link))
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

    kind = "ucx"

    def __init__(self, secret: bytes, host: str, on_link: Callable[[UcxLink, bytes], None]) -> None:
        self.secret = secret
        self.on_link = on_link
        self._engine = _Engine()
        self._listener = _ucx.UCXListener.create(self._engine.worker, 0, self._on_endpoint, deliver_endpoint=True)
        self.address = f"ucx:{host}:{self._listener.port}"
        self._closed = False

    def _on_endpoint(self, endpoint) -> None:
        # Inside a progress pass: the handshake blocks, so it gets a thread of its own, and so
        # does a refusal (closing an endpoint progresses the worker, which a callback may not).
        threading.Thread(target=self._serve, args=(endpoint,), name="mesharray-ucx-link", daemon=True).start()

    def _serve(self, endpoint) -> None:
        link = UcxLink(self._engine, endpoint)
        if self._closed:
            link.close()
            return
        deadline = time.monotonic() + auth.HANDSHAKE_TIMEOUT
        try:
            ns = os.urandom(auth.NONCE)
            link._send_before(auth.MAGIC + ns, deadline)
            answer = auth._server_answer(self.secret, ns, link._recv_before(auth.CLIENT_MSG, deadline))
            link._send_before(answer, deadline)
            (n,) = _TAG.unpack(link._recv_before(_TAG.size, deadline))
            if n > MAX_TAG:
                raise ValueError(f"tag of {n} bytes; at most {MAX_TAG}")
            tag = link._recv_before(n, deadline) if n else b""
        except Exception:  # a refused or broken peer (AuthenticationError is a ConnectionError): drop it
            link.close()
            return
        self.on_link(link, tag)

    def connect(self, address: str, tag: bytes, timeout: float = 30.0) -> UcxLink:
        """Open a link to the plane at ``address`` (``ucx:HOST:PORT``), announcing ``tag``."""
        if len(tag) > MAX_TAG:
            raise ValueError(f"tag of {len(tag)} bytes; at most {MAX_TAG}")
        host, port = parse_ucx_address(address)
        host = _dial_host(host)
        deadline = time.monotonic() + timeout
        while True:
            link = None
            try:
                endpoint = _ucx.UCXEndpoint.create(self._engine.worker, host, port, True)
                link = UcxLink(self._engine, endpoint, address)
                self._client_handshake(link, min(deadline, time.monotonic() + auth.HANDSHAKE_TIMEOUT))
                link._send_before(_TAG.pack(len(tag)) + tag, deadline)
                return link
            except AuthenticationError:
                if link is not None:
                    link.close()
                raise
            except (ConnectionError, TimeoutError, _ucx.UCXError) as exc:
                if link is not None:
                    link.close()
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"cannot open a data link to {address}: {exc}") from exc
                time.sleep(0.02)

    def _client_handshake(self, link: UcxLink, deadline: float) -> None:
        msg = link._recv_before(4 + auth.NONCE, deadline)
        if msg[:4] != auth.MAGIC:
            raise AuthenticationError(f"bad handshake magic {msg[:4]!r}; expected {auth.MAGIC!r}")
        ns = msg[4:]
        nc = os.urandom(auth.NONCE)
        link._send_before(auth.MAGIC + nc + auth._mac(self.secret, b"C", ns, nc), deadline)
        try:
            mac = link._recv_before(32, deadline)
        except ConnectionError as exc:
            raise AuthenticationError("listener refused our hmac (wrong secret?)") from exc
        if not hmac.compare_digest(mac, auth._mac(self.secret, b"S", nc, ns)):
            raise AuthenticationError("listener failed the hmac challenge (wrong secret)")

    def close(self) -> None:
        """Stop accepting, and close every link this plane opened or accepted."""
        if self._closed:
            return
        self._closed = True
        self._listener = None
        self._engine.close()

    def __repr__(self) -> str:
        return f"UcxPlane({self.address!r})"
