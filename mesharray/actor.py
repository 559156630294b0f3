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
...     int(c.get.call().get().sum())
2

Typing: endpoints keep their parameter and return types. For a type checker,
``@endpoint`` turns ``def get(self) -> int`` into an :class:`EndpointProperty`
whose instance access is an ``Endpoint[[], int]``, so ``c.get.call_one()`` is a
``Future[int]`` and ``c.get.call_one("x")`` is an error. ``procs.spawn(name,
Counter)`` is typed as ``Counter`` (as Monarch does): a user's actor class
doubles, for the type checker only, as the type of its mesh — its endpoints are
the mesh's endpoints, a typo such as ``c.gett`` is an error, and the mesh API
(indexing, ``slice``, ``sizes``, ``name``, ``stop``, ...) comes from the
:class:`Actor` base. At run time nothing of this exists: ``@endpoint`` returns
the function itself, ``spawn`` returns an :class:`ActorMesh`, and
``ActorMesh.__getattr__`` makes each :class:`Endpoint`. One consequence: inside
an actor, ``self.get`` is the endpoint to the checker too, so code an actor
calls on itself belongs in a plain (undecorated) method.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from .array import MeshArray
from .mesh import MeshTrait
from .runtime.caller import Caller
from .runtime.context import current
from .runtime.controller import stop_actors
from .runtime.future import Future

if TYPE_CHECKING:  # pragma: no cover
    from ._core import Shape
    from .runtime.context import Context

__all__ = ["Actor", "ActorMesh", "Endpoint", "EndpointProperty", "Future", "endpoint", "context",
           "current_rank", "current_size"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

if TYPE_CHECKING:  # pragma: no cover

    class _MeshSurface(MeshTrait):
        """What a type checker sees on an actor class besides its endpoints.

        ``ProcMesh.spawn(name, Cls)`` is typed ``Cls`` so that the endpoints of
        the mesh keep their types; this gives that type the rest of the
        :class:`ActorMesh` API. Actor instances have none of it at run time.
        The data-like members are declared as plain attributes, not read-only
        properties, so that an actor may keep its own ``self.name`` or
        ``self.shape`` (of a compatible type) without a type error.
        """

        name: str
        names: tuple[str, ...]
        shape: tuple[int, ...]
        sizes: dict[str, int]
        ndim: int

        def stop(self) -> None: ...

else:
    _MeshSurface = object


# --------------------------------------------------------------------------- actors
class Actor(_MeshSurface):
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

    _mesharray_endpoints: dict[str, dict[str, bool]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        eps: dict[str, dict[str, bool]] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                opts = getattr(value, "_mesharray_endpoint", None)
                if opts is not None:
                    eps[name] = opts
                elif name in eps:
                    del eps[name]  # overridden by a plain method
        hidden = sorted(set(eps) & _mesh_attributes())
        if hidden:
            # on the actor mesh these names are the mesh's own (counters.size is its size):
            # an endpoint of that name would be silently unreachable
            raise TypeError(
                f"{cls.__qualname__} has endpoint(s) {hidden} named like attributes of its actor mesh "
                f"(ActorMesh.{hidden[0]}, ...), which would hide them; rename them (e.g. "
                f"{', '.join(repr('get_' + h) for h in hidden)}). Mesh attributes: {sorted(_mesh_attributes())}")
        cls._mesharray_endpoints = eps


def endpoints_of(actor_class: type) -> dict[str, dict[str, bool]]:
    """The endpoints of an :class:`Actor` subclass: name -> options (a fresh dict)."""
    return dict(actor_class._mesharray_endpoints)  # type: ignore[attr-defined]


def _mesh_attributes() -> frozenset[str]:
    """The public attributes of an ``ActorMesh`` (an endpoint may not be named like one)."""
    global _MESH_ATTRS
    if _MESH_ATTRS is None:
        _MESH_ATTRS = frozenset(n for n in dir(ActorMesh) if not n.startswith("_"))
    return _MESH_ATTRS


_MESH_ATTRS: frozenset[str] | None = None


class EndpointProperty(Generic[_P, _R]):
    """The type checker's view of an ``@endpoint`` method (never made at run time).

    On an actor mesh (typed as its actor class, see :meth:`ProcMesh.spawn
    <mesharray.ProcMesh.spawn>`) it is an ``Endpoint[P, R]``: the method's
    parameters ``P`` (without ``self``) and its result ``R`` (awaited for an
    ``async def``). On the class it is the plain function.
    """

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Callable[..., Any]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Endpoint[_P, _R]: ...
    def __get__(self, instance: object, owner: type | None = None) -> Any:
        raise NotImplementedError  # pragma: no cover - typing only


class _EndpointDecorator:
    """The type of ``endpoint(concurrent=...)``: a decorator keeping the method's types."""

    @overload
    def __call__(self, fn: Callable[Concatenate[Any, _P], Awaitable[_R]]) -> EndpointProperty[_P, _R]: ...
    @overload
    def __call__(self, fn: Callable[Concatenate[Any, _P], _R]) -> EndpointProperty[_P, _R]: ...
    def __call__(self, fn: Any) -> Any:
        raise NotImplementedError  # pragma: no cover - typing only


@overload
def endpoint(fn: Callable[Concatenate[Any, _P], Awaitable[_R]], *,
             concurrent: bool = False) -> EndpointProperty[_P, _R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, _P], _R], *, concurrent: bool = False) -> EndpointProperty[_P, _R]: ...
