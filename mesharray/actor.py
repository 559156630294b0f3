"""Actors, endpoints, actor meshes and their adverbs.

An actor is a Python object living in a worker process. ``procs.spawn(name,
Cls, *args)`` makes one per rank of ``procs`` and returns an
:class:`ActorMesh`, a :class:`~mesharray.MeshTrait` with the proc mesh's dims:
index and slice it like a NumPy array, then call an endpoint with an adverb:

- ``call()``      → :class:`Future` of a gathered :class:`~mesharray.MeshArray`
  laid out on the (sliced) mesh's dims; if any rank raises, the future raises.
- ``call_one()``  → :class:`Future` of one value; a mesh of more than one actor
  is a ``ValueError`` raised before anything is sent.
- ``choose()``    → :class:`Future` of one value from a randomly chosen actor.
- ``stream()``    → an iterator of futures, one per actor, in completion order.
- ``broadcast()`` → ``None``; fire and forget (an error is printed by the worker).

Arguments are pickled once per call at the call site (a value that cannot be
pickled raises :class:`~mesharray.SerializationError` there and nothing is
sent). Messages from one sender to one actor run in send order. An
ActorMesh is picklable: an actor that receives one can call it (the worker
connects to its peers directly, the controller is not on the path).

>>> import mesharray as ma
>>> class Counter(ma.Actor):
...     def __init__(self, start):
...         self.value = start
...     @ma.endpoint
...     def incr(self, by=1):
...         self.value += by
...     @ma.endpoint
...     def get(self):
...         return self.value
>>> with ma.proc_mesh(hosts=1, procs=2) as procs:          # doctest: +SKIP
...     c = procs.spawn("c", Counter, 0)
...     c.incr.broadcast()
...     c.get.call().get().sum()
2
"""

from __future__ import annotations

import inspect
import itertools
import queue
import random
from typing import Any

from .errors import ActorError, SerializationError
from .mesh import MeshTrait
from .runtime import protocol as P
from .runtime.context import current
from .runtime.future import Future
from .runtime.router import get_router
from .transport import framing

__all__ = ["Actor", "ActorMesh", "Endpoint", "Future", "endpoint", "context", "current_rank",
           "current_size"]


# --------------------------------------------------------------------------- actors
class Actor:
    """Base class of actors: subclass it and mark methods with :func:`endpoint`.

    Endpoints may be sync or ``async``. The constructor runs in the worker at
    spawn; if it raises, the spawn fails with :class:`~mesharray.ActorError`.

    Examples
    --------
    >>> import mesharray as ma
    >>> class Echo(ma.Actor):
    ...     @ma.endpoint
    ...     def echo(self, x):
    ...         return x
    >>> sorted(Echo._mesharray_endpoints)
    ['echo']
    """

    _mesharray_endpoints: dict = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        eps: dict = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                opts = getattr(value, "_mesharray_endpoint", None)
                if opts is not None:
                    eps[name] = opts
                elif name in eps:
                    del eps[name]  # overridden by a plain method
        cls._mesharray_endpoints = eps


def endpoint(fn=None, *, concurrent: bool = False):
    """Mark an actor method as callable from other processes.

    ``@endpoint`` or ``@endpoint(concurrent=True)``; the latter lets calls of an
    ``async`` endpoint of one actor overlap (each runs as its own task).

    Examples
    --------
    >>> import mesharray as ma
    >>> class Sleeper(ma.Actor):
    ...     @ma.endpoint(concurrent=True)
    ...     async def nap(self, s):
    ...         import asyncio
    ...         await asyncio.sleep(s)
    >>> Sleeper._mesharray_endpoints["nap"]
    {'concurrent': True}
    """
    def mark(f):
        if not callable(f):
            raise TypeError(f"@endpoint decorates a function, got {type(f).__name__}")
        if concurrent and not inspect.iscoroutinefunction(f):
            raise TypeError(f"@endpoint(concurrent=True) needs an async def, got {f.__qualname__}")
        f._mesharray_endpoint = {"concurrent": bool(concurrent)}
        return f

    return mark if fn is None else mark(fn)


def context():
    """The :class:`~mesharray.runtime.context.Context` of the actor running this code.

    Raises ``RuntimeError`` outside an actor.

    Examples
    --------
    >>> import mesharray as ma
    >>> class Who(ma.Actor):
    ...     @ma.endpoint
    ...     def where(self):
    ...         return ma.context().message_rank
    """
    ctx = current.get()
    if ctx is None:
        raise RuntimeError("context() is only available inside an actor")
    return ctx


def current_rank() -> dict:
    """Coordinates of the calling actor on the mesh it was spawned on (inside an actor).

    >>> import mesharray as ma
    >>> ma.current_rank()   # doctest: +SKIP  (only inside an actor)
    {'hosts': 0, 'procs': 1}
    """
    ctx = current.get()
    if ctx is None:
        raise RuntimeError("current_rank() is only available inside an actor")
    return ctx.rank


