"""ma.Buffer: one-sided reads and writes between real processes."""

import multiprocessing as mp
import pickle

import numpy as np
import pytest

import mesharray as ma
from mesharray.errors import ActorDiedError, MeshArrayError
from mesharray.transport import cma

pytestmark = pytest.mark.timeout(60)


def _owner(conn, n):
    # the owner registers a block, sends the handle, then only waits: its code
    # does not run while the peer reads and writes (one-sided)
    data = np.arange(n, dtype="float32")
    buf = ma.Buffer(data)
    conn.send(pickle.dumps(buf))
    cmd = conn.recv()
    while cmd != "exit":
        if cmd == "show":
            conn.send(data[:8].copy())
        elif cmd == "drop":
            buf.drop()
            conn.send("dropped")
        cmd = conn.recv()


@pytest.fixture
def owner():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_owner, args=(child, 1 << 20), daemon=True)
    p.start()
    handle = pickle.loads(parent.recv())
    yield handle, parent, p
    if p.is_alive():
        parent.send("exit")
        p.join(10)
    if p.is_alive():
        p.kill()
        p.join()
    parent.close()
    child.close()


@pytest.fixture(params=["cma", "stream"])
def path(request, monkeypatch):
    if request.param == "stream":
        # as if the kernel denied cross-memory attach: the owner's thread serves the bytes
        monkeypatch.setattr(cma, "_vm_readv", None)
        monkeypatch.setattr(cma, "_vm_writev", None)
    return request.param


def test_read_write_between_processes(owner, path):
    buf, conn, _ = owner
    assert buf.nbytes == 4 << 20 and repr(buf).startswith("Buffer(nbytes=4194304")
    dst = np.empty(1 << 20, dtype="float32")
    assert buf.read_into(dst).get(timeout=10) == 4 << 20
    np.testing.assert_array_equal(dst, np.arange(1 << 20, dtype="float32"))
    # a larger destination receives the leading bytes
    big = np.full((1 << 20) + 5, -1.0, dtype="float32")
    buf.read_into(big).get()
    assert big[-5:].tolist() == [-1.0] * 5 and big[3] == 3.0
    # a smaller source overwrites the leading bytes in the owner
    assert buf.write_from(np.full(4, 42.0, dtype="float32")).get() == 16
    conn.send("show")
    assert conn.recv().tolist() == [42.0] * 4 + [4.0, 5.0, 6.0, 7.0]


def test_sizes_checked_before_transfer(owner):
    buf, conn, _ = owner
    small = np.zeros(10, dtype="float32")
    with pytest.raises(ValueError, match="destination has 40 bytes, fewer than the buffer's 4194304"):
        buf.read_into(small)
    assert not small.any()
    with pytest.raises(ValueError, match="source has 4194308 bytes, more than the buffer's 4194304"):
        buf.write_from(np.zeros((1 << 20) + 1, dtype="float32"))
    conn.send("show")
    assert conn.recv().tolist() == list(range(8))
    with pytest.raises(ValueError, match="destination must be contiguous"):
        buf.read_into(np.zeros((1 << 21,), dtype="float32")[::2])
    ro = np.zeros(1 << 20, dtype="float32")
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="destination is read-only"):
        buf.read_into(ro)
    with pytest.raises(TypeError, match="destination must be a contiguous NumPy array"):
        buf.read_into([0.0] * 10)


def test_drop_by_owner_then_use_is_a_clear_error(owner, path):
    buf, conn, _ = owner
    conn.send("drop")
    assert conn.recv() == "dropped"
    with pytest.raises(MeshArrayError, match="buffer was dropped by its owner"):
        buf.read_into(np.empty(1 << 20, dtype="float32")).get()
    with pytest.raises(MeshArrayError, match="buffer was dropped"):
        buf.write_from(np.zeros(1, dtype="float32")).get()


def test_drop_by_holder_invalidates_every_handle(owner, path):
    buf, conn, _ = owner
    other = pickle.loads(pickle.dumps(buf))
    buf.drop()
    buf.drop()  # harmless
    with pytest.raises(MeshArrayError, match="buffer was dropped; it can no longer"):
        buf.read_into(np.empty(1 << 20, dtype="float32"))
    with pytest.raises(MeshArrayError, match="dropped by its owner"):
        other.read_into(np.empty(1 << 20, dtype="float32")).get()


def test_dead_owner_raises_actor_died(owner):
    buf, conn, p = owner
    p.kill()
    p.join()
    # cross-memory attach finds the process gone; the stream path (MESHARRAY_PORTABLE=1) cannot reach it
    with pytest.raises(ActorDiedError, match=rf"pid {p.pid}.*owning the buffer is (gone|unreachable)"):
        buf.read_into(np.empty(1 << 20, dtype="float32")).get()


def test_same_process_and_pickled_handle():
    src = np.arange(6, dtype="int64")
    buf = ma.Buffer(src)
    h = pickle.loads(pickle.dumps(buf))
    dst = np.zeros(6, dtype="int64")
    assert h.read_into(dst).get() == 48 and dst.tolist() == list(range(6))
    h.write_from(np.array([9], dtype="int64")).get()
    assert src[0] == 9
    buf.drop()
    with pytest.raises(MeshArrayError, match="dropped"):
        h.read_into(dst).get()
    with pytest.raises(MeshArrayError, match="cannot send a dropped buffer"):
        pickle.dumps(buf)


def test_torch_tensors_and_bytes():
    torch = pytest.importorskip("torch")
    t = torch.arange(5, dtype=torch.float64)
    buf = ma.Buffer(t)
    out = torch.zeros(5, dtype=torch.float64)
    buf.read_into(out).get()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    buf.drop()
    ro = ma.Buffer(b"hello")
    assert ro.readonly
    with pytest.raises(ValueError, match="registered read-only"):
        ro.write_from(b"x")
    dst = bytearray(5)
    ro.read_into(dst).get()
    assert dst == b"hello"
    ro.drop()
    with pytest.raises(ValueError, match="registers a 1-D block"):
        ma.Buffer(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="contiguous block"):
        ma.Buffer(np.zeros(4)[::2])
    with pytest.raises(TypeError, match="Buffer needs a NumPy array"):
        ma.Buffer(3)


async def _await_read(buf, dst):
    return await buf.read_into(dst)


def test_await():
    import asyncio

    buf = ma.Buffer(np.ones(3))
    dst = np.zeros(3)
    assert asyncio.run(_await_read(buf, dst)) == 24 and dst.tolist() == [1.0] * 3
    buf.drop()
