"""Ctrl-C in the controller (``transport.interrupt``): a KeyboardInterrupt while waiting or sending
interrupts the caller only. No connection is torn down, no worker is taken for dead, the next call
works, and an interrupted call's late reply completes its future.

The interrupts are real SIGINTs sent to this process's main thread (``signal.pthread_kill``) while
it waits or sends; ``test_ctrl_c_*`` in tests/runtime/test_interactive.py types one into a pty.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from mesharray.transport import interrupt

pytestmark = pytest.mark.timeout(120)


def _sigint_after(delay: float) -> threading.Timer:
    t = threading.Timer(delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    t.start()
    return t


def _healthy(procs, probes) -> None:
    """Every rank answers, nobody died, nobody is unresponsive."""
    assert list(probes.echo.call(7).get(timeout=30).values()) == [7] * 4
    st = procs.stats()
    assert st["deaths"] == 0 and st["alive"] == st["workers"], st


@pytest.fixture(scope="module")
def guarded(procs):
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # (pytest started in the background, `cmd &` or nohup: SIGINT is ignored, and the
        # controller rightly leaves it so; these tests send one, so they take Python's default)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupt.install()
    assert interrupt.installed(), "the controller puts the Ctrl-C guard in place"
    return procs


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_interrupted_get_keeps_the_connection(guarded, probes, timeout):
    fut = probes[0, 0].sleep.call_one(1.5, "late")
    t0 = time.monotonic()
    _sigint_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        fut.get(timeout)
    assert time.monotonic() - t0 < 1.2, "the interrupt ends the wait, not the reply"
    # the next call to that rank queues behind the interrupted one, as any call does
    assert probes[0, 0].echo.call_one(3).get(timeout=30) == 3
    assert fut.get(timeout=30) == "late"  # the late reply completed the interrupted future
    _healthy(guarded, probes)


def test_interrupted_call_gathering_many_ranks(guarded, probes):
    probes.echo.call(0).get(timeout=30)  # (the next call() takes the path of a call() in a loop)
    fut = probes.sleep.call(1.5, "late")
    _sigint_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        fut.get()
    assert list(probes.echo.call(5).get(timeout=30).values()) == [5] * 4
    assert list(fut.get(timeout=30).values()) == ["late"] * 4
    _healthy(guarded, probes)


def test_interrupted_await(guarded, probes):
    async def main():
        return await probes[0, 1].sleep.call_one(1.5, "late")

    _sigint_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert probes[0, 1].echo.call_one(4).get(timeout=30) == 4
    _healthy(guarded, probes)


def test_interrupted_fetch(guarded, probes):
    x = guarded.ones((4,))
    fut = probes[0, 2].sleep.call_one(1.5)  # the fetch queues behind it on rank 2
    _sigint_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        x.fetch()
    fut.get(timeout=30)
    assert x.sum().fetch() == 16.0
    _healthy(guarded, probes)


def test_interrupted_256mib_argument(guarded, probes):
    data = b"\x01" * (256 << 20)
    try:
        for delay in (0.05, 0.15):
            timer = _sigint_after(delay)
            try:
                n = probes[0, 3].nbytes.call_one(data).get(timeout=60)
            except KeyboardInterrupt:
                timer.join()
            else:  # the whole round trip fitted in the delay: the interrupt lands after it
                timer.join()
                assert n == len(data)
                with pytest.raises(KeyboardInterrupt):
                    time.sleep(5)
        # the frame cut by the interrupt was finished by the writer thread: the stream is whole
        assert probes[0, 3].nbytes.call_one(b"abc").get(timeout=60) == 3
        assert probes[0, 3].nbytes.call_one(data).get(timeout=60) == len(data)
    finally:
        del data
    _healthy(guarded, probes)


def test_interrupt_storm_on_a_call_loop(guarded, probes):
    """SIGINTs every few ms into a loop of call_one/call: each lands somewhere in the read or write
    paths (or is deferred to a safe line); every value that comes back is the right one."""
    stop = threading.Event()
    sent = []

    def storm():
        main = threading.main_thread().ident
        while not stop.wait(0.003):
            signal.pthread_kill(main, signal.SIGINT)
            sent.append(1)

    interrupted = done = 0
    th = threading.Thread(target=storm, daemon=True)
    th.start()
    t_end = time.monotonic() + 3.0
    try:
        i = 0
        while time.monotonic() < t_end:
            i += 1
            try:
                if i % 3:
                    assert probes[0, i % 4].echo.call_one(i).get() == i
                else:
                    assert list(probes.echo.call(i).get(timeout=30).values()) == [i] * 4
                done += 1
            except KeyboardInterrupt:
                interrupted += 1
    finally:
        stop.set()
        while th.is_alive():
            try:
                th.join()
            except KeyboardInterrupt:
                interrupted += 1
        # a deferred interrupt still pending lands at the next safe point: wait for quiet
        quiet = time.monotonic()
        while time.monotonic() - quiet < 0.5:
            try:
                time.sleep(0.01)
            except KeyboardInterrupt:
                interrupted += 1
                quiet = time.monotonic()
    assert interrupted > 10 and done > 10, (interrupted, done, len(sent))
    _healthy(guarded, probes)
