"""The frame header codec of ``_core`` and the payload codec."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from mesharray import SerializationError
from mesharray._core import FRAME_HEADER_SIZE, dispatch_frames, pack_frame, pack_header, take_frame, unpack_header
from mesharray.transport import framing


def test_header_round_trip_and_size():
    h = pack_header(3, 1, 123, 2**63 + 5, 2**32 - 1, 7)
    assert len(h) == FRAME_HEADER_SIZE == 24
    assert unpack_header(h, 1 << 20) == (3, 1, 123, 2**63 + 5, 2**32 - 1, 7)
    buf = bytearray(b"xx" + h)
    assert unpack_header(buf, 1 << 20, 2)[2] == 123


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind=0, flags=0, length=1), "kind"),
    (dict(kind=256, flags=0, length=1), "kind"),
    (dict(kind=1, flags=256, length=1), "flags"),
    (dict(kind=1, flags=0, length=1 << 32), "length"),
])
def test_pack_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_header(**kwargs)



def test_pack_frame_sizes_every_kind_of_part_and_joins_a_small_frame():
    # what Connection.send hands it: bytes, byte memoryviews (framing's inline buffers), and
    # any other buffer (a NumPy array: its size is its bytes, not its len)
    parts = [b"head", memoryview(b"abcdef")[2:], np.arange(3, dtype=np.float64), bytearray(b"z")]
    size = 4 + 4 + 24 + 1
    n, frame = pack_frame(2, 1, 9, 5, 6, parts, 1 << 16, 1 << 20)
    assert n == size and len(frame) == 24 + size
    assert unpack_header(frame, 1 << 20) == (2, 1, size, 9, 5, 6)
    assert frame[24:] == b"head" + b"cdef" + np.arange(3, dtype=np.float64).tobytes() + b"z"
    # over the small size: the header alone (the caller writes the parts after it)
    n, hdr = pack_frame(2, 1, 9, 5, 6, parts, size - 1, 1 << 20)
    assert (n, hdr) == (size, pack_header(2, 1, size, 9, 5, 6))
    # over the limit: nothing packed, the size to report
    assert pack_frame(2, 1, 9, 5, 6, parts, 1 << 16, size - 1) == (size, None)
    # no payload at all
    assert pack_frame(4, 0, 0, 0, 0, (), 1 << 16, 1 << 20) == (0, pack_header(4, 0, 0))


def test_pack_frame_refuses_what_pack_header_refuses_and_non_buffers():
    with pytest.raises(ValueError, match="kind"):
        pack_frame(0, 0, 0, 0, 0, [b"x"], 64, 1 << 20)
    with pytest.raises(ValueError, match="target/view"):
        pack_frame(1, 0, 0, 1 << 32, 0, [b"x"], 64, 1 << 20)
    with pytest.raises(TypeError):
        pack_frame(1, 0, 0, 0, 0, ["not bytes"], 64, 1 << 20)

def test_unpack_checks_magic_kind_length_and_size():
    h = bytearray(pack_header(1, 0, 1000))
    with pytest.raises(ValueError, match="exceeds the limit of 999 bytes"):
        unpack_header(h, 999)
    with pytest.raises(ValueError, match="needs 24 bytes"):
        unpack_header(h[:10], 1 << 20)
    bad = bytearray(h)
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        unpack_header(bad, 1 << 20)
    bad = bytearray(h)
    bad[2] = 0
    with pytest.raises(ValueError, match="kind 0"):
        unpack_header(bad, 1 << 20)


def test_take_frame_splits_a_read_into_frames_and_waits_for_the_rest():
    a = pack_frame(3, 1, 7, 2, 5, [b"abc"], 64, 1 << 20)[1]
    b = pack_frame(4, 0, 8, 0, 0, [], 64, 1 << 20)[1]  # no payload
    c = pack_frame(1, 2, 9, 3, 0, [b"x" * 40], 64, 1 << 20)[1]
    buf = bytearray(a + b + c)
    view = memoryview(buf)
    first = take_frame(view, 0, len(buf), 1 << 20)
    assert first == (3, 1, 7, 2, 5, bytearray(b"abc"), len(a))
    assert type(first[5]) is bytearray  # a copy of its own: the handler may keep it, unpickle into it
    buf[24] = ord("z")
    assert first[5] == b"abc"
    second = take_frame(view, len(a), len(buf), 1 << 20)
    assert second == (4, 0, 8, 0, 0, b"", 24)
    # the last frame cut short: its header is read, its payload not yet taken
    start = len(a) + len(b)
    assert take_frame(view, start, len(buf) - 1, 1 << 20) == (1, 2, 9, 3, 0, None, len(c))
    assert take_frame(view, start, len(buf), 1 << 20)[5] == b"x" * 40
    assert take_frame(view, start, start + 23, 1 << 20) is None  # under a header
    assert take_frame(view, len(buf), len(buf), 1 << 20) is None


def test_take_frame_checks_the_header_and_the_bounds_before_taking_anything():
    buf = bytearray(pack_header(1, 0, 1000)) + bytearray(1000)
    with pytest.raises(ValueError, match="exceeds the limit of 999 bytes"):
        take_frame(buf, 0, len(buf), 999)
    bad = bytearray(buf)
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        take_frame(bad, 0, len(bad), 1 << 20)
    bad = bytearray(buf)
    bad[2] = 0
    with pytest.raises(ValueError, match="kind 0"):
        take_frame(bad, 0, len(bad), 1 << 20)
    with pytest.raises(ValueError, match="outside a buffer of 1024 bytes"):
        take_frame(buf, 0, 2000, 1 << 20)
    with pytest.raises(ValueError, match="not a range"):
        take_frame(buf, -1, 100, 1 << 20)
    with pytest.raises(ValueError, match="not a range"):
        take_frame(buf, -(2**63), 100, 1 << 20)
    with pytest.raises(ValueError, match="not a range"):
        take_frame(buf, 30, 10, 1 << 20)


class _Conn:
    more = None


def _frames(*specs):
    return [pack_frame(kind, 0, mid, 0, 0, parts, 1 << 10, 1 << 20)[1] for kind, mid, parts in specs]


def test_dispatch_frames_hands_every_complete_frame_to_the_handler_in_order():
    a, b, c = _frames((3, 7, [b"abc"]), (4, 8, []), (1, 9, [b"x" * 40]))
    buf = bytearray(a + b + c)
    got = []
    conn = _Conn()

    def handler(cn, kind, flags, mid, target, view, payload):
        assert cn is conn
        got.append((kind, mid, payload, cn.more))

    # the last frame cut short: it stays, from its first byte, for the next read
    assert dispatch_frames(handler, conn, buf, 0, len(buf) - 1, 1 << 20, True, None, 0.0) == (len(a + b), 0, None)
    assert got == [(3, 7, b"abc", True), (4, 8, b"", True)]  # (conn.more: another header is there, c's)
    assert type(got[0][2]) is bytearray  # a copy of its own: the handler may keep it
    assert dispatch_frames(handler, conn, buf, len(a + b), len(buf), 1 << 20, True, None, 0.0) == (len(buf), 0, None)
    assert got[-1] == (1, 9, b"x" * 40, False)
    assert dispatch_frames(handler, conn, buf, 5, 20, 1 << 20, False, None, 0.0) == (5, 0, None)  # under a header


def test_dispatch_frames_says_when_the_next_frame_needs_a_buffer_of_its_own():
    a, big = _frames((3, 1, [b"a"]), (3, 2, [b"y" * 200]))
    buf = bytearray(128)
    buf[:len(a) + 60] = (a + big)[:len(a) + 60]
    got = []
    assert dispatch_frames(lambda c, *f: got.append(f[2]), None, buf, 0, len(a) + 60, 1 << 20, False, None,
                           0.0) == (len(a), len(big), None)
    assert got == [1]


def test_dispatch_frames_stops_at_a_handler_error_past_its_frame():
    a, b, c = _frames((3, 1, []), (3, 2, []), (3, 3, []))
    buf = bytearray(a + b + c)
    got = []

    def handler(cn, kind, flags, mid, *rest):
        got.append(mid)
        if mid == 2:
            raise KeyError("boom")

    start, status, err = dispatch_frames(handler, None, buf, 0, len(buf), 1 << 20, False, None, 0.0)
    assert (start, status, got) == (len(a + b), 0, [1, 2])
    assert isinstance(err, KeyError) and err.__traceback__ is not None  # (the reader re-raises it as it was)


def test_dispatch_frames_checks_each_header_before_it_takes_anything():
    a, b = _frames((3, 1, []), (3, 2, [b"z" * 100]))
    buf = bytearray(a + b)
    got = []
    with pytest.raises(ValueError, match="exceeds the limit of 99 bytes"):
        dispatch_frames(lambda c, *f: got.append(f[2]), None, buf, 0, len(buf), 99, False, None, 0.0)
    assert got == [1]  # the frames before it went
    bad = bytearray(buf)
    bad[len(a)] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        dispatch_frames(lambda *f: None, None, bad, 0, len(bad), 1 << 20, False, None, 0.0)
    with pytest.raises(ValueError, match="outside a buffer"):
        dispatch_frames(lambda *f: None, None, buf, 0, len(buf) + 1, 1 << 20, False, None, 0.0)
    with pytest.raises(ValueError, match="not a range"):
        dispatch_frames(lambda *f: None, None, buf, 10, 5, 1 << 20, False, None, 0.0)


def test_dispatch_frames_stops_early_once_a_batch_outlasts_its_budget():
    frames = _frames(*[(3, i, []) for i in range(5)])
    buf = bytearray(b"".join(frames))
    ticks = iter(range(100))  # a clock that moves one unit a call
    got = []
    # t0 = 0; after frame 0 the clock reads 1, after frame 1 it reads 2 > 1.5: stop there
    assert dispatch_frames(lambda c, *f: got.append(f[2]), None, buf, 0, len(buf), 1 << 20, False,
                           lambda: next(ticks), 1.5) == (48, -1, None)
    assert got == [0, 1]
    # after the last frame nothing follows: no early stop
    ticks = iter(range(100))
    assert dispatch_frames(lambda c, *f: got.append(f[2]), None, buf, 96, len(buf), 1 << 20, False,
                           lambda: next(ticks) * 10, 1.5) == (len(buf), 0, None)


def test_payload_round_trip_inline_buffers_are_writable():
    a = np.arange(100_000, dtype=np.float64)  # 800 KB, out of band
    p = framing.dumps({"a": a, "s": "x"})
    assert len(p.buffers) == 1 and len(p.pickled) < 1000
    data = bytearray(b"".join(bytes(memoryview(x).cast("B")) for x in framing.encode(p)))
    out = framing.decode(data)
    np.testing.assert_array_equal(out["a"], a)
    assert out["a"].flags.writeable and out["s"] == "x"


def test_payload_through_shared_memory_reuses_segments():
    a = np.arange(1 << 20, dtype=np.float32)
    p = framing.dumps(a)
    seg, placed = framing.write_shm(p, 1)
    parts = framing.encode(p, seg=seg, placed=placed, slot=0)
    out = framing.decode(bytearray(b"".join(bytes(x) for x in parts)))
    np.testing.assert_array_equal(out, a)
    assert seg.flags[0] == 1  # busy while the receiver holds the array
    del out
    import gc

    gc.collect()
    assert seg.flags[0] == 0
    seg2, _ = framing.write_shm(framing.dumps(a), 1)
    assert seg2 is seg  # reused: no fresh pages


def test_unpicklable_is_serialization_error():
    with pytest.raises(SerializationError, match="cannot pickle"):
        framing.dumps(threading.Lock())
    assert issubclass(SerializationError, TypeError)


def test_main_objects_go_through_cloudpickle():
    def f(x):
        return x + 1

    f.__module__ = "__main__"
    f.__qualname__ = "f_not_importable"
    p = framing.dumps(f)
    g = pickle.loads(p.pickled)
    assert g(1) == 2
