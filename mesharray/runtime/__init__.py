"""The actor runtime: controller and worker loops, calls, futures, supervision.

Internal: nothing here is public API and it may change without notice. Users
reach the runtime through ``mesharray`` (``ma.proc_mesh``, ``ma.Actor``,
``ma.Future``, ``ma.context()``); the one public class defined here,
:class:`Future`, reports ``mesharray`` as its ``__module__``.

- :mod:`.protocol`   — message kinds and the hand-packed parts of messages.
- :mod:`.future`     — the one :class:`Future` type (``Future[T]``).
- :mod:`.channel`    — :class:`Channel`: the runtime's state per peer connection (pending
                       calls, views, corking, reading replies in the caller's thread).
- :mod:`.caller`     — :class:`~.caller.Caller`: an endpoint's send loops (``call``, ``call_one``,
                       ``stream``, ``broadcast``), reply decoding and gathering; what
                       ``mesharray.actor``'s adverbs run.
- :mod:`.router`     — sends calls to actors (by worker address) and resolves replies;
                       one per process, used by the controller and by actors alike.
- :mod:`.worker`     — :func:`run_worker`, the loop every worker runs.
- :mod:`.controller` — :class:`Controller`: listener, adoption of workers,
                       supervision (EOF + exit status, heartbeats), spawning and
                       stopping actors, stop.
- :mod:`.hosts`      — :class:`~.hosts.HostPlane`: the controller's fan-out through the
                       relays of a mesh's hosts (one frame per host, gathered replies,
                       the fences that keep each rank's order across both paths).
- :mod:`.relay`      — the relay process of one host of such a mesh: forwards, gathers,
                       watches its workers' heartbeats, answers telemetry for its host.
- :mod:`.context`    — ``ma.context()``: the rank, mesh and call an actor's code runs in.
- :mod:`.recorder`   — what every process records about itself for ``procs.telemetry``
                       (call rows, actor events, errors, process samples).
- :mod:`.logs`       — workers' output forwarded as LOG frames; the controller's
                       :class:`LogSink` prints it prefixed, identical lines of several ranks once.
- :mod:`.counters`   — :class:`Counters`: replies, errors, spawns, deaths per process mesh
                       (``ProcMesh.stats()``).
- :mod:`.debugger`   — ``breakpoint()`` in actors: the workers' remote pdb, the controller's
                       paused sessions and ``(ma-debug)`` console, and its listener for
                       ``python -m mesharray debug``.
- :mod:`.notebook`   — a controller in a Jupyter kernel: a call's worker output shown in
                       its cell, the Ctrl-C guard put back before each cell.
"""

__all__ = ["protocol", "future", "channel", "caller", "router", "worker", "controller", "hosts", "relay", "context",
           "recorder", "logs", "counters", "debugger", "notebook"]
