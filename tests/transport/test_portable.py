"""The non-Linux code paths (``MESHARRAY_PORTABLE=1``), tested directly in this process.

``make test`` also runs the runtime, array and collectives suites with the
switch set; these tests pin the pieces themselves (either way the suite runs).
"""

from __future__ import annotations

import mmap
import os
import selectors
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mesharray import _platform, _proc_stat
from mesharray.transport import fdpass
from mesharray.transport.readiness import READ, WRITE, _EpollSet, _SelectorSet, readiness_set


def _sets(event, oneshot):
    out = [_SelectorSet(event, oneshot, selectors.PollSelector())]
    if hasattr(selectors, "EpollSelector"):
        out.append(_SelectorSet(event, oneshot, selectors.EpollSelector()))
        out.append(_EpollSet(event, oneshot))
    return out


@pytest.mark.parametrize("make", range(3), ids=["poll", "epoll-selector", "epoll"])
def test_oneshot_read_reports_once_until_armed(make):
    sets = _sets(READ, True)
    if make >= len(sets):
        pytest.skip("no epoll on this platform")
    p = sets[make]
    a, b = socket.socketpair()
    try:
        p.register(a.fileno())
        assert p.poll(0) == []
        b.send(b"x")
        assert p.poll(1.0) == [a.fileno()]
        assert p.poll(0.05) == []  # still readable, but disarmed
        p.arm(a.fileno())
        assert p.poll(1.0) == [a.fileno()]
        p.disarm(a.fileno())
        p.arm(a.fileno())
        p.disarm(a.fileno())
        assert p.poll(0.05) == []
        p.unregister(a.fileno())
        with pytest.raises(OSError):
            p.arm(a.fileno())
    finally:
        a.close(); b.close()


@pytest.mark.parametrize("make", range(3), ids=["poll", "epoll-selector", "epoll"])
def test_arm_from_another_thread_wakes_a_blocked_poll(make):
    sets = _sets(READ, True)
    if make >= len(sets):
        pytest.skip("no epoll on this platform")
    p = sets[make]
    a, b = socket.socketpair()
    got: list = []
    try:
        p.register(a.fileno())
        p.disarm(a.fileno())
        b.send(b"x")
        t = threading.Thread(target=lambda: got.append(p.poll(10.0)))
        t.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        p.arm(a.fileno())  # poll(2) does not see this by itself: the set must wake its thread
        t.join(5.0)
        assert got and time.monotonic() - t0 < 2.0
        # a wake-up reports nothing, or the fd that became ready with it
        assert got[0] in ([], [a.fileno()])
    finally:
        a.close(); b.close()


def test_level_triggered_write_readiness():
    for p in _sets(WRITE, False):
        a, b = socket.socketpair()
        try:
            p.register(a.fileno())
            assert p.poll(1.0) == [a.fileno()]
            assert p.poll(1.0) == [a.fileno()]  # level-triggered: again
            p.unregister(a.fileno())
            assert p.poll(0.05) == []
        finally:
            a.close(); b.close()


def test_readiness_set_follows_the_switch():
    p = readiness_set(READ, oneshot=True)
    if _platform.LINUX_NATIVE:
        assert p.kind == "epoll"
    else:
        assert p.kind != "epoll"
    with pytest.raises(ValueError, match="event must be"):
        readiness_set("both")


def test_runtime_dir_is_private(tmp_path, monkeypatch):
    d = tmp_path / "rt"
    monkeypatch.setenv("MESHARRAY_RUNTIME_DIR", str(d))
    assert _platform.runtime_dir() == str(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        _platform.runtime_dir()


def test_anonymous_shm_leaves_no_name():
    fd = _platform.anonymous_shm("test")
    try:
        os.ftruncate(fd, 4096)
        with mmap.mmap(fd, 4096) as mm:
            mm[:5] = b"hello"
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)


def test_named_shm_round_trip():
    name = f"mesharray-test-{os.getpid()}-{os.urandom(4).hex()}"
    fd = _platform.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        fd2 = _platform.shm_open(name, os.O_RDWR)
        os.close(fd2)
        with pytest.raises(FileExistsError):
            _platform.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    finally:
        _platform.shm_unlink(name)
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        _platform.shm_open(name, os.O_RDWR)
    with pytest.raises(ValueError, match="without '/'"):
        _platform.shm_open("a/b", os.O_RDWR)


