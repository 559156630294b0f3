"""The UCX data plane (``UcxPlane``, ``UcxLink``, the compiled ``_ucp``) between real processes.

Runs where the ``libucx`` wheel is installed (``pip install 'mesharray[ucx]'``, or
``make test-ucx``); skipped without it. Where libucx is installed the extension must
have been built: its absence fails (``make test`` sets ``MESHARRAY_REQUIRE_UCX=1``,
which fails the skip too). Every child process is spawned, reports through a queue
under a deadline, and is killed at the end of its test: a test can fail, never hang.
"""

from __future__ import annotations

import hashlib
import importlib.util
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback

import numpy as np
import pytest

from mesharray.errors import ActorDiedError, AuthenticationError
from mesharray.transport import auth
from mesharray.transport.dataplane import MAX_TAG, Rendezvous, ucx_status

if importlib.util.find_spec("libucx") is None:
    if os.environ.get("MESHARRAY_REQUIRE_UCX") == "1":
        raise ImportError("MESHARRAY_REQUIRE_UCX=1 but the libucx wheel is not installed")
    pytest.skip("the libucx wheel is not installed; pip install 'mesharray[ucx]' (or make test-ucx)",
                allow_module_level=True)
try:
    from mesharray.transport import ucx
except OSError as exc:  # another UCX was loaded first (tests/conftest.py loads ours early to avoid it)
    pytest.skip(f"cannot load the wheel's UCX in this process: {exc}", allow_module_level=True)
# (an ImportError here, libucx installed but mesharray.transport._ucp not built, fails the module)

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
    if nbytes:  # (a large send completes once the peer receives it: send from a thread)
        threading.Thread(target=link.send, args=(np.ones(nbytes, np.uint8),), daemon=True).start()
    out.put(("ready", os.getpid()))
    time.sleep(120)


def _hold_gil(seconds: float) -> None:
    """Hold the GIL for about ``seconds``: one C call (``sum`` over a range), no switch interval."""
    t = time.perf_counter()
    sum(range(2_000_000))
    per = (time.perf_counter() - t) / 2_000_000
    sum(range(int(seconds / per)))


def _owner(out, cmds, secret, nbytes, readonly):
    """Own a block of ``nbytes`` (pattern 3) registered with its plane; obey commands until "exit"."""
    plane = ucx.UcxPlane(secret, "127.0.0.1", lambda link, tag: None)
    block = _pattern(3, nbytes)
    tokens = np.zeros(4, np.uint64)  # the registry's token table: slot 1 is ours
    token = int.from_bytes(os.urandom(8), "little") | 1
    tokens[1] = token
    sec = os.urandom(16)
    rkey = plane.register_block(1, block.ctypes.data, nbytes, readonly, token, tokens.ctypes.data + 8, sec)
    out.put(("handle", {"address": plane.address, "slot": 1, "token": token, "secret": sec, "addr": block.ctypes.data,
                        "rkey": rkey, "token_addr": tokens.ctypes.data + 8,
                        "token_rkey": plane.token_rkey(tokens.ctypes.data, tokens.nbytes)}))
    while True:
        cmd = cmds.get(timeout=120)
        if cmd == "exit":
            break
        if cmd[0] == "gil":  # hold the GIL in pure Python for cmd[1] seconds
            out.put(("holding", os.getpid()))
            time.sleep(0.2)  # (the queue's feeder thread needs the GIL to send that)
            _hold_gil(cmd[1])
            out.put(("held", None))
        elif cmd[0] == "drop":
            t = time.monotonic()
            done = plane.unregister_block(1, cmd[1])
            out.put(("dropped", (done, time.monotonic() - t)))
        elif cmd[0] == "digest":
            out.put(("digest", (_digest(block), int(tokens[1]), plane.served)))
        elif cmd[0] == "cpu":  # CPU seconds this process uses while idle for cmd[1] s
            t = time.process_time()
            time.sleep(cmd[1])
            out.put(("cpu", time.process_time() - t))
    plane.close()


