"""Hierarchical collectives across hosts: what a host's members see when their leader's step across hosts fails."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from mesharray.collectives import ShmCollective, unique_segment_name
from mesharray.collectives.hier import HierCollective
from mesharray.collectives.ring import RingCollective
from mesharray.collectives.tree import TreeCollective
from mesharray.errors import ActorDiedError
from mesharray.transport.dataplane import TcpPlane
from tests.collectives._procs import run_ranks

SECRET = b"s" * 32


def _no_ring():
    raise AssertionError("the small path takes no ring")


def _leader_link_breaks(rank, size, names, where, n):
    # two "hosts": ranks 0, 1 (leader 0) and 2, 3 (leader 2); rank 2 links to rank 0, then exits
    host = rank // 2
    local = ShmCollective(names[host], rank % 2, 2, timeout=20)
    if rank == 3:
        local.close()
        return "idle"
    if rank == 2:
        accepted = threading.Event()
        plane = TcpPlane(SECRET, "127.0.0.1", lambda link, tag: accepted.set())
        with open(where + ".tmp", "w") as f:
            f.write(plane.address)
        os.rename(where + ".tmp", where)
        accepted.wait(20)
        time.sleep(0.2)
        os._exit(0)
    tree = ring = None
    if rank == 0:
        deadline = time.monotonic() + 20
        while not os.path.exists(where) and time.monotonic() < deadline:
            time.sleep(0.01)
        plane = TcpPlane(SECRET, "127.0.0.1", lambda link, tag: None)
        link = plane.connect(open(where).read(), b"tree")
        tree = TreeCollective(0, 2, {1: link}, {1: "rank 2"})
        ring = RingCollective(0, 2, link, link, ("rank 2", "rank 2"))
    h = HierCollective((0, 1, 2, 3), rank, ["a", "a", "b", "b"], local, None,
                       make_ring=_no_ring if n == 1 else (lambda: ring), make_tree=lambda: tree)
    t0 = time.monotonic()
    try:
        if n == 1:  # 8 bytes: the small path, a host round and the tree
            h.allreduce_checked(np.ones(n), np.zeros(n))
        else:  # 1 MiB: a reduce to the leader, its ring across hosts, its broadcast of the result
            h.allreduce(np.ones(n), np.zeros(n))
        got: tuple = ("no error",)
    except ActorDiedError as exc:
        got = ("ActorDiedError", exc.ranks, time.monotonic() - t0)
    except BaseException as exc:
        got = (type(exc).__name__, str(exc), time.monotonic() - t0)
    if rank == 1:
        open(where + ".member", "w").close()
    else:  # the leader lives on, as a worker does, until its member has its answer
        deadline = time.monotonic() + 30
        while not os.path.exists(where + ".member") and time.monotonic() < deadline:
            time.sleep(0.01)
    local.close()
    return got


@pytest.mark.parametrize("n", [1, 1 << 17], ids=["small: tree", "large: ring"])
def test_a_leader_whose_step_across_hosts_fails_tells_its_hosts_members_at_once(tmp_path, n):
    # the leader (rank 0) loses its link to the other host's leader mid-allreduce; its member
    # (rank 1) waits for the leader's result: it must get the leader's error, not the group's
    # 20 s timeout
    names = [unique_segment_name("test"), unique_segment_name("test")]
    res = run_ranks(_leader_link_breaks, 4, names, str(tmp_path / "address"), n, expect_exit={2}, timeout=60)
    kind0, ranks0, took0 = res[0]
    assert kind0 == "ActorDiedError", res[0]
    kind1, ranks1, took1 = res[1]
    assert (kind1, ranks1) == (kind0, ranks0), res[1]
    assert took1 < 5.0
    assert res[3] == "idle"


def _member_dies_before_a_large_allreduce(rank, size, names, where):
    # two "hosts": ranks 0, 1 (leader 0) and 2, 3 (leader 2); rank 3 dies once the groups are made
    host = rank // 2
    local = ShmCollective(names[host], rank % 2, 2, timeout=20, global_ranks=(2 * host, 2 * host + 1))
    if rank == 3:
        os._exit(0)
    tree = ring = None
    if rank in (0, 2):
        links: dict = {}
        got = threading.Event()

        def accepted(link, tag):
            links[tag] = link
            if len(links) == 2:
                got.set()

        plane = TcpPlane(SECRET, "127.0.0.1", accepted)
        if rank == 2:
            with open(where + ".tmp", "w") as f:
                f.write(plane.address)
            os.rename(where + ".tmp", where)
            got.wait(20)
        else:
            deadline = time.monotonic() + 20
            while not os.path.exists(where) and time.monotonic() < deadline:
                time.sleep(0.01)
            links = {tag: plane.connect(open(where).read(), tag) for tag in (b"ring", b"tree")}
        peer, me, other = ("rank 2", 0, 1) if rank == 0 else ("rank 0", 1, 0)
        ring = RingCollective(me, 2, links[b"ring"], links[b"ring"], (peer, peer))
        tree = TreeCollective(me, 2, {other: links[b"tree"]}, {other: peer})
    h = HierCollective((0, 1, 2, 3), rank, ["a", "a", "b", "b"], local, None,
                       make_ring=lambda: ring, make_tree=lambda: tree)
    t0 = time.monotonic()
    try:
        h.allreduce(np.ones(1 << 17), np.zeros(1 << 17))  # 1 MiB: reduce to the leader, ring, broadcast
        got_: tuple = ("no error",)
    except ActorDiedError as exc:
        got_ = ("ActorDiedError", exc.ranks, time.monotonic() - t0)
    except BaseException as exc:
        got_ = (type(exc).__name__, str(exc), time.monotonic() - t0)
    # live on, as a worker does, until every survivor has its answer (a process that exits
    # closes its links: its partners would learn of it from that)
    open(f"{where}.done{rank}", "w").close()
    deadline = time.monotonic() + 30
    while not all(os.path.exists(f"{where}.done{r}") for r in (0, 1, 2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    local.close()
    return got_


def test_a_member_dead_before_a_large_allreduce_across_hosts_fails_every_host_at_once(tmp_path):
    # its host's leader finds the death in its host's reduction; the other host's leader waits for
    # it in the ring: it must learn the death in the ring's flag and raise naming the rank, with its
    # member, not wait for the links' timeout
    names = [unique_segment_name("test"), unique_segment_name("test")]
    res = run_ranks(_member_dies_before_a_large_allreduce, 4, names, str(tmp_path / "address"),
                    expect_exit={3}, timeout=45)
    for r in (0, 1, 2):
        kind, ranks, took = res[r]
        assert (kind, tuple(ranks)) == ("ActorDiedError", (3,)), res[r]
        assert took < 5.0, res[r]
