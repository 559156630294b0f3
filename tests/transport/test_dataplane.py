"""The TCP data plane: authenticated links, tags, the rendezvous, and how a bad peer is refused."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from mesharray.errors import AuthenticationError, BootstrapError
from mesharray.transport import dataplane
from mesharray.transport.address import dual_address, parse_address
from mesharray.transport.dataplane import Rendezvous, TcpPlane, plane_kind

pytestmark = pytest.mark.timeout(60)
SECRET = b"d" * 32


@pytest.fixture
def plane():
    rv = Rendezvous()
    p = TcpPlane(SECRET, "127.0.0.1", rv.put)
    yield p, rv
    p.close()


def test_full_duplex_64mib_both_ways(plane):
    p, rv = plane
    a = p.connect(p.address, b"x")
    b = rv.take(b"x", 5)
    n = 64 << 20
    src_a, src_b = np.full(n, 1, np.uint8), np.full(n, 2, np.uint8)
    dst_a, dst_b = np.empty(n, np.uint8), np.empty(n, np.uint8)
    # both sides send at once: each needs its own receiver running, or the socket buffers fill
    ts = [threading.Thread(target=a.send, args=(src_a,)), threading.Thread(target=b.send, args=(src_b,))]
    for t in ts:
        t.start()
    a.recv_into(memoryview(dst_a))
    b.recv_into(memoryview(dst_b))
    for t in ts:
        t.join()
    assert (dst_a == 2).all() and (dst_b == 1).all()
    a.close()
    b.close()


def test_tags_route_links_and_take_times_out(plane):
    p, rv = plane
    links = [p.connect(p.address, f"t{i}".encode()) for i in range(3)]
    got = [rv.take(f"t{i}".encode(), 5) for i in (2, 0, 1)]
    for i, link in zip((2, 0, 1), got):
        links[i].send(bytes([i]))
        buf = bytearray(1)
        link.recv_into(memoryview(buf))
        assert buf[0] == i
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="no data link with tag b'nobody'"):
        rv.take(b"nobody", 0.2)
    assert time.monotonic() - t < 2
    for link in links + got:
        link.close()


def test_wrong_secret_is_refused_and_the_plane_keeps_serving(plane):
    p, rv = plane
    rogue = TcpPlane(b"w" * 32, "127.0.0.1", lambda link, tag: None)
    try:
        with pytest.raises(AuthenticationError):
            rogue.connect(p.address, b"sneaky")
    finally:
        rogue.close()
    good = p.connect(p.address, b"ok")
    served = rv.take(b"ok", 5)
    good.close()
    served.close()


def test_a_silent_peer_gets_no_link(plane):
    p, rv = plane
    host, port = parse_address(p.address)[1]
    with socket.create_connection((host, port)):
        time.sleep(0.1)  # connects, never authenticates
    with pytest.raises(TimeoutError):
        rv.take(b"", 0.3)


def test_overlong_tags_are_refused(plane):
    p, _ = plane
    with pytest.raises(ValueError, match="at most 256"):
        p.connect(p.address, b"x" * 300)


def test_dead_peer_is_a_connection_error(plane):
    p, rv = plane
    a = p.connect(p.address, b"d")
    b = rv.take(b"d", 5)
    b.close()
    with pytest.raises(ConnectionError, match="broke while receiving"):
        a.recv_into(memoryview(bytearray(10)))
    a.close()


def test_plane_kind_resolves_settings(monkeypatch):
    monkeypatch.setenv("MESHARRAY_DATA_PLANE", "tcp")
    assert plane_kind() == "tcp"
    assert plane_kind("shm") == "tcp"  # one host: shared memory; between hosts, TCP
    with pytest.raises(ValueError, match="must be one of"):
        plane_kind("smoke-signals")
    ok, why = dataplane.ucx_status()
    if not ok:
        assert "mesharray[ucx]" in why
        with pytest.raises(BootstrapError, match="ucx"):
            plane_kind("ucx")
        assert plane_kind("auto") == "tcp"


def test_dual_addresses_pick_the_unix_socket_on_the_same_host():
    from mesharray.transport.address import connect
    from mesharray.transport.hostid import memory_domain
    from mesharray.transport.listener import Listener

    got = []
    tcp = Listener(SECRET, lambda s: got.append(("tcp", s)), kind="tcp")
    unix = Listener(SECRET, lambda s: got.append(("unix", s)), kind="unix")
    try:
        here = dual_address(tcp.address, unix.address, memory_domain())
        elsewhere = dual_address(tcp.address, unix.address, "0" * 16)
        s1, s2 = connect(here, SECRET), connect(elsewhere, SECRET)
        assert s1.family == socket.AF_UNIX and s2.family == socket.AF_INET
        s1.close()
        s2.close()
    finally:
        tcp.close()
        unix.close()
        for _, s in got:
            s.close()
