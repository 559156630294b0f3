"""Runtime counters of one process mesh, read with ``ProcMesh.stats()``.

The controller keeps one :class:`Counters` per process mesh: replies and
errors (counted by the connections' readers as the replies come, in a list the
reader increments in place), spawns, deaths, workers that went unresponsive and
forwarded log bytes. The process's router counts the calls and broadcasts it
sent; ``ProcMesh.stats()`` returns both as one dict.
"""

from __future__ import annotations

__all__ = ["Counters"]


class Counters:
    """Runtime counters of one process mesh (read with ``ProcMesh.stats()``)."""

    __slots__ = ("tally", "deaths", "log_bytes", "spawns", "unresponsive")
    _FIELDS = ("replies", "errors", "deaths", "log_bytes", "spawns", "unresponsive")

    def __init__(self) -> None:
        self.unresponsive = 0  # times a worker's heartbeats stopped for heartbeat_timeout
        #: [replies, of which errors]: counted by the connections' readers as the replies
        #: come (the channel hands this list to ``Connection.route``), hence a list
        self.tally = [0, 0]
        self.deaths = 0
        self.log_bytes = 0
        self.spawns = 0

    @property
    def replies(self) -> int:
        """Replies received."""
        return self.tally[0]

    @property
    def errors(self) -> int:
        """Replies received that were errors."""
        return self.tally[1]

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._FIELDS}
