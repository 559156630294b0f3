"""The UCX data plane (``UcxPlane``, ``UcxLink``) between real processes.

Runs when ``ucxx`` imports (``pip install 'mesharray[ucx]'``, or ``make test-ucx``);
skipped otherwise. Every child process is spawned, reports through a queue
under a deadline, and is killed at the end of its test: a test can fail, never hang.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback

import numpy as np
import pytest

from mesharray.errors import AuthenticationError
from mesharray.transport import auth
from mesharray.transport.dataplane import MAX_TAG, Rendezvous, ucx_status

try:
    from mesharray.transport import ucx
except ImportError as exc:  # the extra is not installed: say which one
    pytest.skip(f"ucxx does not import ({exc}); pip install 'mesharray[ucx]' (or make test-ucx)",
                allow_module_level=True)
except OSError as exc:  # another UCX was loaded first (tests/conftest.py loads ucxx early to avoid it)
    pytest.skip(f"ucxx cannot load its UCX in this process: {exc}", allow_module_level=True)

pytestmark = [pytest.mark.timeout(90), pytest.mark.ucx]

SECRET = b"s" * 32
BIG = 64 << 20


def _pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _digest(buf) -> str:
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()


# --------------------------------------------------------------------------- child processes
def _child(role, out, cmds, *args):
    """Entry of every child: run ``role``, forward its result or its traceback to ``out``."""
    try:
        _ROLES[role](out, cmds, *args)
    except BaseException as exc:  # the test sees the child's traceback
        out.put(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _serve_duplex(out, cmds, secret, nbytes):
    """Accept one link; send pattern 2 while receiving pattern 1, both ``nbytes``, at once."""
    rdv = Rendezvous()
    plane = ucx.UcxPlane(secret, "127.0.0.1", rdv.put)
    out.put(("address", plane.address))
    link = rdv.take(b"duplex", timeout=30)
    got = np.zeros(nbytes, np.uint8)
    t = threading.Thread(target=link.recv_into, args=(memoryview(got),))
    t.start()
    link.send(_pattern(2, nbytes))
    t.join()
    out.put(("received", _digest(got)))
    link.close()  # at once after the send: the peer must still get every byte
    cmds.get(timeout=60)
    plane.close()


def _serve_tags(out, cmds, secret):
    """Report the tag of every authenticated link, and echo 4 bytes on it."""
    def on_link(link, tag):
        buf = bytearray(4)
        link.recv_into(memoryview(buf))
        link.send(buf)
        out.put(("tag", tag))

    plane = ucx.UcxPlane(secret, "127.0.0.1", on_link)
    out.put(("address", plane.address))
    cmds.get(timeout=60)
    plane.close()


def _connect_and_hold(out, cmds, address, secret, nbytes):
    """Connect, send ``nbytes`` (0: nothing), then wait to be killed."""
    plane = ucx.UcxPlane(secret, "127.0.0.1", lambda link, tag: None)
    link = plane.connect(address, b"victim", timeout=30)
    if nbytes:
        link.send(np.ones(nbytes, np.uint8))
    out.put(("ready", os.getpid()))
    time.sleep(120)


_ROLES = {"duplex": _serve_duplex, "tags": _serve_tags, "hold": _connect_and_hold}


class Child:
    """A spawned child running one of ``_ROLES``; killed by :meth:`stop` whatever happened."""

    def __init__(self, role, *args):
        ctx = mp.get_context("spawn")
        self.out, self.cmds = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_child, args=(role, self.out, self.cmds) + args, daemon=True)
        self.proc.start()

    def expect(self, what, timeout=60.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, value = self.out.get(timeout=max(0.05, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"child did not report {what!r} in {timeout} s") from None
                if not self.proc.is_alive():
                    raise AssertionError(f"child died (exit code {self.proc.exitcode}) before reporting {what!r}") from None
                continue
            if kind == "err":
                raise AssertionError(f"child failed:\n{value}")
            assert kind == what, (kind, value)
            return value

    def stop(self):
        if self.proc.is_alive():
            self.cmds.put("exit")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        for q in (self.out, self.cmds):
            q.close()
            q.join_thread()


@pytest.fixture
def children():
    started = []

    def start(role, *args):
        started.append(Child(role, *args))
        return started[-1]

    yield start
    for c in started:
        c.stop()


@pytest.fixture
def plane():
    got = Rendezvous()
    p = ucx.UcxPlane(SECRET, "127.0.0.1", got.put)
    p.rendezvous = got
    yield p
    p.close()


def _ucx_threads():
    return [t for t in threading.enumerate() if t.name.startswith("mesharray-ucx")]


# --------------------------------------------------------------------------- tests
def test_status_says_available():
    assert ucx_status() == (True, "ucxx imports")


def test_address_and_defaults():
    assert ucx.parse_ucx_address("ucx:[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError, match="expected 'ucx:HOST:PORT'"):
        ucx.parse_ucx_address("ucx:nohost")
    with pytest.raises(TypeError, match="address must be a str, got int"):
        ucx.parse_ucx_address(7)
    env = {"UCX_TLS": "rc"}
    done = ucx.ucx_defaults(env)
    assert env["UCX_TLS"] == "rc" and "UCX_TLS" not in done  # what the user set stays
    assert env["UCX_TCP_RX_SEG_SIZE"] == env["UCX_TCP_TX_SEG_SIZE"] == "4m"


def test_64mib_both_ways_at_once_between_processes(children):
    child = children("duplex", SECRET, BIG)
    address = child.expect("address")
    p = ucx.UcxPlane(SECRET, "127.0.0.1", lambda link, tag: None)
    try:
        link = p.connect(address, b"duplex", timeout=30)
        got = np.zeros(BIG, np.uint8)
        t = threading.Thread(target=link.recv_into, args=(memoryview(got),))
        t.start()
        mine = _pattern(1, BIG)
        link.send(mine)
        t.join(60)
        assert not t.is_alive()
        np.testing.assert_array_equal(got, _pattern(2, BIG))
        assert child.expect("received") == _digest(mine)
        link.close()
    finally:
        p.close()


def test_tags_reach_on_link(children):
    child = children("tags", SECRET)
    address = child.expect("address")
    p = ucx.UcxPlane(SECRET, "127.0.0.1", lambda link, tag: None)
    try:
        tags = [b"", b"a", b"\x00\xff" * (MAX_TAG // 2)]
        for tag in tags:
            link = p.connect(address, tag, timeout=30)
            link.send(b"ping")
            buf = bytearray(4)
            link.recv_into(memoryview(buf))
            assert bytes(buf) == b"ping"
            link.close()
        assert sorted(child.expect("tag") for _ in tags) == sorted(tags)
        with pytest.raises(ValueError, match=f"tag of {MAX_TAG + 1} bytes; at most {MAX_TAG}"):
            p.connect(address, b"x" * (MAX_TAG + 1))
    finally:
        p.close()


def test_wrong_secret_is_refused_and_the_plane_keeps_serving(children):
    child = children("tags", SECRET)
    address = child.expect("address")
    bad = ucx.UcxPlane(b"w" * 32, "127.0.0.1", lambda link, tag: None)
    good = ucx.UcxPlane(SECRET, "127.0.0.1", lambda link, tag: None)
    try:
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match="hmac"):
            bad.connect(address, b"intruder", timeout=10)
        assert time.monotonic() - t0 < auth.HANDSHAKE_TIMEOUT + 1
        link = good.connect(address, b"friend", timeout=10)
        link.send(b"ok!!")
        buf = bytearray(4)
        link.recv_into(memoryview(buf))
        assert bytes(buf) == b"ok!!"
        assert child.expect("tag") == b"friend"  # the intruder's tag never reached on_link
        link.close()
    finally:
        bad.close()
        good.close()


def test_a_listener_with_the_wrong_secret_is_refused(plane):
    other = ucx.UcxPlane(b"w" * 32, "127.0.0.1", lambda link, tag: None)
    try:
        with pytest.raises(AuthenticationError):
            other.connect(plane.address, b"t", timeout=10)
    finally:
        other.close()


def test_silent_peer_is_dropped_after_the_handshake_deadline(plane, monkeypatch):
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.5)
    host, port = ucx.parse_ucx_address(plane.address)
    raw = ucx._ucx.UCXEndpoint.create(plane._engine.worker, host, port, True)  # never answers
    try:
        deadline = time.monotonic() + 5
        while raw.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not raw.alive, "the listener kept a peer that never proved the secret"
        link = plane.connect(plane.address, b"after", timeout=10)  # and it keeps serving
        assert plane.rendezvous.take(b"after", timeout=5) is not None
        link.close()
    finally:
        raw.close_blocking()


@pytest.mark.parametrize("direction", ["recv", "send"])
def test_peer_killed_mid_transfer_raises_connection_error(plane, children, direction):
    # recv: the peer sent 8 MiB of 64 and died; send: we keep sending to a peer that died
    child = children("hold", plane.address, SECRET, 8 << 20 if direction == "recv" else 0)
    pid = child.expect("ready")
    link = plane.rendezvous.take(b"victim", timeout=30)
    result = {}

    def transfer():
        try:
            if direction == "recv":
                link.recv_into(memoryview(np.empty(BIG, np.uint8)))
            else:
                chunk = np.ones(BIG, np.uint8)
                while True:
                    link.send(chunk)
        except Exception as exc:
            result["exc"] = exc
        result["at"] = time.monotonic()

    t = threading.Thread(target=transfer, daemon=True)
    t.start()
    time.sleep(0.3)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    child.proc.join(10)
    t.join(10)
    assert not t.is_alive(), "the transfer hung after its peer died"
    assert isinstance(result.get("exc"), ConnectionError), result
    assert result["at"] - killed < 5
    with pytest.raises(ConnectionError):
        link.send(b"more")
    link.close()


def test_connect_to_nobody_times_out(plane):
    host, port = ucx.parse_ucx_address(plane.address)
    plane.close()
    lonely = ucx.UcxPlane(SECRET, "127.0.0.1", lambda link, tag: None)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="cannot open a data link"):
            lonely.connect(f"ucx:{host}:{port}", b"t", timeout=1.0)
        assert time.monotonic() - t0 < 4
    finally:
        lonely.close()


def test_close_wakes_a_blocked_receiver_and_stops_threads(plane):
    before = len(_ucx_threads())
    link = plane.connect(plane.address, b"c", timeout=10)
    accepted = plane.rendezvous.take(b"c", timeout=5)
    errors = []

    def recv():
        try:
            accepted.recv_into(memoryview(bytearray(16)))
        except ConnectionError as exc:
            errors.append(exc)

    t = threading.Thread(target=recv)
    t.start()
    time.sleep(0.2)
    link.close()  # the peer closes: the receiver learns it
    t.join(5)
    assert not t.is_alive() and errors
    with pytest.raises(ConnectionError, match="is closed"):
        link.send(b"x")
    plane.close()
    deadline = time.monotonic() + 3
    while len(_ucx_threads()) >= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_ucx_threads()) < before


def test_small_messages_in_order_and_empty_buffers(plane):
    link = plane.connect(plane.address, b"o", timeout=10)
    peer = plane.rendezvous.take(b"o", timeout=5)
    link.send(b"")  # nothing to move: returns at once
    peer.recv_into(memoryview(bytearray(0)))
    for i in range(200):
        link.send(i.to_bytes(4, "little"))
    buf = bytearray(800)  # a stream: one receive may span many sends
    peer.recv_into(memoryview(buf))
    assert [int.from_bytes(buf[i:i + 4], "little") for i in range(0, 800, 4)] == list(range(200))
    link.close()
    peer.close()


def test_a_link_that_sent_lingers_for_its_peer_then_closes(plane):
    # ucxx closes an endpoint with error handling by force, which can cut off the tail of what
    # a completed send handed to UCX: a link whose sends went unanswered waits for its peer to
    # close, or for UCX to go quiet, before it closes (test_64mib_both_ways_at_once_between_processes)
    link = plane.connect(plane.address, b"l", timeout=10)
    peer = plane.rendezvous.take(b"l", timeout=5)
    quiet = plane.connect(plane.address, b"q", timeout=10)
    plane.rendezvous.take(b"q", timeout=5)
    t = time.monotonic()
    quiet.close()  # sent nothing: nothing to wait for
    assert time.monotonic() - t < ucx.LINGER_IDLE_S
    link.send(b"x" * 1000)
    got = bytearray(1000)
    peer.recv_into(memoryview(got))
    assert got == b"x" * 1000
    # the peer keeps its end open: one quiet window, not the whole bound
    t = time.monotonic()
    link.close()
    took = time.monotonic() - t
    assert ucx.LINGER_IDLE_S * 0.9 <= took < ucx.LINGER_MAX_S / 2, took
    peer.close()
    # a request whose answer came: the asking side has nothing in flight and closes at once
    # (a Buffer reader); the answering side waits for it to close, not for a quiet window
    ask = plane.connect(plane.address, b"a", timeout=10)
    answer = plane.rendezvous.take(b"a", timeout=5)
    ask.send(b"want")
    req = bytearray(4)
    answer.recv_into(memoryview(req))
    answer.send(bytes(req) * 2)
    got = bytearray(8)
    ask.recv_into(memoryview(got))
    assert got == b"wantwant"
    t = time.monotonic()
    ask.close()
    assert time.monotonic() - t < ucx.LINGER_IDLE_S
    answer.close()


def test_docstring_examples():
    import doctest

    result = doctest.testmod(ucx, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0, result


def test_same_tag_limit_as_the_interface():
    assert ucx.MAX_TAG == MAX_TAG


def test_other_loopback_addresses_reach_the_plane():
    # how the multihost tests run several "hosts" on one machine: 127.0.0.2, 127.0.0.3, ...
    rdv = Rendezvous()
    a = ucx.UcxPlane(SECRET, "127.0.0.3", rdv.put)
    b = ucx.UcxPlane(SECRET, "127.0.0.2", lambda link, tag: None)
    try:
        assert a.address.startswith("ucx:127.0.0.3:")
        link = b.connect(a.address, b"lo3", timeout=10)
        link.send(b"abcd")
        buf = bytearray(4)
        rdv.take(b"lo3", timeout=5).recv_into(memoryview(buf))
        assert bytes(buf) == b"abcd"
    finally:
        a.close()
        b.close()


def test_many_threads_on_many_links_of_one_plane(plane):
    # 4 links, both ends in this process: 8 threads send and 8 receive at once, all on one
    # UCX worker; every waiter must be woken when its own request is done (no lost wake-up)
    client = ucx.UcxPlane(SECRET, "127.0.0.1", lambda link, tag: None)
    pairs = []
    try:
        for i in range(4):
            tag = b"m%d" % i
            pairs.append((client.connect(plane.address, tag, timeout=10), plane.rendezvous.take(tag, timeout=5)))
        n, reps, errors = 1 << 20, 10, []

        def side(link, mine, theirs):
            try:
                out, want, got = _pattern(mine, n), _pattern(theirs, n), np.empty(n, np.uint8)
                for _ in range(reps):
                    t = threading.Thread(target=link.recv_into, args=(memoryview(got),))
                    t.start()
                    link.send(out)
                    t.join(30)
                    assert not t.is_alive() and np.array_equal(got, want)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=side, args=(end, 10 * i + k, 10 * i + 1 - k))
                   for i, pair in enumerate(pairs) for k, end in enumerate(pair)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        assert time.monotonic() - t0 < 30
    finally:
        for a, b in pairs:
            a.close()
            b.close()
        client.close()


def test_a_ucx_loaded_first_by_mpi_is_reported_not_crashed():
    # Open MPI's pip wheel bundles an older UCX: after mpi4py, ucxx cannot load its own
    pytest.importorskip("mpi4py")
    import subprocess
    import sys

    code = ("from mpi4py import MPI\n"
            "from mesharray.transport.dataplane import ucx_status\n"
            "print(ucx_status())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    if "(True," in out.stdout:
        pytest.skip("this mpi4py's MPI does not bring its own UCX")
    assert "another UCX" in out.stdout and "before mpi4py" in out.stdout, out.stdout
