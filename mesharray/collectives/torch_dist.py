"""The torch.distributed collective backend (gloo on CPU, NCCL/RCCL on GPUs).

The process group must already be initialised (``torch.distributed.init_process_group``)
or is initialised here from ``init_method``/``rank``/``size``. Accepts torch
tensors (any device the backend supports) or NumPy arrays (wrapped without a copy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import EngineUnavailableError
from ._args import scatter_part_shape

# (each optional backend guards its own import, so that its error names its own extra)
try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise EngineUnavailableError(
        "the torch collective backend needs torch; install it with: pip install mesharray[torch]"
    ) from exc

__all__ = ["TorchCollective"]


def _reduce_op(op: str):
    table = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
             "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.SUM}
    try:
        return table[op]
    except KeyError:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {tuple(table)}") from None


class TorchCollective:
    """Collectives over a torch.distributed process group.

    Parameters
    ----------
    group : ProcessGroup, optional
        Sub-group to use (default: the world group).
    backend : str, optional
        ``"gloo"``, ``"nccl"`` (also RCCL on ROCm); used only to initialise.
    init_method, rank, size : optional
        Initialise the default group when it is not yet initialised.

    Examples
    --------
    A group of one (a rendezvous file rather than a fixed TCP port, which
    another job may hold):

    >>> import os, tempfile
    >>> rdv = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
    >>> g = TorchCollective(backend="gloo", init_method=rdv, rank=0, size=1)  # doctest: +SKIP
    >>> g.allreduce(np.arange(3.0)).tolist()   # doctest: +SKIP
    [0.0, 1.0, 2.0]
    >>> g.close()   # doctest: +SKIP
    """

    def __init__(self, group: Any = None, backend: str | None = None, init_method: str | None = None,
                 rank: int | None = None, size: int | None = None) -> None:
        self._owns = False
        if not dist.is_initialized():
            if init_method is None or rank is None or size is None:
                raise ValueError("torch.distributed is not initialised: pass init_method, rank and size")
            dist.init_process_group(backend or "gloo", init_method=init_method, rank=rank, world_size=size)
            self._owns = True
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"TorchCollective(rank={self.rank}, size={self.size}, backend={dist.get_backend(self.group)!r})"

    @staticmethod
    def _tensor(x: Any) -> tuple[Any, bool]:
        if isinstance(x, torch.Tensor):
            return x, False
        arr = np.asarray(x, order="C")
        return torch.from_numpy(arr), True

    @staticmethod
    def _back(t: Any, was_numpy: bool) -> Any:
        return t.numpy() if was_numpy else t

    def _mean(self, t: Any, op: str) -> None:
        if op == "mean":
            if not t.dtype.is_floating_point:
                raise TypeError(f"op 'mean' needs a floating dtype, got {t.dtype}")
            t.div_(self.size)

    def allreduce(self, send: Any, out: Any = None, op: str = "sum") -> Any:
        t, was_np = self._tensor(send)
        rop = _reduce_op(op)
        o = self._tensor(out)[0] if out is not None else t.clone()
        if o.data_ptr() != t.data_ptr():
            o.copy_(t)
        dist.all_reduce(o, op=rop, group=self.group)
        self._mean(o, op)
        return self._back(o, was_np)

    def reduce(self, send: Any, out: Any = None, op: str = "sum", root: int = 0) -> Any:
        t, was_np = self._tensor(send)
        o = t.clone()
        dist.reduce(o, dst=dist.get_global_rank(self.group, root) if self.group is not None else root,
                    op=_reduce_op(op), group=self.group)
        if self.rank != root:
            return None
        self._mean(o, op)
        if out is not None:
            ot = self._tensor(out)[0]
            ot.copy_(o.reshape(ot.shape))
            return out
        return self._back(o, was_np)

    def broadcast(self, buf: Any, root: int = 0) -> Any:
        t, _ = self._tensor(buf)
        dist.broadcast(t, src=dist.get_global_rank(self.group, root) if self.group is not None else root,
                       group=self.group)
        return buf

    def allgather(self, send: Any, out: Any = None) -> Any:
        t, was_np = self._tensor(send)
        o = self._tensor(out)[0] if out is not None else t.new_empty((self.size,) + tuple(t.shape))
        dist.all_gather_into_tensor(o, t.contiguous(), group=self.group)
        return out if out is not None else self._back(o, was_np)

    def reduce_scatter(self, send: Any, out: Any = None, op: str = "sum") -> Any:
        t, was_np = self._tensor(send)
        part_shape = scatter_part_shape(tuple(t.shape), self.size)
        o = self._tensor(out)[0] if out is not None else t.new_empty(part_shape)
        if dist.get_backend(self.group) == "gloo":
            # gloo has no reduce_scatter: allreduce then keep this rank's part
            full = t.clone()
            dist.all_reduce(full, op=_reduce_op(op), group=self.group)
            o.copy_(full.reshape(self.size, -1)[self.rank].reshape(o.shape))
        else:
            dist.reduce_scatter_tensor(o, t.contiguous(), op=_reduce_op(op), group=self.group)
        self._mean(o, op)
        return out if out is not None else self._back(o, was_np)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Destroy the default process group if this object created it."""
        if self._owns and dist.is_initialized():
            dist.destroy_process_group()
            self._owns = False