def _reader(out, cmds, secret, handle, nbytes):
    """Read the owner's block over and over (to be killed mid-transfer)."""
    plane = ucx.UcxPlane(secret, "127.0.0.1", lambda link, tag: None)
    dst = np.empty(nbytes, np.uint8)
    plane.buffer_transfer(handle["address"], handle, 0, dst.ctypes.data, nbytes)
    out.put(("reading", os.getpid()))
    while True:
        plane.buffer_transfer(handle["address"], handle, 0, dst.ctypes.data, nbytes)


def _ring_member(out, cmds, secret, rank, dtype, op, n):
    """Member ``rank`` of a 2-ring: link to the other member, run the compiled allreduce, report."""
    from mesharray.collectives.ring import RingCollective

    rdv = Rendezvous()
    plane = ucx.UcxPlane(secret, "127.0.0.1", rdv.put)
    out.put(("address", plane.address))
    other = cmds.get(timeout=60)
    right = plane.connect(other, b"ring/%d" % rank, timeout=30)
    left = rdv.take(b"ring/%d" % (1 - rank), timeout=30)
    ring = RingCollective(rank, 2, right, left)
    x = (np.arange(n) % 97 + rank * 3 + 1).astype(dtype)
    x0 = x.copy()
    res = ring.allreduce(x, op=op)  # into a fresh array: reduced from ``x``, never copied into the result first
    assert (x == x0).all(), "the allreduce changed its input"
    y = x.copy()
    ring.allreduce(y, out=y, op=op)  # in place
    b = x.copy()
    ring.broadcast(b, root=1)
    g = ring.allgather(x[:1000])
    out.put(("result", (res.tobytes(), y.tobytes(), b.tobytes(), g.tobytes(), ring.native_runs)))
    cmds.get(timeout=60)
    ring.close()
    plane.close()


def _ring_looper(out, cmds, secret, address):
    """Member 1 of a 2-ring with the test process: 16 MiB float32 allreduces until it is killed."""
    from mesharray.collectives.ring import RingCollective

    rdv = Rendezvous()
    plane = ucx.UcxPlane(secret, "127.0.0.1", rdv.put)
    out.put(("address", plane.address))
    right = plane.connect(address, b"ring/1", timeout=30)
    left = rdv.take(b"ring/0", timeout=30)
    ring = RingCollective(1, 2, right, left)
    x = np.ones(4 << 20, np.float32)
    ring.allreduce(x)
    out.put(("looping", os.getpid()))
    while True:
        ring.allreduce(x)


def _buffer_owner(out, cmds, secret, nbytes):
    """A process of host id "owner-host" with a UCX process plane: owns a ``Buffer``, sends its pickle."""
    import pickle

    os.environ["MESHARRAY_HOST_ID"] = "owner-host"
    from mesharray.buffer import Buffer
    from mesharray.transport.dataplane import start_process_plane

    start_process_plane(secret, "127.0.0.1", "ucx")
    block = _pattern(5, nbytes)
    buf = Buffer(block)
    out.put(("pickle", pickle.dumps(buf)))
    while True:
        cmd = cmds.get(timeout=120)
        if cmd == "exit":
            break
        if cmd[0] == "gil":
            out.put(("holding", None))
            time.sleep(0.2)  # (the queue's feeder thread needs the GIL to send that)
            _hold_gil(cmd[1])
            out.put(("held", None))
        elif cmd[0] == "drop":
            t = time.monotonic()
            buf.drop()
            out.put(("dropped", time.monotonic() - t))
        elif cmd[0] == "digest":
            out.put(("digest", _digest(block)))


def _buffer_reader(out, cmds, secret, data, nbytes):
    """A process of host id "reader-host" with a UCX process plane: reads/writes the pickled Buffer."""
    import pickle

    os.environ["MESHARRAY_HOST_ID"] = "reader-host"
    from mesharray.buffer import TRANSFERS
    from mesharray.transport.dataplane import start_process_plane

    plane = start_process_plane(secret, "127.0.0.1", "ucx")
    buf = pickle.loads(data)  # starts opening the link to the owner's plane (prepare_link)
    deadline = time.monotonic() + 30
    while not plane._to and time.monotonic() < deadline:
        time.sleep(0.01)
    out.put(("ready", len(plane._to)))
    while True:
        cmd = cmds.get(timeout=120)
        if cmd == "exit":
            break
        try:
            if cmd == "read":
                dst = np.zeros(nbytes, np.uint8)
                t = time.monotonic()
                n = buf.read_into(dst).get(timeout=60)
                out.put(("read", (n, _digest(dst), time.monotonic() - t, dict(TRANSFERS))))
            elif cmd == "write":
                out.put(("wrote", buf.write_from(_pattern(6, 100)).get(timeout=60)))
            elif cmd == "drop":
                buf.drop()
                out.put(("dropped", None))
        except Exception as exc:  # the test checks the error
            out.put(("error", f"{type(exc).__name__}: {exc}"))


