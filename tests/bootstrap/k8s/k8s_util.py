"""Helpers of the Kubernetes tests (a module of its own: other test folders have a conftest and actors too)."""

from __future__ import annotations

import socket

from tests.support.procs import wait_until as _wait_until


def free_port() -> int:
    """A port free on 127.0.0.1 (the pods' loopback IPs share the port space of nothing else here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float = 10.0, step: float = 0.05) -> bool:
    return _wait_until(cond, timeout, step)


def api_connections(cluster) -> list:
    """This process's open TCP connections to the fake API server."""
    import psutil

    port = int(cluster.url.rsplit(":", 1)[1])
    me = psutil.Process()
    conns = me.net_connections if hasattr(me, "net_connections") else me.connections  # (psutil < 6)
    return [c for c in conns("tcp") if c.raddr and c.raddr.port == port]
