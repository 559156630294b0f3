"""Message kinds of the runtime protocol (the ``kind`` byte of a frame header).

==========  =================  ===================================================
kind        direction          header fields / payload
==========  =================  ===================================================
HELLO       any -> listener    first frame of a connection; pickled dict (role, rank,
                               pid, host, address)
CONFIG      ctl -> worker      pickled dict: options (heartbeat interval, labels); from a
                               relay: ``beat_slot`` = (pid, memfd, offset), where the rank
                               writes its heartbeats (``BEAT_SLOT``) instead of sending them
CALL        caller -> worker   msg_id=call id, target=actor id, view=view id,
                               flags & F_REPLY; payload: u8 n + method name + pickled
                               ``(args, kwargs)``
REPLY       worker -> caller   msg_id=call id, target=status (OK, ERR); pickled value
                               or pickled error record
SPAWN       ctl -> worker      msg_id=call id, target=actor id; pickled (cloudpickle)
                               ``(name, cls, args, kwargs, shape)``
VIEW        caller -> worker   view id (per connection) -> pickled ``Shape``
HEARTBEAT   worker -> ctl      empty (to a relay too, until it gives a ``beat_slot``)
LOG         worker -> ctl      target=stream (1 stdout, 2 stderr); utf-8 text
STOP        ctl -> worker      msg_id=call id; the worker replies, then exits
STOP_ACTOR  ctl -> worker      target=actor id; the worker drops the actor
INTROSPECT  ctl -> worker      msg_id=call id; pickled {"what": "snapshot"|"stacks", ...};
                               the worker replies with its telemetry (runtime.recorder)
            ctl -> relay       the same, for every rank of the relay's host: the relay
                               asks each and answers once, ``GATHERED``
DEBUG       worker <-> ctl     pickled dict: a paused debugger session (runtime.debugger):
                               ``paused`` on the controller's connection; ``hello``/``cmd``
                               and ``out``/``running`` on a debug connection of their own
RELAY       ctl -> relay       one message for several ranks of the relay's host:
                               msg_id=call id (0: no reply), target=actor id, view=view
                               id, flags = F_REPLY | inner kind << 4 (CALL, SPAWN,
                               STOP_ACTOR); payload: the targets (:func:`pack_targets`)
                               then the inner frame's payload, which the relay sends on
FENCE       ctl -> worker      msg_id=n: handle no later frame of this connection before
                               n frames from the relay were (a direct frame after relayed
                               ones)
            ctl -> relay       target=rank, msg_id=n: the relay sends that rank a FENCE
            relay -> worker    msg_id=n: handle no later relayed frame before n frames
                               of the controller connection were (the other way round)
BEAT        relay -> ctl       the host's heartbeat: pickled {rank: seconds silent} of
                               the ranks whose heartbeats are late (usually empty)
GONE        ctl -> relay       target=rank: the controller recorded this rank's death;
                               the relay answers its part of every relayed call now
                               and sends it nothing more
            relay -> ctl       msg_id=call id, target=rank: that part, one per call in
                               flight (:func:`pack_gathered`, one entry: the reply it
                               had before the rank went, else ``DIED``)
==========  =================  ===================================================

A relay answers a relayed call with one ``REPLY`` whose status is ``GATHERED``
and whose payload holds every target's reply (:func:`pack_gathered`).
"""

from __future__ import annotations

import struct
from array import array

__all__ = [
    "HELLO", "CONFIG", "CALL", "REPLY", "SPAWN", "VIEW", "HEARTBEAT", "LOG", "STOP", "STOP_ACTOR", "INTROSPECT", "DEBUG",
    "RELAY", "FENCE", "BEAT", "GONE", "BEAT_SLOT", "F_REPLY", "OK", "ERR", "DIED", "GATHERED", "encode_method", "decode_method",
    "pack_targets", "unpack_targets", "pack_gathered", "unpack_gathered", "uniform_gathered",
]

HELLO, CONFIG, CALL, REPLY, SPAWN, VIEW, HEARTBEAT, LOG, STOP, STOP_ACTOR, INTROSPECT, DEBUG = range(1, 13)
RELAY, FENCE, BEAT, GONE = 13, 14, 15, 16

F_REPLY = 1

OK, ERR, DIED, GATHERED = 0, 1, 2, 3

