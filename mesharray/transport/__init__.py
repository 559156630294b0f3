"""Transport: framing, authentication, sockets and the same-host data plane.

Internal: used by the runtime and the collectives; not public API (no
compatibility promise). Its errors are public, in :mod:`mesharray.errors`.

- :mod:`.framing`    — the frame header (packed by ``_core``) and the payload
                       codec (pickle protocol 5 with out-of-band buffers).
- :mod:`.auth`       — the mutual HMAC-SHA256 challenge run on every new
                       connection before a single byte is unpickled.
- :mod:`.connection` — :class:`Connection` (one socket with framing: a send lock,
                       the write backlog, a reader thread or the poller) and
                       :class:`Listener` (unix or TCP); no runtime state.
- :mod:`.sockio`     — reading exactly ``n`` bytes from a blocking socket.
- :mod:`.shm`        — shared-memory segments that carry large buffers between
                       processes of one host.
"""

__all__ = ["framing", "auth", "connection", "shm", "sockio"]
