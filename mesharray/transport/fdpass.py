"""Passing shared-memory descriptors between processes of one host (``SCM_RIGHTS``).

Where a process cannot open another's ``memfd`` through ``/proc/<pid>/fd``
(macOS, or ``MESHARRAY_PORTABLE=1``), the owner of the segments serves their
descriptors on a unix socket, ``<runtime dir>/fd-<pid>``, in this user's 0700
runtime directory (:func:`mesharray._platform.runtime_dir`): only this user
can connect, as only this user could open ``/proc/<pid>/fd``. A receiver
asks once per segment (it keeps the mapping), so the cost is one connection
per segment and receiver, not per message.

Request: ``<q fd><Q serial>`` (the segment's number in the owner and its
serial, as the frame's descriptor names them). Answer: one byte, ``1`` with
the descriptor attached or ``0`` (no such segment).

A killed owner leaves its socket file behind; the next server (or portable
listener) started in the directory removes the files of processes that no
longer exist (:func:`mesharray._platform.sweep_socket_files`).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import struct
import threading

from .. import _platform
from .sockio import shut_and_close

__all__ = ["FdServer", "available", "request", "socket_path"]

log = logging.getLogger("mesharray.transport")

_REQ = struct.Struct("<qQ")


def available() -> bool:
    """Whether this platform passes descriptors over unix sockets (``socket.send_fds``)."""
    return hasattr(socket, "AF_UNIX") and hasattr(socket, "send_fds")


def socket_path(pid: int) -> str:
    """Where process ``pid`` serves its descriptors."""
    return os.path.join(_platform.runtime_dir(), f"fd-{pid}")


class FdServer:
    """Serves this process's descriptors: ``lookup(fd, serial) -> fd or None``, in a thread."""

    def __init__(self, lookup) -> None:
        self.lookup = lookup
        self.pid = os.getpid()
        self.path = socket_path(self.pid)
        _platform.sweep_socket_files(os.path.dirname(self.path))
        try:
            os.unlink(self.path)  # a dead process with our pid left it
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(64)
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name="mesharray-fdpass", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # a clean exit leaves no socket file (a killed process: swept later)

    def _loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            try:
                conn.settimeout(2.0)  # a request is 16 bytes sent at once; nobody may stall the server
                self._serve(conn)
            except Exception as exc:  # one bad client must not stop the others
                log.warning("fd server of process %d: a request failed: %s", self.pid, exc)
            finally:
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        while len(buf) < _REQ.size:
            chunk = conn.recv(_REQ.size - len(buf))
            if not chunk:
                return
            buf += chunk
        fd, serial = _REQ.unpack(buf)
        got = self.lookup(fd, serial)
        if got is None:
            conn.sendall(b"\0")
        else:
            socket.send_fds(conn, [b"\1"], [got])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        shut_and_close(self.sock)
        if os.getpid() == self.pid:  # not a forked child's copy: the parent still serves
            try:
                os.unlink(self.path)
            except OSError:
                pass


def request(pid: int, fd: int, serial: int, timeout: float = 5.0) -> int:
    """A descriptor of segment ``fd``/``serial`` of process ``pid`` (the caller closes it).

    Raises ``OSError`` naming the process and the segment if the owner is
    gone or does not have it.
    """
    path = socket_path(pid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot reach the descriptor server of process {pid} at {path}: "
                                     f"{exc.strerror or exc}") from exc
        s.sendall(_REQ.pack(fd, serial))
        msg, fds, _, _ = socket.recv_fds(s, 1, 1)
    finally:
        s.close()
    if msg != b"\1" or not fds:
        for f in fds:
            os.close(f)
        raise OSError(f"process {pid} has no shared-memory segment {fd}/{serial} to pass")
    return fds[0]