@pytest.mark.skipif(not fdpass.available(), reason="no socket.send_fds on this platform")
def test_fd_server_passes_a_segment(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHARRAY_RUNTIME_DIR", str(tmp_path / "rt"))
    fd = _platform.anonymous_shm("test")
    os.ftruncate(fd, 4096)
    with mmap.mmap(fd, 4096) as mm:
        mm[:3] = b"abc"
    server = fdpass.FdServer(lambda f, serial: fd if (f, serial) == (fd, 7) else None)
    try:
        got = fdpass.request(os.getpid(), fd, 7)
        try:
            assert got != fd
            with mmap.mmap(got, 0) as mm:
                assert mm[:3] == b"abc"  # the same memory, through another descriptor
        finally:
            os.close(got)
        with pytest.raises(OSError, match=f"process {os.getpid()} has no shared-memory segment {fd}/8"):
            fdpass.request(os.getpid(), fd, 8)
    finally:
        server.close()
        os.close(fd)
    assert not os.path.exists(server.path)
    with pytest.raises(OSError, match="cannot reach the descriptor server of process"):
        fdpass.request(os.getpid(), fd, 7)


def test_stale_socket_files_are_swept(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHARRAY_RUNTIME_DIR", str(tmp_path / "rt"))
    d = _platform.runtime_dir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(d, f"fd-{dead.pid}")
    open(stale, "w").close()
    server = fdpass.FdServer(lambda f, s: None)
    try:
        assert not os.path.exists(stale)
    finally:
        server.close()


def test_proc_stat_without_proc(monkeypatch):
    native = (_proc_stat.state(os.getpid()), _proc_stat.start_time(os.getpid()))
    monkeypatch.setattr(_platform, "LINUX_NATIVE", False)
    assert _proc_stat.state(os.getpid()) in (b"R", b"S")
    assert _proc_stat.start_time(os.getpid()) > 0
    assert _proc_stat.start_time(os.getpid()) == _proc_stat.start_time(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _proc_stat.state(child.pid) is None  # gone
    if sys.platform.startswith("linux"):
        assert native[0] in (b"R", b"S") and native[1] > 0


def test_whole_runtime_in_portable_mode(tmp_path):
    # a fresh interpreter with the switch: socket files in a 0700 directory, shared
    # memory passed over SCM_RIGHTS (the controller serves its segments), selectors
    script = textwrap.dedent("""
        import os, stat
        import numpy as np
        import mesharray as ma
        from mesharray import _platform
        from mesharray.transport import fdpass, shm
        from mesharray.transport.poller import default_poller
        assert _platform.PORTABLE and not _platform.LINUX_NATIVE
        assert default_poller()._readiness.kind != "epoll"
        assert shm.available()
        class Echo(ma.Actor):
            @ma.endpoint
            def total(self, a):
                return float(a.sum())
        procs = ma.proc_mesh(hosts=1, procs=2)
        try:
            e = procs.spawn("echo", Echo)
            a = np.arange(1 << 20, dtype="float64")   # 8 MiB: the shared-memory data plane
            out = e.total.call(a).get(timeout=60)
            assert float(out.sum()) == 2 * float(a.sum()), out
            path = fdpass.socket_path(os.getpid())
            assert stat.S_ISSOCK(os.stat(path).st_mode), path
            assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
            print("ok", procs.size())
        finally:
            procs.stop()
    """)
    env = dict(os.environ, MESHARRAY_PORTABLE="1", MESHARRAY_RUNTIME_DIR=str(tmp_path / "rt"))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok 2")


def test_portable_listener_uses_a_private_socket_file(tmp_path, monkeypatch):
    from mesharray.transport.address import connect
    from mesharray.transport.listener import Listener

    monkeypatch.setenv("MESHARRAY_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setattr(_platform, "LINUX_NATIVE", False)
    got: list = []
    lst = Listener(b"k" * 32, got.append, kind="unix")
    try:
        assert lst.address.startswith("unix:" + str(tmp_path / "rt") + f"/l-{os.getpid()}-")
        path = lst.address[5:]
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        s = connect(lst.address, b"k" * 32)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got, "the listener did not hand over the authenticated socket"
        s.close()
        for g in got:
            g.close()
    finally:
        lst.close()
    assert not os.path.exists(path) and os.path.isdir(tmp_path / "rt")  # the shared directory stays
