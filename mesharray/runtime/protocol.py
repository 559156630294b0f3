"""Message kinds of the runtime protocol (the ``kind`` byte of a frame header).

==========  =================  ===================================================
kind        direction          header fields / payload
==========  =================  ===================================================
HELLO       any -> listener    first frame of a connection; pickled dict (role, rank,
                               pid, host, address)
CONFIG      ctl -> worker      pickled dict: options (heartbeat interval, labels)
CALL        caller -> worker   msg_id=call id, target=actor id, view=view id,
                               flags & F_REPLY; payload: u8 n + method name + pickled
                               ``(args, kwargs)``
REPLY       worker -> caller   msg_id=call id, target=status (OK, ERR); pickled value
                               or pickled error record
SPAWN       ctl -> worker      msg_id=call id, target=actor id; pickled (cloudpickle)
                               ``(name, cls, args, kwargs, shape)``
VIEW        caller -> worker   view id (per connection) -> pickled ``Shape``
HEARTBEAT   worker -> ctl      empty
LOG         worker -> ctl      target=stream (1 stdout, 2 stderr); utf-8 text
STOP        ctl -> worker      msg_id=call id; the worker replies, then exits
STOP_ACTOR  ctl -> worker      target=actor id; the worker drops the actor
INTROSPECT  ctl -> worker      msg_id=call id; pickled {"what": "snapshot"|"stacks", ...};
                               the worker replies with its telemetry (runtime.recorder)
DEBUG       worker <-> ctl     pickled dict: a paused debugger session (runtime.debugger):
                               ``paused`` on the controller's connection; ``hello``/``cmd``
                               and ``out``/``running`` on a debug connection of their own
==========  =================  ===================================================
"""

from __future__ import annotations

__all__ = [
    "HELLO", "CONFIG", "CALL", "REPLY", "SPAWN", "VIEW", "HEARTBEAT", "LOG", "STOP", "STOP_ACTOR", "INTROSPECT", "DEBUG",
    "F_REPLY", "OK", "ERR", "DIED", "encode_method", "decode_method",
]

HELLO, CONFIG, CALL, REPLY, SPAWN, VIEW, HEARTBEAT, LOG, STOP, STOP_ACTOR, INTROSPECT, DEBUG = range(1, 13)

F_REPLY = 1

OK, ERR, DIED = 0, 1, 2

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