@overload
def endpoint(fn: None = None, *, concurrent: bool = False) -> _EndpointDecorator: ...
def endpoint(fn: Any = None, *, concurrent: bool = False) -> Any:
    """Mark an actor method as callable from other processes.

    ``@endpoint`` or ``@endpoint(concurrent=True)``; the latter lets calls of an
    ``async`` endpoint of one actor overlap (each runs as its own task).

    The function itself is returned (marked); for a type checker the result is
    an :class:`EndpointProperty` that keeps the parameter and return types.

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
    def mark(f: Any) -> Any:
        if not callable(f):
            raise TypeError(f"@endpoint decorates a function, got {type(f).__name__}")
        if concurrent and not inspect.iscoroutinefunction(f):
            raise TypeError(f"@endpoint(concurrent=True) needs an async def, got {f.__qualname__}")
        f._mesharray_endpoint = {"concurrent": bool(concurrent)}
        return f

    return mark if fn is None else mark(fn)


# context(), current_rank() and current_size() each show a whole actor in their example: a
# reader sees it whole, and tests/docs runs each example on a mesh
def _current(what: str) -> Context:
    ctx = current.get()
    if ctx is None:
        raise RuntimeError(f"{what} is only available inside an actor")
    return ctx


def context() -> Context:
    """The :class:`~mesharray.runtime.context.Context` of the actor running this code.

    Raises ``RuntimeError`` outside an actor.

    Examples
    --------
    An endpoint that says which actor, process and message slice it runs for:

    >>> import mesharray as ma
    >>> class Who(ma.Actor):
    ...     @ma.endpoint
    ...     def where(self):
    ...         ctx = ma.context()
    ...         return ctx.actor_name, ctx.global_rank, ctx.message_rank
    """
    return _current("context()")


def current_rank() -> dict[str, int]:
    """Coordinates of the calling actor on the mesh it was spawned on (inside an actor).

    Examples
    --------
    >>> import mesharray as ma
    >>> class Where(ma.Actor):
    ...     @ma.endpoint
    ...     def where(self):
    ...         return ma.current_rank()
    >>> procs.spawn("where", Where)[0, 1].where.call_one().get()   # doctest: +SKIP
    {'hosts': 0, 'procs': 1}
    """
    return _current("current_rank()").rank


def current_size() -> dict[str, int]:
    """Sizes of the slice the current message was sent to (inside an actor).

    An endpoint written as in :func:`current_rank`'s example but returning
    ``ma.current_size()``, on an actor mesh of 1 host x 4 procs, returns
    ``{'hosts': 1, 'procs': 4}`` to a call to all of it and ``{'procs': 2}`` to
    a call to ``actors[0, 1:3]`` (the dims the slice kept, and their sizes).
    """
    return _current("current_size()").message_size


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
    MeshArray(procs=2, dtype=object)
    [None None]
    """

    def __init__(self, name: str, actor_id: int, cls_name: str, endpoints: dict[str, dict[str, bool]],
                 shape: Shape, addresses: Sequence[Any], proc_mesh: Any = None) -> None:
        self._name, self._actor_id, self._cls_name, self._endpoints = name, actor_id, cls_name, endpoints
        self._shape, self._addresses, self._proc_mesh = shape, addresses, proc_mesh

    @property
    def _mesh_shape(self) -> Shape:
        return self._shape

    def _with_mesh_shape(self, shape: Shape) -> ActorMesh:
        return ActorMesh(self._name, self._actor_id, self._cls_name, self._endpoints, shape,
                         self._addresses, self._proc_mesh)

    @property
    def name(self) -> str:
        """The name given at spawn."""
        return self._name

    def __getattr__(self, name: str) -> Endpoint[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._endpoints:
            raise AttributeError(f"actor {self._name!r} ({self._cls_name}) has no endpoint {name!r}; "
                                 f"endpoints are {sorted(self._endpoints)}")
        ep: Endpoint[..., Any] = Endpoint(self, name)
        self.__dict__[name] = ep  # later lookups skip __getattr__
        return ep

    def __reduce__(self) -> tuple[Any, ...]:
        return (ActorMesh, (self._name, self._actor_id, self._cls_name, self._endpoints, self._shape,
                            self._addresses))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self._shape.extent.items())
        return f"<ActorMesh {self._name!r} {self._cls_name} {{{sizes}}}>"

    def stop(self) -> None:
        """Drop these actors on their workers (later calls fail with ``ActorError``)."""
        stop_actors(self._addresses, list(self._shape), self._actor_id)


