"""Addresses, and connecting to one: how a process names the socket it listens on and how a peer reaches it.

Addresses are strings: ``"unix:@name"`` (same host, the default on Linux: an
abstract socket, so a killed process leaves no file behind), ``"unix:/path"``
(same host elsewhere; a unix socket skips the TCP stack: shorter round trips) or
``"tcp:host:port"`` (other hosts; listeners bind 127.0.0.1 unless told
otherwise). A process that listens on both, for other hosts and for its own,
gives one :func:`dual_address`, and :func:`connect` picks the socket that
suits the caller. The listening side is :mod:`.listener`.
"""

from __future__ import annotations

import socket
import time

from . import auth
from .hostid import memory_domain

__all__ = ["connect", "dial", "dual_address", "parse_address"]


def dual_address(tcp: str, unix: str, domain: str) -> str:
    """One address for a process that listens on TCP (for other hosts) and on a unix socket (for its own).

    ``connect`` takes the unix socket when the caller is in the same memory
    domain (:func:`~mesharray.transport.hostid.memory_domain`: same host, same
    host id), so large payloads between them keep the shared-memory path;
    everyone else connects over TCP.

    Examples
    --------
    >>> a = dual_address("tcp:10.0.0.7:4000", "unix:@w1", "abcd")
    >>> a
    'tcp:10.0.0.7:4000;unix:@w1;dom=abcd'
    >>> parse_address(a)[1]
    ('10.0.0.7', 4000)
    """
    return f"{tcp};{unix};dom={domain}"


def _split_dual(address: str) -> tuple[str, str | None, str | None]:
    tcp, _, rest = address.partition(";")
    unix, _, dom = rest.partition(";")
    return tcp, unix or None, dom[4:] if dom.startswith("dom=") else None


def parse_address(address: str):
    """Split an address string into ``(family, sockaddr)`` (the TCP part of a :func:`dual_address`)."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, got {type(address).__name__}")
    if ";" in address:
        address = _split_dual(address)[0]
    if address.startswith("unix:@"):  # Linux abstract namespace: no file, nothing to leak
        return socket.AF_UNIX, "\0" + address[6:]
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[5:]
    if address.startswith("tcp:"):
        host, _, port = address[4:].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad tcp address {address!r}; expected 'tcp:host:port'")
        return socket.AF_INET, (host.strip("[]"), int(port))
    raise ValueError(f"bad address {address!r}; expected 'unix:PATH' or 'tcp:HOST:PORT'")


def connect(address: str, secret: bytes, timeout: float = 10.0) -> socket.socket:
    """Open and authenticate a socket to ``address`` (raises :class:`AuthenticationError`)."""
    if ";" in address:
        tcp, unix, dom = _split_dual(address)
        if unix and dom == memory_domain():
            try:
                return connect(unix, secret, timeout)
            except OSError:
                pass  # (another network namespace with the same memory: TCP still reaches it)
        address = tcp
    family, sockaddr = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(sockaddr)
        auth.client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return sock


def dial(address: str, secret: bytes, timeout: float, retry: bool = True, name: str = "") -> socket.socket:
    """:func:`connect`, tried again every 20 ms while refused or timed out, until ``timeout`` (a peer still
    starting); once only without ``retry`` (a peer known to have listened: refused means gone).

    Raises ``ConnectionError`` naming ``name`` (default: ``address``) when it gives up.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return connect(address, secret, max(0.05, deadline - time.monotonic()))
        except (ConnectionRefusedError, socket.timeout) as exc:
            if time.monotonic() >= deadline or not retry:
                raise ConnectionError(f"cannot open a data link to {name or address}: {exc}") from exc
            time.sleep(0.02)
