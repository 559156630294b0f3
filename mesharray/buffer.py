"""``Buffer``: an RDMA-style handle to a registered 1-D contiguous block of memory.

The process that makes ``Buffer(x)`` is the *owner*; the handle pickles small
(owner, address, size, a random token and a 128-bit secret) and any process
holding it can ``read_into(dst)`` / ``write_from(src)`` **without the owner's
code running**: cross-memory attach on the same host, the owner's UCX data
plane or a TCP stream served by a thread of the owner between hosts. The
paths, the capability check and the drop protocol are
:mod:`mesharray.transport.onesided`'s; this module is the API (argument
checks, pickling the handle, futures).

``TRANSFERS`` counts the transfers of this process by path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._core import buffer_address
from .errors import MeshArrayError
from .runtime.future import Future, completed_future
from .transport import onesided
from .transport.onesided import TRANSFERS

__all__ = ["Buffer", "TRANSFERS"]


# --- the handle ---------------------------------------------------------------------------


def _as_bytes_view(obj: Any, writable: bool) -> tuple[Any, memoryview]:
    """A flat byte memoryview of a contiguous block (NumPy array, torch CPU tensor, bytes-like)."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        if obj.device.type != "cpu":
            raise TypeError(
                f"Buffer needs host memory; got a tensor on {obj.device} (copy it to the CPU first)"
            )
        if not obj.is_contiguous():
            raise ValueError("Buffer needs a contiguous tensor; call .contiguous() first")
        arr = obj.detach().numpy()
    else:
        try:
            arr = np.asarray(memoryview(obj)) if not isinstance(obj, np.ndarray) else obj
        except TypeError:
            raise TypeError(f"Buffer needs a NumPy array, a CPU tensor or a bytes-like object, got {type(obj).__name__}") from None
    if not arr.flags.c_contiguous:
        raise ValueError(f"Buffer needs a contiguous block; got an array with strides {arr.strides}")
    if arr.ndim > 1:
        raise ValueError(f"Buffer registers a 1-D block; got shape {arr.shape} (reshape(-1) it first)")
    if writable and not arr.flags.writeable:
        raise ValueError("destination is read-only")
    return arr, memoryview(arr).cast("B") if arr.size else memoryview(b"")


def _local_view(obj: Any, writable: bool, what: str) -> tuple[Any, int, int]:
    mod = type(obj).__module__
    if mod.startswith("torch"):
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError(f"{what} must be a contiguous CPU tensor")
        obj = obj.detach().numpy()
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{what} must be contiguous; got strides {obj.strides}")
        if writable and not obj.flags.writeable:
            raise ValueError(f"{what} is read-only")
        if obj.size == 0:
            return obj, 0, 0
        addr, n = buffer_address(obj, writable)
        return obj, addr, n
    try:
        addr, n = buffer_address(obj, writable)
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(f"{what} must be a contiguous NumPy array, CPU tensor or bytes-like object, got {type(obj).__name__}") from exc
    return obj, addr, n