def current_size() -> dict:
    """Sizes of the slice the current message was sent to (inside an actor).

    >>> import mesharray as ma
    >>> ma.current_size()   # doctest: +SKIP  (only inside an actor)
    {'hosts': 1, 'procs': 4}
    """
    ctx = current.get()
    if ctx is None:
        raise RuntimeError("current_size() is only available inside an actor")
    return ctx.message_size


# --------------------------------------------------------------------------- replies
def _actor_error(rec: dict) -> ActorError:
    exc = rec["exc"]
    cur = exc
    for e, is_cause in rec.get("chain", ()):
        if is_cause:
            cur.__cause__ = e
        else:
            cur.__context__ = e
        cur = e
    err = ActorError(exc, rank=rec.get("rank"), traceback_text=rec.get("tb", ""), actor=rec.get("actor", ""),
                     host=rec.get("host", ""), pid=rec.get("pid"))
    return err


_NONE_REPLY = b"".join(framing.encode(framing.dumps(None)))  # what a worker sends for ``None``


def _outcome(status, payload):
    """(value, exception) of one reply."""
    if status == P.OK:
        if payload == _NONE_REPLY:
            return None, None
        try:
            return framing.decode(payload), None
        except Exception as exc:
            return None, SerializationError(f"cannot unpickle a reply: {type(exc).__name__}: {exc}")
    if status == P.ERR:
        try:
            return None, _actor_error(framing.decode(payload))
        except Exception as exc:
            return None, SerializationError(f"cannot unpickle a remote error: {type(exc).__name__}: {exc}")
    return None, payload  # DIED: payload is the error


def future_callback(fut: Future):
    """The reply callback (``cb(status, payload)``) that completes ``fut`` with one reply's outcome."""
    def cb(status, payload):
        value, exc = _outcome(status, payload)
        if exc is None:
            fut._set_result(value)
        else:
            fut._set_exception(exc)
    return cb


class _Gather:
    """Collects the replies of a ``call()``; ``next()`` on a count is atomic under the GIL,
    so the reader threads of different ranks need no lock."""

    __slots__ = ("fut", "values", "n", "count", "shape")

    def __init__(self, fut, n, shape) -> None:
        self.fut = fut
        self.values = [None] * n
        self.n = n
        self.count = itertools.count(1).__next__
        self.shape = shape

    def slot(self, i):
        def cb(status, payload):
            value, exc = _outcome(status, payload)
            if exc is not None:
                self.fut._set_exception(exc)
                return
            self.values[i] = value
            if self.count() == self.n:
                self._finish()
        return cb

    def _finish(self) -> None:
        from .array import MeshArray

        if self.fut._done():
            return
        try:
            self.fut._set_result(MeshArray.from_results(self.shape, self.values))
        except Exception as exc:
            self.fut._set_exception(exc)


# --------------------------------------------------------------------------- meshes
class ActorMesh(MeshTrait):
    """One actor per rank of a process mesh (or of a slice of it).

    Made by :meth:`ProcMesh.spawn`; index and slice it like the proc mesh
    (views share the actors). Endpoints are attributes: ``mesh.method`` is an
    :class:`Endpoint` with the adverbs ``call``, ``call_one``, ``choose``,
    ``stream`` and ``broadcast``.

    Examples
    --------
    >>> counters = procs.spawn("counters", Counter, 0)   # doctest: +SKIP
    >>> counters[0, 1:3].incr.call().get()               # doctest: +SKIP
    """

    def __init__(self, name: str, actor_id: int, cls_name: str, endpoints: dict, shape, addresses,
                 proc_mesh=None) -> None:
        self._name = name
        self._actor_id = actor_id
        self._cls_name = cls_name
        self._endpoints = endpoints
        self._shape = shape
        self._addresses = addresses
        self._proc_mesh = proc_mesh

    @property
    def _mesh_shape(self):
        return self._shape

    def _with_mesh_shape(self, shape):
        return ActorMesh(self._name, self._actor_id, self._cls_name, self._endpoints, shape,
                         self._addresses, self._proc_mesh)

    @property
    def name(self) -> str:
        """The name given at spawn."""
        return self._name

    def __getattr__(self, name: str) -> "Endpoint":
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._endpoints:
            raise AttributeError(f"actor {self._name!r} ({self._cls_name}) has no endpoint {name!r}; "
                                 f"endpoints are {sorted(self._endpoints)}")
        ep = self.__dict__[name] = Endpoint(self, name)  # later lookups skip __getattr__
        return ep

    def __reduce__(self):
        return (ActorMesh, (self._name, self._actor_id, self._cls_name, self._endpoints, self._shape,
                            self._addresses))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self._shape.extent.items())
        return f"<ActorMesh {self._name!r} {self._cls_name} {{{sizes}}}>"

    def stop(self) -> None:
        """Drop these actors on their workers (later calls fail with ``ActorError``)."""
        router = get_router()
        for r in self._shape:
            try:
                router.channel(self._addresses[r]).send(P.STOP_ACTOR, 0, 0, self._actor_id, 0)
            except Exception:
                pass