_ROLES = {"buffer-owner": _buffer_owner, "buffer-reader": _buffer_reader, "duplex": _serve_duplex,
          "tags": _serve_tags, "hold": _connect_and_hold, "owner": _owner,
          "reader": _reader, "ring": _ring_member, "ring-looper": _ring_looper}


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


def _os_threads():
    return len(os.listdir("/proc/self/task"))


# --------------------------------------------------------------------------- tests
def test_status_says_available():
    ok, why = ucx_status()
    assert ok and why.startswith("UCX 1.") and "compiled" in why, why


def test_the_compiled_plane_is_what_ucx_uses():
    from mesharray.transport import _ucp

    assert ucx._ucp is _ucp and ucx.ucx_version() == _ucp.version()
    d = ucx.describe()
    assert d["version"] == _ucp.version() and d["transports"], d
    if not ucx.rdma_available():  # no RDMA device: UCX over TCP only, never shared memory
        assert d["UCX_TLS"] == "tcp" and all(t.startswith("tcp/") for t in d["transports"]), d


def test_address_and_defaults():
    assert ucx.parse_ucx_address("ucx:[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError, match="expected 'ucx:HOST:PORT'"):
        ucx.parse_ucx_address("ucx:nohost")
    with pytest.raises(TypeError, match="address must be a str, got int"):
        ucx.parse_ucx_address(7)
    env = {"UCX_TLS": "rc"}
    done = ucx.ucx_defaults(env)
    assert env["UCX_TLS"] == "rc" and "UCX_TLS" not in done  # what the user set stays
    assert env["UCX_TCP_RX_SEG_SIZE"] == env["UCX_TCP_TX_SEG_SIZE"] == "512k"


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


def test_a_peer_that_fails_the_handshake_gets_no_endpoint(plane):
    # the handshake runs on TCP before any UCP endpoint exists: a peer that stays silent, or
    # announces a tag longer than allowed after proving the secret, leaves the plane serving
    import socket as _socket

    host, port = ucx.parse_ucx_address(plane.address)
    silent = _socket.create_connection((host, port))
    bad = _socket.create_connection((host, port))
    try:
        auth.client_handshake(bad, SECRET)
        bad.sendall((MAX_TAG + 1).to_bytes(2, "big") + b"t" * (MAX_TAG + 1))
        bad.settimeout(5)
        try:
            assert bad.recv(1) == b""  # refused: the listener closed it without answering
        except ConnectionResetError:  # (closed with our bytes unread)
            pass
        link = plane.connect(plane.address, b"after", timeout=10)
        assert plane.rendezvous.take(b"after", timeout=5) is not None
        link.close()
    finally:
        silent.close()
        bad.close()


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
    before = _os_threads()
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
    plane.close()  # its listener and its native progress thread end
    deadline = time.monotonic() + 3
    while _os_threads() >= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _os_threads() < before


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


def test_docstring_examples():
    import doctest

    result = doctest.testmod(ucx, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 12 and result.failed == 0, result


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


# --------------------------------------------------------------------------- Buffer transfers
def _read(p, handle, nbytes, dst=None):
    dst = np.zeros(nbytes, np.uint8) if dst is None else dst
    status = p.buffer_transfer(handle["address"], handle, 0, dst.ctypes.data, nbytes)
    return status, dst


@pytest.fixture(params=["served", "get"])
def rma(request, monkeypatch):
    """Both ways a Buffer moves: served by the owner's engine, and one-sided RMA (emulated over TCP)."""
    monkeypatch.setenv("MESHARRAY_UCX_RMA", request.param)
    return request.param


def test_buffer_read_write_and_drop_between_processes(children, plane, rma):
    n = 3 << 20
    owner = children("owner", SECRET, n, False)
    h = owner.expect("handle")
    status, got = _read(plane, h, n)
    assert status == 0 and np.array_equal(got, _pattern(3, n))
    part = _pattern(4, 1000)
    assert plane.buffer_transfer(h["address"], h, 1, part.ctypes.data, part.nbytes) == 0
    owner.cmds.put(("digest",))
    want = _pattern(3, n)
    want[:1000] = part
    digest, token, served = owner.expect("digest")
    assert digest == _digest(want) and token == h["token"]
    assert (served > 0) == (rma == "served")  # served: the owner's engine answered, in C
    assert _read(plane, h, 0)[0] == 0  # nothing to move: still checks the token
    # a holder drops it: the owner's token word is zeroed, later transfers say dropped
    assert plane.buffer_transfer(h["address"], h, 2, 0, 0) == 0
    owner.cmds.put(("digest",))
    assert owner.expect("digest")[1] == 0
    assert _read(plane, h, n)[0] == ucx._ucp.DROPPED
    assert plane.buffer_transfer(h["address"], h, 1, part.ctypes.data, part.nbytes) == ucx._ucp.DROPPED


def test_concurrent_transfers_from_many_threads_share_one_link(children, plane, rma):
    n = 1 << 20
    owner = children("owner", SECRET, n, False)
    h = owner.expect("handle")
    want, errors = _pattern(3, n), []

    def reads():
        try:
            for _ in range(5):
                status, got = _read(plane, h, n)
                assert status == 0 and np.array_equal(got, want)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reads) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert len(plane._to) == 1


def test_buffer_dropped_by_its_owner_and_forged_handles(children, plane, monkeypatch):
    monkeypatch.setenv("MESHARRAY_UCX_RMA", "served")
    n = 1 << 16
    owner = children("owner", SECRET, n, True)
    h = owner.expect("handle")
    assert _read(plane, h, n)[0] == 0
    for forged in ({"secret": bytes(16)}, {"token": h["token"] ^ 2}, {"slot": 2}, {"slot": 1 << 20}):
        assert _read(plane, dict(h, **forged), n)[0] == ucx._ucp.DROPPED, forged
    src = np.ones(10, np.uint8)  # registered read-only: a write is refused
    assert plane.buffer_transfer(h["address"], h, 1, src.ctypes.data, 10) == ucx._ucp.DROPPED
    too_long = np.zeros(n + 1, np.uint8)  # more than the block: refused, nothing moves
    assert _read(plane, h, n + 1, too_long)[0] == ucx._ucp.DROPPED
    owner.cmds.put(("drop", 5.0))
    done, took = owner.expect("dropped")
    assert done and took < 1.0
    assert _read(plane, h, n)[0] == ucx._ucp.DROPPED


def test_a_read_while_the_owner_holds_the_gil_is_served_natively(children, plane, rma):
    n = 8 << 20
    owner = children("owner", SECRET, n, False)
    h = owner.expect("handle")
    assert _read(plane, h, n)[0] == 0  # the first transfer opens the link (the owner's Python once)
    owner.cmds.put(("gil", 3.0))
    owner.expect("holding")
    time.sleep(0.2)
    t = time.monotonic()
    status, got = _read(plane, h, n)
    took = time.monotonic() - t
    assert status == 0 and np.array_equal(got, _pattern(3, n))
    assert took < 1.5, f"the read waited {took:.2f} s for the owner's Python"
    owner.expect("held", timeout=30)


def test_a_dead_owner_fails_the_transfer_quickly(children, plane, rma):
    n = 1 << 20
    owner = children("owner", SECRET, n, False)
    h = owner.expect("handle")
    assert _read(plane, h, n)[0] == 0
    owner.proc.kill()
    owner.proc.join(10)
    t = time.monotonic()
    with pytest.raises(ConnectionError):
        for _ in range(50):  # (UCX may not have seen the death at the first try)
            _read(plane, h, n)
            time.sleep(0.05)
    assert time.monotonic() - t < 10


def test_a_reader_killed_mid_transfer_lets_the_owner_unmap(children, monkeypatch):
    monkeypatch.setenv("MESHARRAY_UCX_RMA", "served")
    n = 32 << 20
    owner = children("owner", SECRET, n, False)
    h = owner.expect("handle")
    reader = children("reader", SECRET, h, n)
    pid = reader.expect("reading")
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    reader.proc.join(10)
    owner.cmds.put(("drop", 10.0))
    done, took = owner.expect("dropped", timeout=30)
    assert done, "the owner could not unmap the block: a transfer to the dead reader never ended"
    assert took < 10


def test_an_idle_plane_uses_no_cpu(children):
    owner = children("owner", SECRET, 1 << 10, False)
    owner.expect("handle")
    owner.cmds.put(("cpu", 1.0))
    assert owner.expect("cpu") < 0.1  # the progress thread sleeps in epoll


# --------------------------------------------------------------------------- the compiled ring
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("float64", "max"), ("int64", "prod"), ("uint8", "min"),
                                      ("int16", "sum")])
