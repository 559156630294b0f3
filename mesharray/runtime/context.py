"""Where the current code runs: the actor and the message being handled."""

from __future__ import annotations

import contextvars

__all__ = ["Context", "current"]


class Context:
    """What an actor sees about itself and the message it is handling.

    Attributes
    ----------
    actor_name : str
        Name given at spawn.
    rank : dict
        The actor's coordinates on the mesh it was spawned on.
    size : dict
        Sizes of the mesh it was spawned on.
    global_rank : int
        Rank of its process in the root process mesh.
    message_rank : dict
        Coordinates relative to the slice the current message was sent to.
    message_size : dict
        Sizes of that slice.
    """

    __slots__ = ("actor_name", "actor", "_spawn_shape", "_view", "global_rank", "host", "pid")

    def __init__(self, actor_name, actor, spawn_shape, view, global_rank, host, pid) -> None:
        self.actor_name, self.actor, self.global_rank, self.host, self.pid = actor_name, actor, global_rank, host, pid
        self._spawn_shape = spawn_shape
        self._view = view  # (the current message's: the worker sets it before each call)

    @property
    def rank(self) -> dict:
        return self._spawn_shape.coordinates(self.global_rank)

    @property
    def size(self) -> dict:
        return dict(self._spawn_shape.extent)

    @property
    def message_rank(self) -> dict:
        v = self._view if self._view is not None else self._spawn_shape
        return v.coordinates(self.global_rank)

    @property
    def message_size(self) -> dict:
        v = self._view if self._view is not None else self._spawn_shape
        return dict(v.extent)

    def __repr__(self) -> str:
        return f"Context(actor={self.actor_name!r}, rank={self.rank}, message_rank={self.message_rank})"


current: contextvars.ContextVar[Context | None] = contextvars.ContextVar("mesharray_context", default=None)