#: a rank's heartbeat in its slot of its relay's shared segment (``beat_slot`` of the relay's CONFIG):
#: its ``time.monotonic()``, a clock every process of a host shares (runtime.relay); native order, as the
#: rank's compiled heartbeat (transport._wire.Beats) stores it
BEAT_SLOT = struct.Struct("=d")

_U32 = struct.Struct("<I")
_ENTRY = struct.Struct("<III")  # position, status, length of one gathered reply
_UNIFORM = struct.Struct("<II")
_ALL = 0xFFFFFFFF  # (the count of a payload that every position answered alike)

_method_cache: dict[str, bytes] = {}


def encode_method(name: str) -> bytes:
    b = _method_cache.get(name)
    if b is None:
        raw = name.encode()
        if len(raw) > 255:
            raise ValueError(f"endpoint name is too long ({len(raw)} bytes; at most 255)")
        b = _method_cache[name] = bytes((len(raw),)) + raw
    return b


def decode_method(payload) -> tuple[str, int]:
    n = payload[0]
    return bytes(payload[1:1 + n]).decode(), 1 + n


def pack_targets(ranks, reply=None) -> bytes:
    """The targets of a ``RELAY`` frame: ``u32 n, u32 has_mask``, ``n`` u32 ranks, then (with
    ``reply``, one bool per rank: which ranks answer) ``n`` bytes.

    >>> unpack_targets(memoryview(pack_targets([4, 5, 7], [True, False, True])))
    ([4, 5, 7], [1, 0, 1], 23)
    >>> unpack_targets(memoryview(pack_targets([4, 5])))
    ([4, 5], None, 16)
    """
    head = struct.pack("<II", len(ranks), reply is not None)
    body = array("I", ranks).tobytes()
    if reply is None:
        return head + body
    return head + body + bytes(1 if r else 0 for r in reply)


def unpack_targets(payload) -> tuple[list[int], list[int] | None, int]:
    """``(ranks, reply mask or None, bytes used)`` of :func:`pack_targets`' part of ``payload``."""
    n, has_mask = struct.unpack_from("<II", payload, 0)
    end = 8 + 4 * n
    ranks = array("I", payload[8:end]).tolist()
    if not has_mask:
        return ranks, None, end
    return ranks, list(payload[end:end + n]), end + n


def pack_gathered(entries, count: int = 0) -> list:
    """The parts of a ``GATHERED`` payload: ``u32 n``, ``n`` x ``(u32 position, u32 status, u32 length)``,
    then the payloads in that order (``entries``: ``(position, status, payload)``).

    When all ``count`` positions answered ``OK`` with the same bytes (a call whose every rank
    returns ``None``), it is ``u32 0xFFFFFFFF, u32 count`` and those bytes once:
    :func:`uniform_gathered` says so, and the caller decodes them once.

    >>> b = b"".join(pack_gathered([(1, OK, b"ab"), (0, DIED, b"")]))
    >>> [(p, s, bytes(x)) for p, s, x in unpack_gathered(memoryview(b))]
    [(1, 0, b'ab'), (0, 2, b'')]
    >>> u = memoryview(b"".join(pack_gathered([(1, OK, b"n"), (0, OK, b"n")], 2)))
    >>> uniform_gathered(u) is not None and bytes(uniform_gathered(u)), len(unpack_gathered(u))
    (b'n', 2)
    """
    if count and len(entries) == count and entries:
        first = entries[0][2]
        if all(st == OK and p == first for _, st, p in entries):
            return [_UNIFORM.pack(_ALL, count), first]
    head = bytearray(_U32.pack(len(entries)))
    for pos, status, payload in entries:
        head += _ENTRY.pack(pos, status, len(payload))
    return [bytes(head), *(p for _, _, p in entries if len(p))]


def uniform_gathered(payload):
    """The one payload every position answered ``OK`` with, if :func:`pack_gathered` found them all equal, else None."""
    if len(payload) >= 8 and _U32.unpack_from(payload, 0)[0] == _ALL:
        return payload[8:]
    return None


def unpack_gathered(payload) -> list:
    """``[(position, status, payload view)]`` of a :func:`pack_gathered` payload."""
    (n,) = _U32.unpack_from(payload, 0)
    if n == _ALL:
        one = payload[8:]
        return [(i, OK, one) for i in range(_U32.unpack_from(payload, 4)[0])]
    off = 4 + 12 * n
    out = []
    for i in range(n):
        pos, status, length = _ENTRY.unpack_from(payload, 4 + 12 * i)
        out.append((pos, status, payload[off:off + length]))
        off += length
    return out