def test_ring_allreduce_runs_in_c_between_processes(children, dtype, op):
    n = 300_001  # odd: segments of unequal size, several chunks each
    a, b = children("ring", SECRET, 0, dtype, op, n), children("ring", SECRET, 1, dtype, op, n)
    addr_a, addr_b = a.expect("address"), b.expect("address")
    a.cmds.put(addr_b)
    b.cmds.put(addr_a)
    xs = [(np.arange(n) % 97 + r * 3 + 1).astype(dtype) for r in (0, 1)]
    want = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op](*xs)
    for c in (a, b):
        raw, in_place, bcast, gathered, native = c.expect("result")
        np.testing.assert_array_equal(np.frombuffer(raw, dtype=dtype), want)
        np.testing.assert_array_equal(np.frombuffer(in_place, dtype=dtype), want)
        np.testing.assert_array_equal(np.frombuffer(bcast, dtype=dtype), xs[1])
        np.testing.assert_array_equal(np.frombuffer(gathered, dtype=dtype).reshape(2, 1000), [xs[0][:1000], xs[1][:1000]])
        assert native == 4  # both allreduces, broadcast and allgather, all in the compiled loop
        c.cmds.put("done")


@pytest.mark.parametrize("seg", ["10007", "4099"])
def test_ring_reduces_fragments_that_cut_elements(children, monkeypatch, seg):
    # UCX hands a reducing receive its fragments as they lie in its segments; with odd segment sizes
    # the fragments cut float64 elements in two and start at addresses not aligned for them
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", seg)
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", seg)
    n = 200_003
    a, b = children("ring", SECRET, 0, "float64", "sum", n), children("ring", SECRET, 1, "float64", "sum", n)
    addr_a, addr_b = a.expect("address"), b.expect("address")
    a.cmds.put(addr_b)
    b.cmds.put(addr_a)
    want = sum((np.arange(n) % 97 + r * 3 + 1).astype("float64") for r in (0, 1))
    for c in (a, b):
        raw, in_place, _, _, native = c.expect("result")
        np.testing.assert_array_equal(np.frombuffer(raw, dtype="float64"), want)
        np.testing.assert_array_equal(np.frombuffer(in_place, dtype="float64"), want)
        assert native == 4
        c.cmds.put("done")


