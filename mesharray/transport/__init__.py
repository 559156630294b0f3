"""Transport: framing, authentication, sockets and the same-host and network data planes.

Internal: used by the runtime and the collectives; not public API (no
compatibility promise). Its errors are public, in :mod:`mesharray.errors`.

Control messages:

- :mod:`.framing`    — the frame header (packed by ``_core``) and the payload
                       codec (pickle protocol 5 with out-of-band buffers).
- :mod:`.auth`       — the mutual HMAC-SHA256 challenge run on every new
                       connection before a single byte is unpickled.
- :mod:`.address`    — address strings (unix, TCP, dual) and :func:`~.address.connect`,
                       which opens and authenticates a socket to one.
- :mod:`.listener`   — :class:`~.listener.Listener`: accepts and authenticates
                       connections (unix or TCP), bounded against idle peers.
- :mod:`.connection` — :class:`~.connection.Connection`: one socket with
                       framing (a send lock, the write backlog, a reader thread
                       or the poller); no runtime state.
- :mod:`._wire`      — its two per-message steps compiled (Cython): a polled
                       connection's read, and ``write_frame``.
- :mod:`.poller`     — the process's I/O threads: the :class:`~.poller.Poller`
                       that reads polled connections, the :class:`~.poller.Writer`
                       that drains backlogs, and a caller reading several
                       connections at once (:class:`~.poller.ReadSet`).
- :mod:`.spin`       — the spin policy: how long readers and waiting callers poll
                       a socket before they block.
- :mod:`.interrupt`  — Ctrl-C in a controller: a SIGINT handler that raises
                       ``KeyboardInterrupt`` only where the read and write paths
                       leave every connection whole (lines marked ``# ^C``).
- :mod:`.readiness`  — the OS's readiness notification under the poller and the
                       writer: ``epoll``, or a :mod:`selectors` selector.
- :mod:`.sockio`     — reading exactly ``n`` bytes from a blocking socket.

Bulk data:

- :mod:`.shm`        — shared-memory segments that carry large buffers between
                       processes of one host.
- :mod:`.fdpass`     — passing segments' descriptors over a unix socket where
                       ``/proc/<pid>/fd`` cannot be opened (macOS, portable mode).
- :mod:`.cma`        — cross-memory attach (``process_vm_readv``): one copy
                       between two processes of one host.
- :mod:`.hostid`     — which host a process is on: who may share memory with whom.
- :mod:`.dataplane`  — authenticated point-to-point links for bulk data between
                       hosts (TCP), and the choice of plane.
- :mod:`.onesided`   — the one-sided transfers behind ``ma.Buffer``: the owner's
                       registry and tokens, cross-memory attach, its stream
                       server, the UCX plane's transfers.
- :mod:`.ucx`        — the UCX data plane (the ``ucx`` extra): the same links
                       over UCX (RDMA where there is one), one-sided Buffer
                       transfers, the ring's loop in C.
- :mod:`._ucp`       — its compiled half (Cython over UCP's C API, the engine in
                       ``_ucp_engine.h``), built where the ``libucx`` wheel is.
"""

# (not ucx nor _ucp: they need the ucx extra, and ``from mesharray.transport import *`` imports what is listed)
__all__ = ["framing", "auth", "address", "listener", "connection", "poller", "spin", "readiness", "sockio",
           "shm", "fdpass", "cma", "hostid", "dataplane", "onesided"]
