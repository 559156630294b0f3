"""Mutual HMAC-SHA256 challenge on the job secret, run before any frame.

Both sides prove that they know the secret without sending it, and nothing is
unpickled before the exchange succeeds. All messages have fixed sizes, so a
peer can make us read at most 68 bytes before we refuse it.

::

    server -> client : b"MAH1" + ns                       (ns: 32 random bytes)
    client -> server : b"MAH1" + nc + HMAC(k, b"C" + ns + nc)
    server -> client : HMAC(k, b"S" + nc + ns)             (only if the client's was right)

A wrong MAC, a wrong magic or a peer that stays silent past the handshake
timeout closes the connection; the listener logs it and keeps serving others.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from ..errors import AuthenticationError, BrokenTransportError
from .sockio import recv_exactly

__all__ = ["MAGIC", "server_handshake", "client_handshake", "new_secret", "HANDSHAKE_TIMEOUT"]

MAGIC = b"MAH1"
NONCE = 32
HANDSHAKE_TIMEOUT = 5.0


def new_secret() -> bytes:
    """Return a fresh 32-byte job secret."""
    return os.urandom(32)


def _mac(secret: bytes, tag: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, tag + a + b, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    try:
        return recv_exactly(sock, n)
    except EOFError:
        raise BrokenTransportError("peer closed the connection during the handshake") from None


def server_handshake(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Run the listener's side; raise :class:`AuthenticationError` on a bad peer."""
    sock.settimeout(timeout)
    ns = os.urandom(NONCE)
    sock.sendall(MAGIC + ns)
    msg = _recv_exact(sock, 4 + NONCE + 32)
    if msg[:4] != MAGIC:
        raise AuthenticationError(f"bad handshake magic {msg[:4]!r}; expected {MAGIC!r}")
    nc, mac = msg[4:4 + NONCE], msg[4 + NONCE:]
    if not hmac.compare_digest(mac, _mac(secret, b"C", ns, nc)):
        raise AuthenticationError("peer failed the hmac challenge (wrong secret)")
    sock.sendall(_mac(secret, b"S", nc, ns))
    sock.settimeout(None)


def client_handshake(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Run the connecting side; raise :class:`AuthenticationError` on a bad listener."""
    sock.settimeout(timeout)
    msg = _recv_exact(sock, 4 + NONCE)
    if msg[:4] != MAGIC:
        raise AuthenticationError(f"bad handshake magic {msg[:4]!r}; expected {MAGIC!r}")
    ns = msg[4:]
    nc = os.urandom(NONCE)
    sock.sendall(MAGIC + nc + _mac(secret, b"C", ns, nc))
    try:
        mac = _recv_exact(sock, 32)
    except BrokenTransportError as exc:
        raise AuthenticationError("listener refused our hmac (wrong secret?)") from exc
    if not hmac.compare_digest(mac, _mac(secret, b"S", nc, ns)):
        raise AuthenticationError("listener failed the hmac challenge (wrong secret)")
    sock.settimeout(None)