_NO_ARGS = framing.dumps(((), {}))
_NO_ARGS_BYTES = b"".join(framing.encode(_NO_ARGS))


class Endpoint:
    """An endpoint of an actor mesh: the adverbs that send a message to its actors."""

    __slots__ = ("_mesh", "_name", "_method", "_noargs")

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh = mesh
        self._name = name
        self._method = P.encode_method(name)
        self._noargs = [self._method + _NO_ARGS_BYTES]  # the whole payload of a call without arguments

    def _send(self, ranks, shape, args, kwargs, cbs, park: bool = False) -> list:
        """Pickle once, then send one CALL per rank (``cbs[i]`` gets rank i's reply; ``None``: a broadcast).

        Returns the channels used (``None`` for a rank that could not be reached).
        """
        if args or kwargs:
            p = framing.dumps((args, kwargs))
            plain = None
        else:
            p, plain = _NO_ARGS, self._noargs
        mesh = self._mesh
        return get_router().send_many(mesh._addresses, ranks, P.CALL, mesh._actor_id, shape, p,
                                      self._method, plain, cbs, park)

    def call(self, *args, **kwargs) -> Future:
        """Call every actor of the mesh; a future of the gathered :class:`~mesharray.MeshArray`.

        Examples
        --------
        >>> counters.get.call().get()       # doctest: +SKIP
        MeshArray([[0, 0, 0, 0]], dims=('hosts', 'procs'))
        """
        shape = self._mesh._shape
        ranks = list(shape)
        fut = Future._new()
        g = _Gather(fut, len(ranks), shape)
        cbs = [g.slot(i) for i in range(len(ranks))]
        if not ranks:
            g._finish()
            return fut
        chans = self._send(ranks, shape, args, kwargs, cbs, park=True)
        for c in chans:
            if c is None or not c.polled:
                break
        else:  # all polled: get() reads the replies in its own thread
            fut._chan = tuple(chans)
        return fut

    def _send_one(self, rank, shape, args, kwargs, cb):
        """The latency path of ``call_one``/``choose``: one rank, small arguments."""
        if args or kwargs:
            p = framing.dumps((args, kwargs))
            if p.big:
                mesh = self._mesh
                chan = get_router().send_many(mesh._addresses, (rank,), P.CALL, mesh._actor_id, shape, p,
                                              self._method, None, (cb,))[0]
                return chan if chan is not None and chan.polled else None
            parts = [self._method, *framing.encode(p)]
        else:
            parts = self._noargs
        try:
            chan = get_router().channel(self._mesh._addresses[rank])
            vid = chan.view_id(shape)
        except Exception as exc:
            cb(P.DIED, exc)
            return None
        polled = chan.polled
        chan.call(P.CALL, self._mesh._actor_id, vid, parts, cb, polled)
        return chan if polled else None

    def call_one(self, *args, **kwargs) -> Future:
        """Call the only actor of the mesh; ``ValueError`` (nothing sent) if it has more than one.

        Examples
        --------
        >>> counters.slice(procs=-1).get.call_one().get()   # doctest: +SKIP
        0
        """
        shape = self._mesh._shape
        n = shape.size
        if n != 1:
            raise ValueError(f"call_one requires exactly 1 actor, but mesh has {n}")
        fut = Future._new()
        fut._chan = self._send_one(shape.rank(0), shape, args, kwargs, future_callback(fut))
        return fut

    def choose(self, *args, **kwargs) -> Future:
        """Call one actor of the mesh, chosen at random; a future of its value."""
        shape = self._mesh._shape
        if shape.size == 0:
            raise ValueError("choose needs at least 1 actor, but mesh has 0")
        r = shape.rank(random.randrange(shape.size))
        fut = Future._new()
        fut._chan = self._send_one(r, shape, args, kwargs, future_callback(fut))
        return fut

    def stream(self, *args, **kwargs):
        """Call every actor; an iterator of futures (one per actor) in completion order.

        The calls are sent at once; iterating waits for the next completion.

        Examples
        --------
        >>> [f.get() for f in counters.get.stream()]   # doctest: +SKIP
        [0, 0, 0, 0]
        """
        shape = self._mesh._shape
        ranks = list(shape)
        done: queue.SimpleQueue = queue.SimpleQueue()
        futs = [Future._new() for _ in ranks]
        for f in futs:
            f.add_done_callback(done.put)
        self._send(ranks, shape, args, kwargs, [future_callback(f) for f in futs])

        def gen(n=len(ranks)):
            from .runtime.channel import flush_all

            for _ in range(n):
                flush_all()
                yield done.get()
        return gen()

    def broadcast(self, *args, **kwargs) -> None:
        """Send to every actor without waiting for, or receiving, any reply.

        Ordered with the other messages of this sender; an exception in the
        endpoint is printed by the worker (the actor survives). Actors on
        processes known to be dead are skipped: the message still reaches every
        other actor, then :class:`~mesharray.ActorDiedError` is raised.
        """
        shape = self._mesh._shape
        self._send(list(shape), shape, args, kwargs, None)

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self._name}>"