def test_a_member_killed_mid_allreduce_fails_the_compiled_ring_quickly(children, plane):
    from mesharray.collectives.ring import RingCollective

    child = children("ring-looper", SECRET, plane.address)
    right = plane.connect(child.expect("address"), b"ring/0", timeout=30)
    ring = RingCollective(0, 2, right, plane.rendezvous.take(b"ring/1", timeout=30))
    x, result = np.ones(4 << 20, np.float32), {}

    def loop():
        try:
            while True:
                ring.allreduce(x)
        except Exception as exc:
            result["exc"], result["at"] = exc, time.monotonic()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    pid = child.expect("looping")
    time.sleep(0.2)  # (reducing receives in flight: fragments unpacked into the result as they land)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "the ring hung after its peer died"
    assert isinstance(result["exc"], ActorDiedError), result
    assert "ring collective member 0/2" in str(result["exc"])
    assert result["at"] - killed < 5
    assert ring.native_runs >= 1
    ring.close()


def test_a_ring_plan_the_c_loop_cannot_run_is_refused_before_anything_moves(plane):
    right = plane.connect(plane.address, b"self", timeout=30)  # (a ring of one plane: the checks come first)
    left = plane.rendezvous.take(b"self", timeout=30)
    x = np.zeros(8, np.float32)
    recv = ucx._ucp.STEP_RECV | ucx._ucp.STEP_REDUCE
    for nbytes, chunk, match in [(6, 1 << 20, "not whole elements of 4 bytes"), (32, 16, "exceeds the chunk of 16")]:
        steps = np.array([[x.ctypes.data, nbytes, recv, x.ctypes.data]], dtype=np.uint64)
        with pytest.raises(ValueError, match=match):
            ucx.ring_run(right, left, steps, "f4", "sum", chunk)
    with pytest.raises(ValueError, match="4 columns"):
        ucx.ring_run(right, left, np.zeros((1, 3), np.uint64), "f4", "sum", 1 << 20)
    right.close()
    left.close()


