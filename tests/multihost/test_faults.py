"""Faults across hosts: a killed agent, a silent host, a dead controller, bad secrets, unreachable agents."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from mh_agents import SECRET, Agent, agents, wait_until

import mesharray as ma
from mesharray.bootstrap import agent as agent_mod
from tests.support.actors import Where
from tests.support.procs import gone

pytestmark = pytest.mark.timeout(120)


def test_killed_agent_fails_its_ranks_fast_and_spares_the_others():
    with agents(2, first_ip=6, prefix="k") as ags:
        hosts = ma.attach([a.url for a in ags], secret=SECRET)
        procs = hosts.spawn_procs(per_host={"procs": 2})
        try:
            w = procs.spawn("w", Where)
            pids = [v[2] for v in np.asarray(w.where.call().get(timeout=30)).ravel()]
            x = procs.ones((4,)) * 2
            ags[1].kill(signal.SIGKILL)
            t = time.monotonic()
            with pytest.raises(ma.ActorDiedError):
                while time.monotonic() - t < 5:  # calls until the death is seen
                    w[1, 0].where.call_one().get(timeout=5)
                    time.sleep(0.01)
            assert time.monotonic() - t <= 1.0
            assert wait_until(lambda: gone(pids[2]) and gone(pids[3]), 5)
            # the first host keeps working, views included
            assert w[0].where.call().get(timeout=30).shape == (2,)
            assert float(np.asarray(x[0].sum().fetch())) == 16.0
        finally:
            procs.stop()
            hosts.detach()


def test_silent_host_is_reported_unresponsive_by_heartbeat():
    with agents(2, first_ip=8, prefix="s") as ags:
        hosts = ma.attach([a.url for a in ags], secret=SECRET)
        procs = hosts.spawn_procs(per_host={"procs": 1}, heartbeat_timeout=1.0, heartbeat_interval=0.2)
        try:
            w = procs.spawn("w", Where)
            w.where.call().get(timeout=30)
            ags[1].signal_host(signal.SIGSTOP)  # the host goes silent: nothing closes
            try:
                t = time.monotonic()
                assert wait_until(lambda: procs.stats()["unresponsive_now"] == 1, 5)
                assert time.monotonic() - t < 1.0 + 1.5  # the documented bound: heartbeat_timeout + a check period
                assert w[0].where.call_one().get(timeout=10)[0] == "s0"
            finally:
                ags[1].signal_host(signal.SIGCONT)
            assert wait_until(lambda: procs.stats()["unresponsive_now"] == 0, 5)
            assert w[1].where.call_one().get(timeout=10)[0] == "s1"
        finally:
            procs.stop()
            hosts.detach()


_CONTROLLER = textwrap.dedent("""
    import sys, time
    import mesharray as ma
    sys.path.insert(0, {root!r})
    from tests.support.actors import Where
    hosts = ma.attach({urls!r}, secret={secret!r})
    procs = hosts.spawn_procs(per_host={{"procs": 2}})
    w = procs.spawn("w", Where)
    import numpy as np
    print(" ".join(str(v[2]) for v in np.asarray(w.where.call().get(timeout=30)).ravel()), flush=True)
    time.sleep(120)
