"""Two hosts with real separate network stacks: network namespaces joined by a veth pair.

Agent ``a`` runs in namespace A (10.77.0.1), agent ``b`` in namespace B
(10.77.0.2); the controller script runs in A. Nothing but the veth link joins
the two stacks (abstract unix sockets are per network namespace too), so every
byte between the hosts crosses it. Needs root and ``ip netns``; skipped with
the reason otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap

import pytest
from mh_agents import SECRET, Agent

pytestmark = pytest.mark.timeout(180)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"ma-probe-{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot make a network namespace here: {exc}"
    _run("ip", "netns", "del", probe)
    return None


@pytest.fixture
def namespaces():
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    tag = secrets.token_hex(3)
    a, b = f"ma-{tag}-a", f"ma-{tag}-b"
    va, vb = f"va{tag}", f"vb{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        _run("ip", "link", "set", va, "netns", a)
        _run("ip", "link", "set", vb, "netns", b)
        _run("ip", "-n", a, "addr", "add", "10.77.0.1/24", "dev", va)
        _run("ip", "-n", b, "addr", "add", "10.77.0.2/24", "dev", vb)
        _run("ip", "-n", a, "link", "set", va, "up")
        _run("ip", "-n", b, "link", "set", vb, "up")
        yield a, b
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and the pair with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import mesharray as ma

    class Where(ma.Actor):
        @ma.endpoint
        def where(self):
            return os.environ.get("MESHARRAY_HOST_ID")

        @ma.endpoint
        def own(self, n):
            self.data = np.arange(n, dtype=np.float32)
            return ma.Buffer(self.data)

        @ma.endpoint
        def read(self, buf):
            dst = np.empty(buf.nbytes // 4, dtype=np.float32)
            buf.read_into(dst).get(timeout=60)
            return float(dst.sum(dtype=np.float64))

    hosts = ma.attach(sys.argv[1:], timeout=30)
    procs = hosts.spawn_procs(per_host={"procs": 2})
    w = procs.spawn("w", Where)
    where = [str(v) for v in np.asarray(w.where.call().get(timeout=60)).ravel()]
    x = procs.ones((1 << 18,), dtype="float32") * (procs.rank_array() + 1)
    by_host = np.asarray(x.sum(axis="hosts").fetch())[:, :2].tolist()
    total = float(np.asarray(x.sum().fetch()))
    buf = w[0, 0].own.call_one(1 << 20).get(timeout=60)
    read = w[1, 1].read.call_one(buf).get(timeout=60)
    procs.stop()
    hosts.detach()
    print(json.dumps({"where": where, "by_host": by_host, "total": total, "read": read}))
""")


def test_two_hosts_in_separate_network_namespaces(namespaces):
    ns_a, ns_b = namespaces
    agent_a = Agent("10.77.0.1", "ns-a", netns=ns_a)
    agent_b = Agent("10.77.0.2", "ns-b", netns=ns_b)
    try:
        assert agent_a.url.startswith("tcp://10.77.0.1:") and agent_b.url.startswith("tcp://10.77.0.2:")
        env = dict(os.environ, MESHARRAY_SECRET=SECRET)
        r = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", _SCRIPT, agent_a.url, agent_b.url],
                           capture_output=True, text=True, timeout=150, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["where"] == ["ns-a", "ns-a", "ns-b", "ns-b"]
        assert out["by_host"] == [[4.0, 4.0], [6.0, 6.0]]
        assert out["total"] == 10.0 * (1 << 18)
        assert out["read"] == float(sum(range(1 << 20)))
    finally:
        agent_a.stop()
        agent_b.stop()
