"""Listeners share one accept thread per process: what a worker with three listeners relies on.

A worker of a host agent listens on TCP, on a unix socket and on its data plane;
each ``Listener`` used to start a thread of its own, which every fork paid for.
These tests pin what must hold now that one thread accepts for all of them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from mesharray.errors import AuthenticationError, BrokenTransportError
from mesharray.transport.address import connect
from mesharray.transport.listener import Listener

SECRET = b"listener-test-secret-0123456789ab"


def _accept_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mesharray-accept"]


def test_listeners_of_a_process_share_one_accept_thread_and_each_still_authenticates():
    got: dict[str, list] = {"tcp": [], "unix": [], "unix2": []}
    listeners = {name: Listener(SECRET, got[name].append, kind="tcp" if name == "tcp" else "unix")
                 for name in got}
    try:
        assert len(_accept_threads()) == 1
        for name, lst in listeners.items():
            s = connect(lst.address, SECRET, timeout=5.0)
            deadline = time.monotonic() + 5
            while not got[name] and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(got[name]) == 1, name
            s.close()
        with pytest.raises((AuthenticationError, BrokenTransportError, OSError)):
            connect(listeners["tcp"].address, b"the wrong secret, 32 bytes long!", timeout=2.0)
        deadline = time.monotonic() + 5  # (the accept thread counts it after the peer saw the refusal)
        while listeners["tcp"].refused < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert listeners["tcp"].refused == 1 and listeners["unix"].refused == 0
    finally:
        for lst in listeners.values():
            lst.close()
        for sockets in got.values():
            for s in sockets:
                s.close()


def test_closing_one_listener_refuses_its_peers_and_leaves_the_others_accepting():
    a_got: list = []
    b_got: list = []
    a = Listener(SECRET, a_got.append, kind="tcp")
    b = Listener(SECRET, b_got.append, kind="tcp")
    try:
        a.close()
        with pytest.raises(OSError):
            connect(a.address, SECRET, timeout=2.0)
        s = connect(b.address, SECRET, timeout=5.0)
        deadline = time.monotonic() + 5
        while not b_got and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(b_got) == 1 and not a_got
        s.close()
    finally:
        b.close()
        for s in b_got:
            s.close()


def test_a_listener_closed_from_its_own_handler_closes_at_once():
    closed = threading.Event()
    box: list[Listener] = []

    def on_connection(sock: socket.socket) -> None:
        sock.close()
        box[0].close()  # (in the accept thread: must not wait for itself)
        closed.set()

    lst = Listener(SECRET, on_connection, kind="unix")
    box.append(lst)
    other = Listener(SECRET, lambda s: s.close(), kind="unix")
    try:
        s = connect(lst.address, SECRET, timeout=5.0)
        assert closed.wait(5.0)
        s.close()
        t0 = time.monotonic()
        connect(other.address, SECRET, timeout=5.0).close()  # the thread goes on for the others
        assert time.monotonic() - t0 < 2.0
    finally:
        other.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_closes_what_it_inherited_and_listens_with_an_accept_thread_of_its_own():
    parent = Listener(SECRET, lambda s: s.close(), kind="unix")
    code = (
        "import os, sys\n"
        "from mesharray.transport.listener import Listener\n"
        "from mesharray.transport.address import connect\n"
        f"SECRET = {SECRET!r}\n"
        "inherited = Listener(SECRET, lambda s: s.close(), kind='unix')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    import time\n"
        "    t0 = time.monotonic()\n"
        "    inherited.close()  # (its accept thread is the parent's: the child closes it itself)\n"
        "    if time.monotonic() - t0 > 1.0 or inherited.sock.fileno() != -1: os._exit(4)\n"
        "    try: connect(inherited.address, SECRET, timeout=5.0).close()  # (the parent still listens)\n"
        "    except OSError: os._exit(5)\n"
        "    got = []\n"
        "    lst = Listener(SECRET, got.append, kind='unix')\n"
        "    s = connect(lst.address, SECRET, timeout=5.0)\n"
        "    t0 = time.monotonic()\n"
        "    while not got and time.monotonic() - t0 < 5: time.sleep(0.005)\n"
        "    os._exit(0 if got else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    finally:
        parent.close()
