"""Type stub of the transport's compiled per-message steps, ``mesharray.transport._wire`` (``_wire.pyx``)."""

from typing import Any, Callable

class Wire:
    sock: Any
    name: Any
    handler: Any
    limit: int
    more: bool
    bytes_in: int
    bytes_out: int
    frames_out: int
    _out: list[Any]
    _out_t0: float
    _backlog: Any
    _closed: bool
    _faulty: bool
    _write_error: BaseException | None
    @property
    def _send_lock(self) -> Any: ...
    @_send_lock.setter
    def _send_lock(self, value: Any) -> None: ...
    _route_kind: int
    _route: dict[int, Callable[[int, Any], Any]] | None
    _route_counts: list[int] | None
    _big: Any
    _view: Any
    _start: int
    _end: int
    _read_exc: BaseException | None
    _fd: int
    @property
    def _rlock(self) -> Any: ...
    @_rlock.setter
    def _rlock(self, value: Any) -> None: ...

def setup(clock: Callable[[], float], cork_age: float, frame_error: type[BaseException],
          broken_transport_error: type[BaseException], settings: dict[str, Any]) -> None: ...
def read_polled(conn: Any) -> bool: ...
def poll_events(poller: Any, events: Any) -> None: ...
def write_frame(conn: Any, frame: bytes) -> bool: ...
def read_loop(conn: Any) -> None: ...
def spin_recv(sock: Any, buf: Any, spin: float, state: list[int], poll_first: bool = True) -> int: ...

class Beats:
    interval: float
    sample_every: int
    def __init__(self, clock: Callable[[], float], interval: float, sample: Callable[[], Any] | None = None,
                 sample_every: int = 4) -> None: ...
    def to(self, conn: Wire, frame: bytes, fallback: Callable[[], Any]) -> None: ...
    def slot(self, mm: Any, offset: int) -> None: ...
    def stop(self) -> None: ...
    def run(self) -> None: ...
