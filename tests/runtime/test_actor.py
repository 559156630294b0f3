"""Actors on a shared local mesh: adverbs, slicing, ordering, endpoints, exceptions, data."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

import numpy as np
import pytest

import mesharray as ma
from tests.support.actors import AsyncActor, BadInit, Counter, Probe

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- adverbs
def test_call_gathers_a_mesharray_on_the_mesh_dims(procs):
    c = procs.spawn("c_call", Counter, 5)
    vals = c.get.call().get(timeout=10)
    assert isinstance(vals, ma.MeshArray)
    assert vals.shape == (1, 4)
    assert vals.tolist() == [[5, 5, 5, 5]]
    assert int(vals.sum()) == 20


def test_broadcast_then_call_sees_the_effect_in_order(procs):
    c = procs.spawn("c_bcast", Counter, 0)
    assert c.incr.broadcast() is None
    c.incr.broadcast(by=10)
    assert c.get.call().get(timeout=10).tolist() == [[11, 11, 11, 11]]


def test_call_one_on_one_actor_and_value_error_before_sending(procs):
    c = procs.spawn("c_one", Counter, 0)
    assert c.slice(procs=-1).get.call_one().get(timeout=10) == 0
    with pytest.raises(ValueError, match="call_one requires exactly 1 actor, but mesh has 4"):
        c.incr.call_one()
    # nothing was sent: no counter moved
    assert c.get.call().get(timeout=10).tolist() == [[0, 0, 0, 0]]


def test_choose_reaches_one_actor(procs):
    c = procs.spawn("c_choose", Counter, 0)
    for _ in range(8):
        c.incr.choose().get(timeout=10)
    assert int(c.get.call().get(timeout=10).sum()) == 8


def test_stream_yields_in_completion_order(probes):
    futs = list(probes.rank_sleep.stream(0.15))
    got = [f.get(timeout=10) for f in futs]
    assert got == [0, 1, 2, 3]
    futs = probes[0, ::-1].rank_sleep.stream(0.15)
    assert [f.get(timeout=10) for f in futs] == [0, 1, 2, 3]


# --------------------------------------------------------------------------- slicing
def test_positional_and_named_slicing(procs):
    c = procs.spawn("c_slice", Counter, 0)
    c[0, 1:3].incr.call().get(timeout=10)
    c.slice(procs=-1).incr.call_one().get(timeout=10)
    c[{"procs": 0}].incr.call_one(by=5).get(timeout=10)
    assert c.get.call().get(timeout=10).tolist() == [[5, 1, 1, 1]]
    sub = c[0, ::2].get.call().get(timeout=10)
    assert sub.shape == (2,) and sub.tolist() == [5, 1]
    assert c[0, [3, 0]].get.call().get(timeout=10).tolist() == [1, 5]


def test_current_rank_size_and_message_rank(probes):
    out = probes[0, 1:3].where.call().get(timeout=10).tolist()
    assert [o["rank"] for o in out] == [{"hosts": 0, "procs": 1}, {"hosts": 0, "procs": 2}]
    assert [o["message_rank"] for o in out] == [{"procs": 0}, {"procs": 1}]
    assert all(o["size"] == {"procs": 2} for o in out)
    full = probes.where.call().get(timeout=10).tolist()[0]
    assert full[3]["size"] == {"hosts": 1, "procs": 4}
    assert len({o["pid"] for o in full}) == 4


def test_spawn_on_a_slice_spawns_on_those_ranks_only(procs):
    part = procs[0, 2:]
    p = part.spawn("p_part", Probe)
    out = p.where.call().get(timeout=10).tolist()
    assert [o["rank"] for o in out] == [{"procs": 0}, {"procs": 1}]
    assert [o["pid"] for o in out] == procs.pids[2:]


def test_actor_mesh_stop_drops_the_actors(procs):
    c = procs.spawn("c_stop", Counter, 0)
    c[0, :2].stop()
    with pytest.raises(ma.ActorError, match="no actor with id"):
        c.slice(procs=0).get.call_one().get(timeout=10)
    assert c[0, 2:].get.call().get(timeout=10).tolist() == [0, 0]


def test_context_outside_an_actor_raises():
    with pytest.raises(RuntimeError, match="only available inside an actor"):
        ma.current_rank()
    with pytest.raises(RuntimeError, match="only available inside an actor"):
        ma.context()


def test_unknown_endpoint_is_attribute_error(probes):
    with pytest.raises(AttributeError, match="has no endpoint 'nope'"):
        probes.nope


# --------------------------------------------------------------------------- ordering
def test_messages_from_one_sender_run_in_send_order(procs):
    c = procs.spawn("c_order", Counter, 0)
    for i in range(500):
        c.record.broadcast(i)
        if i % 7 == 0:
            c.slice(procs=1).record.call_one(i)  # interleave adverbs
    seen = c.recorded.call().get(timeout=10).tolist()[0]
    expect = list(range(500))
    assert seen[0] == expect and seen[2] == expect and seen[3] == expect
    assert [x for x in seen[1] if True] == sorted(seen[1]) and len(seen[1]) == 500 + len(range(0, 500, 7))


def test_a_busy_actor_does_not_hold_back_messages_to_the_others(probes, tmp_path):
    # Rank 0 blocks until rank 1 acts; meanwhile far more than a socket buffer is
    # sent to rank 0. A sender that blocked on rank 0's full socket would never send
    # rank 1 its message: a deadlock across peers (this is how a collective, whose
    # members wait for each other in their reader threads, used to hang).
    flag = str(tmp_path / "go")
    waiter, other = probes.slice(procs=0), probes.slice(procs=1)
    done = waiter.wait_for_file.call_one(flag)
    t0 = time.monotonic()
    for _ in range(3000):
        waiter.echo.broadcast(b"z" * 3000)  # ~9 MB queued for the busy rank
    other.make_file.broadcast(flag)
    assert done.get(timeout=30) is True
    assert time.monotonic() - t0 < 15
    assert waiter.echo.call_one(1).get(timeout=30) == 1  # and everything behind it ran


def test_pipelined_call_one_all_resolve_in_order(procs):
    c = procs.spawn("c_pipe", Counter, 0).slice(procs=2)
    futs = []
    for _i in range(300):
        c.incr.broadcast()
        futs.append(c.get.call_one())
    assert [f.get(timeout=10) for f in futs] == list(range(1, 301))


# --------------------------------------------------------------------------- async endpoints
def test_async_endpoints_run_one_at_a_time(procs):
    a = procs.spawn("a_serial", AsyncActor).slice(procs=0)
    t0 = time.monotonic()
    futs = [a.nap.call_one(0.1, i) for i in range(3)]
    assert [f.get(timeout=10) for f in futs] == [0, 1, 2]
    assert time.monotonic() - t0 >= 0.29
    ev = a.events.call_one().get(timeout=10)
    assert ev == [("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2), ("end", 2)]


def test_concurrent_endpoints_overlap(procs):
    a = procs.spawn("a_conc", AsyncActor).slice(procs=1)
    t0 = time.monotonic()
    futs = [a.cnap.call_one(0.3, i) for i in range(4)]
    assert [f.get(timeout=10) for f in futs] == [0, 1, 2, 3]
    assert time.monotonic() - t0 < 0.9


def test_async_endpoint_context_and_errors(procs):
    a = procs.spawn("a_ctx", AsyncActor)
    out = a[0, 1:].where.call().get(timeout=10).tolist()
    assert [o["message_rank"] for o in out] == [{"procs": 0}, {"procs": 1}, {"procs": 2}]
    with pytest.raises(ma.ActorError) as ei:
        a.fail.call().get(timeout=10)
    assert isinstance(ei.value.exception, KeyError)
    assert a.events.call().get(timeout=10).shape == (1, 4)  # still alive


# --------------------------------------------------------------------------- exceptions
def test_endpoint_exception_is_actor_error_with_type_rank_host_and_traceback(probes):
    with pytest.raises(ma.ActorError) as ei:
        probes.slice(procs=2).fail.call_one("bad value").get(timeout=10)
    err = ei.value
    assert type(err.exception) is ValueError and str(err.exception) == "bad value"
    assert err.rank == {"hosts": 0, "procs": 2}
    assert err.host and err.pid == probes.slice(procs=2).pid.call_one().get(timeout=10)
    assert "raise ValueError(msg)" in err.traceback_text
    assert "procs=2" in str(err) and "ValueError: bad value" in str(err)
    # the actor survives
    assert probes.slice(procs=2).echo.call_one(7).get(timeout=10) == 7


def test_call_raises_if_any_rank_raises(probes):
    with pytest.raises(ma.ActorError):
        probes.fail.call().get(timeout=10)


def test_chained_causes_are_kept(probes):
    with pytest.raises(ma.ActorError) as ei:
        probes.slice(procs=0).fail_chained.call_one().get(timeout=10)
    exc = ei.value.exception
    assert isinstance(exc, RuntimeError) and isinstance(exc.__cause__, KeyError)


def test_constructor_failure_fails_the_spawn_with_actor_error(procs):
    with pytest.raises(ma.ActorError) as ei:
        procs.spawn("bad", BadInit, 1)
    assert isinstance(ei.value.exception, ZeroDivisionError)
    assert ei.value.rank == {"hosts": 0, "procs": 1}
    ok = procs[0, 2:].spawn("good", BadInit, 5)
    assert ok.ok.call().get(timeout=10).tolist() == [True, True]


def test_unpicklable_argument_raises_at_call_site_and_sends_nothing(procs):
    c = procs.spawn("c_ser", Counter, 0)
    with pytest.raises(ma.SerializationError, match="cannot pickle"):
        c.incr.call(threading.Lock())
    with pytest.raises(TypeError):  # SerializationError is a TypeError
        c.incr.broadcast(threading.Lock())
    assert c.get.call().get(timeout=10).tolist() == [[0, 0, 0, 0]]


def test_unpicklable_return_is_actor_error_naming_the_type(probes):
    with pytest.raises(ma.ActorError, match="lock") as ei:
        probes.slice(procs=3).lock.call_one().get(timeout=10)
    assert isinstance(ei.value.exception, TypeError)
    assert probes.slice(procs=3).echo.call_one("alive").get(timeout=10) == "alive"


# --------------------------------------------------------------------------- values
def test_large_numpy_round_trip_through_shared_memory(probes):
    a = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
    one = probes.slice(procs=1)
    for _ in range(3):  # segments are reused
        out = one.double.call_one(a).get(timeout=20)
        np.testing.assert_array_equal(out, a * 2)
        assert out.flags.writeable
    outs = probes.double.call(a[:1000]).get(timeout=20)
    assert outs.shape == (1, 4, 1000)


def test_returned_views_are_not_overwritten_by_later_sends(probes):
    one = probes.slice(procs=2)
    a = np.full(1 << 20, 1.0)
    back = one.echo.call_one(a).get(timeout=20)  # comes back without a copy
    for v in (2.0, 3.0):
        np.testing.assert_array_equal(one.echo.call_one(np.full(1 << 20, v)).get(timeout=20), v)
    assert float(back.min()) == float(back.max()) == 1.0
    back[:] = 7.0  # ours to write
    again = one.echo.call_one(a).get(timeout=20)
    assert float(again.max()) == 1.0 and float(back.max()) == 7.0
    del back, again
    import gc

    gc.collect()
    np.testing.assert_array_equal(one.echo.call_one(a).get(timeout=20), a)


def test_large_array_to_many_actors(probes):
    a = np.ones(1 << 20, dtype=np.float64)
    out = probes.echo.call(a).get(timeout=20)
    assert out.shape == (1, 4, 1 << 20) and float(out.sum()) == 4 * (1 << 20)


def test_actor_mesh_is_picklable_and_callable_from_an_actor(procs, probes):
    c = procs.spawn("c_peer", Counter, 3)
    again = pickle.loads(pickle.dumps(c))
    assert again.get.call().get(timeout=10).tolist() == [[3, 3, 3, 3]]
    got = probes.slice(procs=0).call_peer.call_one(c[0, 1:], "get").get(timeout=10)
    assert got == [3, 3, 3]


def test_async_endpoint_awaits_a_call_to_another_mesh(procs):
    c = procs.spawn("c_await", Counter, 4)
    a = procs.spawn("a_await", AsyncActor).slice(procs=3)
    assert a.ask.call_one(c[0, :2], "get").get(timeout=10) == [4, 4]


def test_main_defined_values_use_cloudpickle(probes):
    ns = {}
    exec("class Point:\n    def __init__(self, x): self.x = x\n", ns)  # a class pickle cannot import
    Point = ns["Point"]
    Point.__module__ = "__main__"
    out = probes.slice(procs=0).echo.call_one(Point(3)).get(timeout=10)
    assert out.x == 3


# --------------------------------------------------------------------------- futures
def test_future_api(probes):
    one = probes.slice(procs=0)
    f = one.sleep.call_one(0.3, "v")
    assert not f.done()
    with pytest.raises(TimeoutError):
        f.get(timeout=0.01)
    seen = []
    f.add_done_callback(seen.append)
    assert f.result(timeout=10) == "v" and f.exception() is None and f.done()
    assert seen == [f]
    later = []
    f.add_done_callback(later.append)  # already done: called at once
    assert later == [f]
    g = one.fail.call_one()
    assert isinstance(g.exception(timeout=10), ma.ActorError)
    with pytest.raises(TypeError, match="no public constructor"):
        ma.Future()


def test_future_await_inside_a_running_loop(probes):
    async def main():
        ticks = []

        async def ticker():
            for _ in range(5):
                ticks.append(1)
                await asyncio.sleep(0.02)

        t = asyncio.ensure_future(ticker())
        v = await probes.slice(procs=1).sleep.call_one(0.15, 42)
        await t
        arr = await probes.echo.call(1)
        return v, len(ticks), arr.tolist()

    v, ticks, arr = asyncio.run(main())
    assert v == 42 and ticks == 5  # the loop kept running while we awaited
    assert arr == [[1, 1, 1, 1]]