""")


def test_dead_controller_processes_are_killed_and_agents_serve_the_next():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with agents(2, first_ip=10, prefix="c") as ags:
        urls = [a.url for a in ags]
        code = _CONTROLLER.format(root=root, urls=urls, secret=SECRET)
        ctl = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            line = ctl.stdout.readline()
            pids = [int(p) for p in line.split()]
            assert len(pids) == 4, line
            ctl.kill()
            ctl.wait(10)
            assert wait_until(lambda: all(gone(p) for p in pids), 10), "workers outlived their controller"
            t = time.monotonic()
            hosts = ma.attach(urls, secret=SECRET, timeout=10)
            procs = hosts.spawn_procs(per_host={"procs": 1})
            try:
                assert time.monotonic() - t < 5
                assert procs.spawn("w", Where).where.call().get(timeout=30).shape == (2, 1)
            finally:
                procs.stop()
                hosts.detach()
        finally:
            if ctl.poll() is None:
                ctl.kill()
                ctl.wait()
            ctl.stdout.close()


def test_wrong_secret_is_an_authentication_error(two_agents):
    t = time.monotonic()
    with pytest.raises(ma.AuthenticationError, match="MESHARRAY_SECRET"):
        ma.attach([a.url for a in two_agents], secret="not-the-secret", timeout=10)
    assert time.monotonic() - t < 5  # no retrying a refused secret


def test_unreachable_agents_are_named_after_the_timeout(two_agents):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    t = time.monotonic()
    with pytest.raises(ma.BootstrapError) as ei:
        ma.attach([two_agents[0].url, dead], secret=SECRET, timeout=1.0)
    assert time.monotonic() - t < 4
    assert dead in str(ei.value) and two_agents[0].url not in str(ei.value).split("(")[0]
    # the reachable agent was released: it serves the next attach
    h = ma.attach([two_agents[0].url], secret=SECRET, timeout=10)
    h.detach()


def test_no_secret_is_refused_before_connecting(monkeypatch, two_agents):
    monkeypatch.delenv("MESHARRAY_SECRET", raising=False)
    with pytest.raises(ma.BootstrapError, match="MESHARRAY_SECRET"):
        ma.attach([two_agents[0].url])


def test_bad_addresses_are_value_errors():
    with pytest.raises(ValueError, match="http://x:1"):
        ma.attach(["http://x:1"], secret=SECRET)
    with pytest.raises(ValueError, match="repeat"):
        ma.attach(["tcp://127.0.0.2:1", "tcp://127.0.0.2:1"], secret=SECRET)
    with pytest.raises(ValueError, match="at least one"):
        ma.attach([], secret=SECRET)


def test_busy_agent_refuses_a_second_controller(two_agents):
    hosts = ma.attach([two_agents[0].url], secret=SECRET)
    try:
        code = (f"import mesharray as ma\ntry:\n    ma.attach([{two_agents[0].url!r}], secret={SECRET!r}, timeout=5)\n"
                f"except ma.BootstrapError as e:\n    print('refused:', e)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        assert "refused:" in out and "one controller at a time" in out
    finally:
        hosts.detach()


def test_agent_without_a_secret_refuses_to_start():
    env = dict(os.environ)
    env.pop("MESHARRAY_SECRET", None)
    r = subprocess.run([sys.executable, "-m", "mesharray", "host", "--listen", "tcp://0.0.0.0:0"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "MESHARRAY_SECRET" in r.stderr and "every interface" in r.stderr


def test_agent_never_advertises_a_loopback_hostname_by_accident(monkeypatch):
    # Debian maps the hostname to 127.0.1.1 (Monarch #4394): binding every interface must not advertise it
    monkeypatch.setattr(agent_mod.socket, "gethostname", lambda: "trap-host")
    real = agent_mod._resolve
    monkeypatch.setattr(agent_mod, "_resolve", lambda h: "127.0.1.1" if h == "trap-host" else real(h))
    monkeypatch.setattr(agent_mod, "_route_ip", lambda: "10.1.2.3")
    assert agent_mod.advertised_host("0.0.0.0", None) == "10.1.2.3"
    monkeypatch.setattr(agent_mod, "_route_ip", lambda: None)
    with pytest.raises(ma.BootstrapError, match="loopback address 127.0.1.1.*--advertise"):
        agent_mod.advertised_host("0.0.0.0", None)
    # an explicit bind address or --advertise wins
    assert agent_mod.advertised_host("127.0.0.5", None) == "127.0.0.5"
    assert agent_mod.advertised_host("0.0.0.0", "tcp://127.0.0.9:26600") == "127.0.0.9"


def test_agent_prints_its_address_and_advertise_overrides_it():
    a = Agent("127.0.0.12", "adv", extra=["--advertise", "tcp://127.0.0.12:1"])
    try:
        assert a.url.startswith("tcp://127.0.0.12:")
    finally:
        a.stop()


@pytest.mark.parametrize("reply, said", [
    ((1 << 31).to_bytes(4, "big"), "agent protocol message of 2147483648 bytes"),  # an oversized length
    (None, "answered the attach with a list"),  # a well-framed reply that is not a dict
])
def test_a_malformed_attach_reply_is_an_error_and_the_socket_is_closed(reply, said):
    import gc
    import socket
    import threading

    from mesharray.transport import auth

    key = agent_mod.secret_from_env(SECRET)
    seen: dict = {}
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def fake_agent() -> None:  # the handshake and the request as an agent has them, then a bad reply
            conn, _ = srv.accept()
            with conn:
                auth.server_handshake(conn, key)
                seen["request"] = agent_mod.recv_msg(conn)["op"]
                if reply is None:
                    agent_mod.send_msg(conn, ["not", "a", "reply"])
                else:
                    conn.sendall(reply)
                conn.settimeout(10)
                seen["after"] = conn.recv(1)  # b"": the controller closed its end

        t = threading.Thread(target=fake_agent, daemon=True)
        t.start()
        with pytest.raises(ma.BootstrapError, match=said):
            ma.attach([f"tcp://127.0.0.1:{srv.getsockname()[1]}"], secret=SECRET, timeout=10)
        t.join(15)
    assert seen == {"request": "attach", "after": b""}
    gc.collect()  # (an unclosed socket would be a ResourceWarning here, an error under this suite's filters)
