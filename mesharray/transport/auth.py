"""Mutual HMAC-SHA256 challenge on the job secret, run before any frame.

Both sides prove that they know the secret without sending it, and nothing is
unpickled before the exchange succeeds. All messages have fixed sizes, so a
peer can make us read at most 68 bytes before we refuse it.

::

    server -> client : b"MAH1" + ns                       (ns: 32 random bytes)
    client -> server : b"MAH1" + nc + HMAC(k, b"C" + ns + nc)
    server -> client : HMAC(k, b"S" + nc + ns)             (only if the client's was right)

A fresh ``ns`` per connection makes a recorded client answer useless on
another connection (replay); the ``"C"``/``"S"`` tags keep one side's MAC from
being reflected as the other's, and a client nonce equal to the server's is
refused outright. A wrong MAC, a wrong magic, or a peer that has not finished
the whole exchange within :data:`HANDSHAKE_TIMEOUT` seconds (one deadline for
the exchange, not per ``recv``: a peer trickling one byte at a time gets no
more time) closes the connection; the listener logs it and keeps serving
others. The listener runs the server side without blocking (:class:`ServerHandshake`,
driven by its selector); :func:`server_handshake` is the blocking form.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

from ..errors import AuthenticationError, BrokenTransportError

__all__ = ["MAGIC", "server_handshake", "client_handshake", "new_secret", "HANDSHAKE_TIMEOUT",
           "ServerHandshake", "CLIENT_MSG"]

MAGIC = b"MAH1"
NONCE = 32
#: bytes of the client's answer (magic, nonce, MAC)
CLIENT_MSG = 4 + NONCE + 32
#: seconds a peer has for the whole handshake (env ``MESHARRAY_HANDSHAKE_TIMEOUT``)
HANDSHAKE_TIMEOUT = float(os.environ.get("MESHARRAY_HANDSHAKE_TIMEOUT", "5"))


def new_secret() -> bytes:
    """Return a fresh 32-byte job secret."""
    return os.urandom(32)


def _mac(secret: bytes, tag: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, tag + a + b, hashlib.sha256).digest()


def _recv_before(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from ``sock`` before ``deadline`` (``time.monotonic()``), however they trickle in."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"handshake not finished in time ({len(buf)} of {n} bytes received)")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise BrokenTransportError("peer closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


class ServerHandshake:
    """The listener's side of the exchange as a state machine (no blocking, no thread).

    ``hello`` is what to send first; feed what the peer sends to :meth:`feed`
    until it returns the final answer to send (the peer is then authenticated);
    it raises :class:`AuthenticationError` on a bad peer.
    """

    __slots__ = ("secret", "ns", "hello", "buf", "deadline")

    def __init__(self, secret: bytes, deadline: float) -> None:
        self.secret = secret
        self.ns = os.urandom(NONCE)
        self.hello = MAGIC + self.ns
        self.buf = b""
        self.deadline = deadline

    def feed(self, data: bytes) -> bytes | None:
        """Add bytes from the peer; the answer to send once its message is complete, else ``None``."""
        self.buf += data
        if len(self.buf) > CLIENT_MSG:
            raise AuthenticationError(f"peer sent {len(self.buf)} bytes before the handshake ended; "
                                      f"expected {CLIENT_MSG}")
        if len(self.buf) < CLIENT_MSG:
            if self.buf[:4] != MAGIC[:len(self.buf[:4])]:
                raise AuthenticationError(f"bad handshake magic {self.buf[:4]!r}; expected {MAGIC!r}")
            return None
        return _server_answer(self.secret, self.ns, self.buf)


def _server_answer(secret: bytes, ns: bytes, msg: bytes) -> bytes:
    if msg[:4] != MAGIC:
        raise AuthenticationError(f"bad handshake magic {msg[:4]!r}; expected {MAGIC!r}")
    nc, mac = msg[4:4 + NONCE], msg[4 + NONCE:]
    if hmac.compare_digest(nc, ns):
        raise AuthenticationError("peer reflected our nonce")
    if not hmac.compare_digest(mac, _mac(secret, b"C", ns, nc)):
        raise AuthenticationError("peer failed the hmac challenge (wrong secret)")
    return _mac(secret, b"S", nc, ns)


def server_handshake(sock: socket.socket, secret: bytes, timeout: float | None = None) -> None:
    """Run the listener's side (blocking); raise :class:`AuthenticationError` on a bad peer."""
    deadline = time.monotonic() + (HANDSHAKE_TIMEOUT if timeout is None else timeout)
    ns = os.urandom(NONCE)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(MAGIC + ns)
    sock.sendall(_server_answer(secret, ns, _recv_before(sock, CLIENT_MSG, deadline)))
    sock.settimeout(None)


def client_handshake(sock: socket.socket, secret: bytes, timeout: float | None = None) -> None:
    """Run the connecting side; raise :class:`AuthenticationError` on a bad listener.

    The whole exchange must end within ``timeout`` (default :data:`HANDSHAKE_TIMEOUT`) seconds.
    """
    deadline = time.monotonic() + (HANDSHAKE_TIMEOUT if timeout is None else timeout)
    msg = _recv_before(sock, 4 + NONCE, deadline)
    if msg[:4] != MAGIC:
        raise AuthenticationError(f"bad handshake magic {msg[:4]!r}; expected {MAGIC!r}")
    ns = msg[4:]
    nc = os.urandom(NONCE)
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(MAGIC + nc + _mac(secret, b"C", ns, nc))
    try:
        mac = _recv_before(sock, 32, deadline)
    except BrokenTransportError as exc:
        raise AuthenticationError("listener refused our hmac (wrong secret?)") from exc
    if not hmac.compare_digest(mac, _mac(secret, b"S", nc, ns)):
        raise AuthenticationError("listener failed the hmac challenge (wrong secret)")
    sock.settimeout(None)
