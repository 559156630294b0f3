"""The one thread per process that sends distributed arrays' delayed frees (``darray.context._FreeTimer``)."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from mesharray.darray.context import _FreeTimer

pytestmark = pytest.mark.timeout(30)


class _Ctx:
    """Stands in for a DataContext: the timer only calls ``flush_frees`` (and holds it weakly)."""

    def __init__(self) -> None:
        self.flushes: list[float] = []
        self.flushed = threading.Event()

    def flush_frees(self) -> None:
        self.flushes.append(time.monotonic())
        self.flushed.set()


def test_each_context_is_flushed_once_after_its_own_delay():
    timer = _FreeTimer()
    a, b = _Ctx(), _Ctx()
    t0 = time.monotonic()
    timer.schedule(a, 0.02)
    timer.schedule(b, 0.10)
    timer.schedule(a, 0.5)  # already scheduled sooner: its first deadline stands
    assert a.flushed.wait(5) and b.flushed.wait(5)
    assert 0.019 <= a.flushes[0] - t0 < 0.4 and b.flushes[0] - t0 >= 0.099
    time.sleep(0.1)
    assert len(a.flushes) == 1 and len(b.flushes) == 1
    # a flushed context can be scheduled again
    timer.schedule(a, 0.01)
    assert _wait_for(lambda: len(a.flushes) == 2)
    assert timer._thread is not None and timer._thread.name == "mesharray-frees"


def test_an_urgent_flush_moves_a_scheduled_one_earlier():
    # frees holding many bytes go at once (by the timer's thread: a decref runs in finalizers)
    timer = _FreeTimer()
    a = _Ctx()
    t0 = time.monotonic()
    timer.schedule(a, 5.0)
    timer.schedule(a, 0.0)
    assert a.flushed.wait(2)
    assert a.flushes[0] - t0 < 1.0 and len(a.flushes) == 1


def test_cancelled_and_collected_contexts_are_not_flushed():
    timer = _FreeTimer()
    c = _Ctx()
    timer.schedule(c, 0.05)
    timer.cancel(c)
    gone = _Ctx()
    timer.schedule(gone, 0.05)
    del gone
    gc.collect()
    later = _Ctx()
    timer.schedule(later, 0.1)
    assert later.flushed.wait(5)  # the timer went past both deadlines
    assert c.flushes == []
    assert not timer._due


def test_a_finalizer_may_schedule_while_the_timer_lock_is_held_by_its_thread():
    # a garbage collection inside a locked section runs finalizers in that thread: a dropped
    # array's decref schedules its context's frees from there (a plain lock deadlocks here)
    timer = _FreeTimer()
    a, b = _Ctx(), _Ctx()
    done = threading.Event()

    def inside():
        with timer._cond:
            timer.schedule(a, 0.01)
            timer.cancel(a)
            timer.schedule(b, 0.01)
        done.set()

    threading.Thread(target=inside, daemon=True).start()
    assert done.wait(5), "schedule() deadlocked under the timer's own lock"
    assert b.flushed.wait(5) and a.flushes == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_starts_its_own_thread():
    from mesharray.darray import context

    ctx = _Ctx()
    context._FREES.schedule(ctx, 0.01)
    assert ctx.flushed.wait(5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread did not come along
        ok = context._FREES._thread is None
        child = _Ctx()
        context._FREES.schedule(child, 0.01)
        ok = ok and child.flushed.wait(5)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return False