def test_ring_falls_back_to_python_for_other_dtypes(children):
    a, b = children("ring", SECRET, 0, "complex64", "sum", 5000), children("ring", SECRET, 1, "complex64", "sum", 5000)
    addr_a, addr_b = a.expect("address"), b.expect("address")
    a.cmds.put(addr_b)
    b.cmds.put(addr_a)
    xs = [(np.arange(5000) % 97 + r * 3 + 1).astype("complex64") for r in (0, 1)]
    for c in (a, b):
        raw, in_place, _, _, native = c.expect("result")
        np.testing.assert_array_equal(np.frombuffer(raw, dtype="complex64"), xs[0] + xs[1])
        np.testing.assert_array_equal(np.frombuffer(in_place, dtype="complex64"), xs[0] + xs[1])
        assert native == 2  # the reductions took the Python loop; broadcast and allgather move bytes in C
        c.cmds.put("done")



# --------------------------------------------------------------------------- Buffer over the process planes
def test_buffer_api_across_host_ids_goes_over_the_ucx_plane(children, rma):
    n = 4 << 20
    owner = children("buffer-owner", SECRET, n)
    data = owner.expect("pickle")
    reader = children("buffer-reader", SECRET, data, n)
    assert reader.expect("ready") == 1  # the handle's arrival opened the link to the owner's plane
    # the first read, while the owner's Python holds the GIL: served by its engine, not by its Python
    owner.cmds.put(("gil", 3.0))
    owner.expect("holding")
    time.sleep(0.2)
    reader.cmds.put("read")
    got, digest, took, paths = reader.expect("read")
    assert got == n and digest == _digest(_pattern(5, n)) and took < 1.5, took
    assert paths["plane"] == 1 and paths["stream"] == 0
    owner.expect("held", timeout=30)
    reader.cmds.put("write")
    assert reader.expect("wrote") == 100
    want = _pattern(5, n)
    want[:100] = _pattern(6, 100)
    owner.cmds.put(("digest",))
    assert owner.expect("digest") == _digest(want)
    owner.cmds.put(("drop",))
    assert owner.expect("dropped") < 1.0
    reader.cmds.put("read")
    assert "dropped by its owner" in reader.expect("error")
    owner.proc.kill()
    owner.proc.join(10)
    reader.cmds.put("read")
    err = reader.expect("error")
    assert err.startswith(("ActorDiedError", "MeshArrayError")), err


def test_the_stub_names_what_the_extension_has():
    # (tests/core/test_stub.py does the full check for _core; here names and members, both ways)
    import ast
    import types
    from pathlib import Path

    from mesharray.transport import _ucp

    tree = ast.parse((Path(__file__).resolve().parents[2] / "mesharray" / "transport" / "_ucp.pyi").read_text())

    def names(body):
        out = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, ast.AnnAssign):
                out[node.target.id] = node
        return {k: v for k, v in out.items() if not k.startswith("_")}

    stub = names(tree.body)
    binary = {k for k, v in vars(_ucp).items() if not k.startswith("_") and not isinstance(v, types.ModuleType)
              and getattr(v, "__module__", _ucp.__name__) == _ucp.__name__}
    assert set(stub) == binary
    for cls in ("Engine", "Link"):
        members = {k for k in vars(getattr(_ucp, cls)) if not k.startswith("_")}
        assert set(names(stub[cls].body)) == members, cls
