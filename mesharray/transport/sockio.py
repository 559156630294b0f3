"""Small socket helpers the transport and the bootstraps share.

Reading exactly ``n`` bytes from a blocking socket (or a pipe): the one helper the
handshake, the frame reader, the buffer stream server and the zygote's pipe share;
and shutting a socket down before closing it, so that a thread blocked on it wakes.
"""

from __future__ import annotations

import os
import socket

__all__ = ["read_exactly", "recv_exactly", "recv_exactly_into", "shut", "shut_and_close"]


def recv_exactly_into(sock: socket.socket, view: memoryview, start: int = 0) -> int:
    """Fill ``view[start:]`` from ``sock``; returns the number of bytes read.

    Raises ``EOFError`` if the peer closes first (callers turn it into their
    own error); ``OSError`` (a timeout included) passes through.
    """
    have, n = start, view.nbytes
    while have < n:
        got = sock.recv_into(view[have:])
        if got == 0:
            raise EOFError(f"peer closed the connection after {have} of {n} bytes")
        have += got
    return have - start


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (``EOFError`` if the peer closes first)."""
    buf = bytearray(n)
    with memoryview(buf) as v:
        recv_exactly_into(sock, v)
    return bytes(buf)


def read_exactly(fd: int, n: int) -> bytes:
    """``n`` bytes from the file descriptor ``fd`` (a pipe); ``EOFError`` if it closes first."""
    buf = bytearray(n)
    have = 0
    while have < n:
        chunk = os.read(fd, n - have)
        if not chunk:
            raise EOFError(f"pipe closed after {have} of {n} bytes")
        buf[have:have + len(chunk)] = chunk
        have += len(chunk)
    return bytes(buf)


def shut(sock: socket.socket) -> None:
    """Shut both directions of ``sock`` down, so that a thread blocked in ``recv`` or ``accept`` on it wakes.

    A plain ``close`` does not wake such a thread (the descriptor stays open under it until
    it returns). A socket already shut, closed or never connected is left as it is.
    """
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def shut_and_close(sock: socket.socket) -> None:
    """:func:`shut`, then close ``sock``."""
    shut(sock)
    sock.close()