class Buffer:
    """A registered 1-D contiguous block that other processes read and write one-sidedly.

    Parameters
    ----------
    data : numpy.ndarray, torch.Tensor (CPU) or bytes-like
        A 1-D contiguous block. The buffer keeps it alive until :meth:`drop`.
        Read-only data makes a read-only buffer (``write_from`` raises).

    Examples
    --------
    >>> import numpy as np, pickle
    >>> src = np.arange(4, dtype="float32")
    >>> buf = Buffer(src)
    >>> handle = pickle.loads(pickle.dumps(buf))     # what another process receives
    >>> dst = np.zeros(4, dtype="float32")
    >>> handle.read_into(dst).get()
    16
    >>> dst.tolist()
    [0.0, 1.0, 2.0, 3.0]
    >>> buf.drop()
    """

    __slots__ = ("_state", "_owned", "_dropped", "__weakref__")
    _state: dict[str, Any]  # the handle: what travels when a Buffer is pickled
    # the runtime sends a Buffer by pickling its handle; see __reduce__

    def __init__(self, data: Any) -> None:
        arr, mem = _as_bytes_view(data, writable=False)
        addr = buffer_address(arr)[0] if mem.nbytes else 0
        self._state = onesided.register(data, mem, addr)
        self._owned = True
        self._dropped = False

    # --- pickling: only the handle travels -----------------------------------
    def __reduce__(self):
        if self._dropped:
            raise MeshArrayError("cannot send a dropped buffer")
        # the owner's servers start lazily, once a handle leaves this process
        st = onesided.export(self._state) if self._owned else dict(self._state)
        return (_rebuild, (st,))

    @property
    def nbytes(self) -> int:
        """Size of the registered block in bytes."""
        return self._state["nbytes"]

    @property
    def owner_pid(self) -> int:
        """Process id of the owner."""
        return self._state["pid"]

    @property
    def readonly(self) -> bool:
        """Whether the block was registered read-only."""
        return self._state["readonly"]

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = "dropped" if self._dropped else ("owner" if self._owned else "handle")
        return f"Buffer(nbytes={self.nbytes}, pid={self.owner_pid}, {state})"

    # --- transfers -----------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dropped:
            raise MeshArrayError("buffer was dropped; it can no longer be read or written")

    def read_into(self, dst: Any) -> Future[int]:
        """Copy the buffer's bytes into ``dst``; returns a future of the number of bytes copied.

        ``dst`` smaller than the buffer raises ``ValueError`` before anything
        moves; a larger one receives the leading ``nbytes`` bytes.

        Examples
        --------
        >>> import numpy as np
        >>> buf = Buffer(np.ones(2))
        >>> out = np.zeros(3)
        >>> buf.read_into(out).get(), out.tolist()
        (16, [1.0, 1.0, 0.0])
        >>> buf.drop()
        """
        self._check_alive()
        keep, addr, n = _local_view(dst, True, "destination")
        if n < self.nbytes:
            raise ValueError(f"destination has {n} bytes, fewer than the buffer's {self.nbytes}")
        try:
            onesided.transfer(self._state, False, addr, self.nbytes)
        except BaseException as exc:
            if isinstance(exc, (ValueError, TypeError)):
                raise
            return completed_future(exc=exc)
        finally:
            del keep
        return completed_future(self.nbytes)

    def write_from(self, src: Any) -> Future[int]:
        """Copy ``src`` into the buffer; returns a future of the number of bytes copied.

        ``src`` larger than the buffer raises ``ValueError`` before anything
        moves; a smaller one overwrites the buffer's leading bytes.

        Examples
        --------
        >>> import numpy as np
        >>> target = np.zeros(3)
        >>> buf = Buffer(target)
        >>> buf.write_from(np.array([7.0])).get(), target.tolist()
        (8, [7.0, 0.0, 0.0])
        >>> buf.drop()
        """
        self._check_alive()
        if self.readonly:
            raise ValueError("buffer was registered read-only; write_from is not allowed")
        keep, addr, n = _local_view(src, False, "source")
        if n > self.nbytes:
            raise ValueError(f"source has {n} bytes, more than the buffer's {self.nbytes}")
        try:
            onesided.transfer(self._state, True, addr, n)
        except BaseException as exc:
            return completed_future(exc=exc)
        finally:
            del keep
        return completed_future(n)

    def drop(self) -> None:
        """Release the block; later reads/writes through any handle raise a clear error.

        Any holder may drop (the owner or a process that received the handle);
        the owner lets go of the data. Dropping twice is harmless. The block
        stays registered until dropped: garbage-collecting the owner's
        ``Buffer`` object does not drop it, because handles elsewhere may still
        be in use.
        """
        if self._dropped:
            return
        self._dropped = True
        if self._owned:
            onesided.unregister(self._state)
        else:
            onesided.drop(self._state)


def _rebuild(state: dict) -> Buffer:
    b = Buffer.__new__(Buffer)
    b._state = state
    b._owned = False
    b._dropped = False
    onesided.prepare(state)  # (a UCX link to the owner starts opening now, not at the first read)
    return b
