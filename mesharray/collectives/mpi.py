"""The MPI collective backend: mpi4py's buffer (upper-case) API on a communicator.

Used when the job was launched under mpirun; the communicator comes from
``mesharray.bootstrap.mpi`` (the world) or from ``Split`` for a sub-group.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import EngineUnavailableError
from ._args import as_contiguous, check_out, scatter_part_shape

# (each optional backend guards its own import, so that its error names its own extra)
try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise EngineUnavailableError(
        "the mpi collective backend needs mpi4py; install it with: pip install mesharray[mpi]"
    ) from exc

__all__ = ["MpiCollective"]

_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX, "mean": MPI.SUM}


class MpiCollective:
    """Collectives over an mpi4py communicator (default: ``MPI.COMM_WORLD``).

    Examples
    --------
    >>> import numpy as np
    >>> g = MpiCollective()            # doctest: +SKIP
    >>> g.allreduce(np.ones(2))        # doctest: +SKIP
    array([1., 1.])
    """

    def __init__(self, comm: Any = None) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def __repr__(self) -> str:
        return f"MpiCollective(rank={self.rank}, size={self.size})"

    @staticmethod
    def _op(op: str):
        try:
            return _OPS[op]
        except KeyError:
            raise ValueError(f"unknown reduction op {op!r}; expected one of {tuple(_OPS)}") from None

    _arr = staticmethod(as_contiguous)

    @staticmethod
    def _out(out: Any, shape: tuple, dtype: np.dtype) -> np.ndarray:
        return check_out(out, shape, dtype)

    def _mean(self, out: np.ndarray | None, op: str) -> None:
        if op == "mean" and out is not None:
            if out.dtype.kind != "f":
                raise TypeError(f"op 'mean' needs a floating dtype, got {out.dtype}")
            np.divide(out, self.size, out=out)

    def allreduce(self, send: Any, out: Any = None, op: str = "sum") -> np.ndarray:
        send = self._arr(send, "send")
        mop = self._op(op)
        out = self._out(out, send.shape, send.dtype)
        if out is send or np.shares_memory(out, send):
            self.comm.Allreduce(MPI.IN_PLACE, out, op=mop)
        else:
            self.comm.Allreduce(send, out, op=mop)
        self._mean(out, op)
        return out

    def reduce(self, send: Any, out: Any = None, op: str = "sum", root: int = 0) -> np.ndarray | None:
        send = self._arr(send, "send")
        mop = self._op(op)
        if self.rank == root:
            out = self._out(out, send.shape, send.dtype)
            if np.shares_memory(out, send):
                self.comm.Reduce(MPI.IN_PLACE, out, op=mop, root=root)
            else:
                self.comm.Reduce(send, out, op=mop, root=root)
            self._mean(out, op)
            return out
        self.comm.Reduce(send, None, op=mop, root=root)
        return None

    def broadcast(self, buf: Any, root: int = 0) -> np.ndarray:
        buf = self._arr(buf, "buf")
        self.comm.Bcast(buf, root=root)
        return buf

    def allgather(self, send: Any, out: Any = None) -> np.ndarray:
        send = self._arr(send, "send")
        out = self._out(out, (self.size,) + send.shape, send.dtype)
        self.comm.Allgather(send, out)
        return out

    def reduce_scatter(self, send: Any, out: Any = None, op: str = "sum") -> np.ndarray:
        send = self._arr(send, "send")
        mop = self._op(op)
        part_shape = scatter_part_shape(send.shape, self.size)
        out = self._out(out, part_shape, send.dtype)
        self.comm.Reduce_scatter_block(send, out, op=mop)
        self._mean(out, op)
        return out

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        """Nothing to release: the communicator belongs to the caller."""