class Endpoint(Generic[_P, _R]):
    """An endpoint of an actor mesh: the adverbs that send a message to its actors.

    ``Endpoint[P, R]`` for an endpoint method taking parameters ``P`` (after
    ``self``) and returning ``R`` (or an awaitable of ``R``): the adverbs take
    ``P``; ``call_one`` and ``choose`` give a ``Future[R]``. The sending is the
    runtime's (:class:`~mesharray.runtime.caller.Caller`, one per endpoint).
    """

    __slots__ = ("_mesh", "_name", "_caller")

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh = mesh
        self._name = name
        self._caller = Caller(mesh._addresses, mesh._actor_id, name)

    def call(self, *args: _P.args, **kwargs: _P.kwargs) -> Future[MeshArray]:
        """Call every actor of the mesh; a future of the gathered :class:`~mesharray.MeshArray`.

        Examples
        --------
        >>> counters.get.call().get()       # doctest: +SKIP
        MeshArray(hosts=1, procs=4, dtype=int64)
        [[0 0 0 0]]
        """
        return self._caller.call(self._mesh._shape, args, kwargs)

    def call_one(self, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
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
        return self._caller.call_one(shape.rank(0), shape, args, kwargs)

    def choose(self, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        """Call one actor of the mesh, chosen at random; a future of its value."""
        shape = self._mesh._shape
        if shape.size == 0:
            raise ValueError("choose needs at least 1 actor, but mesh has 0")
        return self._caller.call_one(shape.rank(random.randrange(shape.size)), shape, args, kwargs)

    def stream(self, *args: _P.args, **kwargs: _P.kwargs) -> Iterator[Future[_R]]:
        """Call every actor; an iterator of futures (one per actor) in completion order.

        The calls are sent at once; iterating waits for the next completion.

        Examples
        --------
        >>> [f.get() for f in counters.get.stream()]   # doctest: +SKIP
        [0, 0, 0, 0]
        """
        return self._caller.stream(self._mesh._shape, args, kwargs)

    def broadcast(self, *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Send to every actor without waiting for, or receiving, any reply.

        Ordered with the other messages of this sender; an exception in the
        endpoint is printed by the worker (the actor survives). Actors on
        processes known to be dead are skipped: the message still reaches every
        other actor, then :class:`~mesharray.ActorDiedError` is raised.
        """
        self._caller.broadcast(self._mesh._shape, args, kwargs)

    def _call_some(self, reply: Sequence[int], *args: Any) -> dict[int, Future[Any]]:
        """One message to every actor, pickled once: a call to the ranks in ``reply`` and a
        broadcast to the others (:meth:`Caller.call_some <mesharray.runtime.caller.Caller.call_some>`:
        the distributed arrays' tiny reductions)."""
        return self._caller.call_some(self._mesh._shape, reply, *args)

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self._name}>"
