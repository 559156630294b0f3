"""The torch engine: blocks are ``torch.Tensor`` on one device (cpu, cuda, rocm, mps, xla).

torch is imported when this module is, never by ``import mesharray``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import EngineUnavailableError
from .numpy_engine import ELEMENTWISE_OPS, REDUCTIONS

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise EngineUnavailableError(
        "the torch engine needs torch; install it with: pip install mesharray[torch]"
    ) from exc

__all__ = ["TorchEngine", "numpy_dtype", "torch_dtype"]

_NUMBERS = (int, float)
#: binary ops as torch computes them with a tensor first (the same results as NumPy's ufuncs on blocks)
_BINARY: dict[str, Any] = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "true_divide": torch.true_divide,
           "divide": torch.true_divide, "power": torch.pow, "maximum": torch.maximum, "minimum": torch.minimum}
#: ``number op tensor`` as ``fn(tensor, number)``
_REFLECTED: dict[str, Any] = {"add": torch.add, "multiply": torch.mul, "subtract": torch.rsub}

# NumPy ufunc name -> torch function name where they differ
_TORCH_NAMES = {
    "true_divide": "true_divide", "divide": "true_divide", "floor_divide": "floor_divide",
    "remainder": "remainder", "mod": "remainder", "power": "pow", "negative": "neg",
    "positive": "positive", "absolute": "abs", "abs": "abs", "invert": "bitwise_not",
    "left_shift": "bitwise_left_shift", "right_shift": "bitwise_right_shift",
    "rint": "round", "arctan2": "atan2", "equal": "eq", "not_equal": "ne", "less": "lt",
    "less_equal": "le", "greater": "gt", "greater_equal": "ge",
}
_TORCH_REDUCE = {"sum": "sum", "prod": "prod", "min": "amin", "max": "amax", "mean": "mean",
                 "any": "any", "all": "all", "argmin": "argmin", "argmax": "argmax",
                 "std": "std", "var": "var"}


def torch_dtype(dtype: Any) -> "torch.dtype":
    """Map a NumPy dtype (or name, or torch dtype) to the torch dtype.

    Examples
    --------
    >>> torch_dtype("float32")
    torch.float32
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return torch.bool
    return torch.from_numpy(np.empty(0, dtype=dt)).dtype


def numpy_dtype(tdtype: "torch.dtype") -> np.dtype:
    """The NumPy dtype of a torch dtype (``TypeError`` for bfloat16, which has none)."""
    if tdtype == torch.bfloat16:
        raise TypeError("bfloat16 has no NumPy dtype; astype('float32') first")
    return torch.empty(0, dtype=tdtype).numpy().dtype


class TorchEngine:
    """Blocks are torch tensors on the device of ``kind``.

    Parameters
    ----------
    kind : {"cpu", "cuda", "rocm", "mps", "xla"}
        ``rocm`` is torch's HIP build (its tensors also use the ``cuda`` device
        type); ``xla`` needs ``torch_xla``.

    Examples
    --------
    >>> eng = TorchEngine("cpu")
    >>> eng.to_numpy(eng.elementwise("multiply", eng.ones((2,), "float32"), 3)).tolist()
    [3.0, 3.0]
    """

    def __init__(self, kind: str = "cpu") -> None:
        self.kind = kind
        if kind == "cpu":
            self.name, self.device, self.collective_backend = "torch", "cpu", "shm"
        elif kind in ("cuda", "rocm"):
            is_hip = getattr(torch.version, "hip", None) is not None
            if kind == "cuda" and is_hip:
                raise EngineUnavailableError("engine 'cuda' needs a CUDA build of torch; this is a ROCm (HIP) build: use engine='rocm'")
            if kind == "rocm" and not is_hip:
                raise EngineUnavailableError("engine 'rocm' needs torch's ROCm (HIP) build and an AMD GPU; this torch has no HIP support")
            if not torch.cuda.is_available():
                what = "an AMD GPU (ROCm)" if kind == "rocm" else "a CUDA GPU"
                raise EngineUnavailableError(f"engine {kind!r} needs {what}; torch.cuda.is_available() is False")
            index = torch.cuda.current_device()
            self.name, self.device = kind, f"cuda:{index}"
            # RCCL is exposed by torch under the name "nccl"
            self.collective_backend = "nccl"
        elif kind == "mps":
            mps = getattr(torch.backends, "mps", None)
            if mps is None or not mps.is_available():
                raise EngineUnavailableError("engine 'mps' needs an Apple-silicon GPU (Metal); torch.backends.mps.is_available() is False")
            self.name, self.device = "mps", "mps"
            # no collective library runs on MPS: reduce through host shared memory
            self.collective_backend = "shm"
        elif kind == "xla":
            try:
                import torch_xla  # noqa: F401
                import torch_xla.core.xla_model as xm
            except ImportError as exc:
                raise EngineUnavailableError(
                    "engine 'xla' needs torch_xla and an XLA device (TPU); install it with: pip install torch_xla"
                ) from exc
            self.name, self.device = "xla", str(xm.xla_device())
            self.collective_backend = "xla"
        else:
            raise ValueError(f"unknown torch engine kind {kind!r}; expected 'cpu', 'cuda', 'rocm', 'mps' or 'xla'")
        self._device = torch.device(self.device)

    def __repr__(self) -> str:
        return f"TorchEngine(kind={self.kind!r}, device={self.device!r})"

    def __reduce__(self):
        return (TorchEngine, (self.kind,))

    # allocation
    def empty(self, shape: Sequence[int], dtype: Any):
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self._device)

    def zeros(self, shape: Sequence[int], dtype: Any):
        return torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=self._device)

    def ones(self, shape: Sequence[int], dtype: Any):
        return torch.ones(tuple(shape), dtype=torch_dtype(dtype), device=self._device)

    def full(self, shape: Sequence[int], value: Any, dtype: Any):
        return torch.full(tuple(shape), value, dtype=torch_dtype(dtype), device=self._device)

    def arange(self, n: int, dtype: Any):
        return torch.arange(n, dtype=torch_dtype(dtype), device=self._device)

    def rand(self, shape: Sequence[int], dtype: Any, seed: int | None = None):
        td = torch_dtype(dtype)
        if not td.is_floating_point:
            raise TypeError(f"rand needs a floating dtype, got {np.dtype(dtype)}")
        gen = None
        if seed is not None:
            # generators on the device where they exist; xla/mps draw on the CPU then move
            gen = torch.Generator(device="cpu").manual_seed(int(seed))
        return torch.rand(tuple(shape), dtype=td, generator=gen).to(self._device)

    # host transfer
    def from_numpy(self, array: Any):
        arr = np.asarray(array, order="C")
        if not arr.flags.writeable:
            # torch warns on (and may write through) read-only memory: own a copy
            arr = arr.copy()
        t = torch.from_numpy(arr)
        return t.to(self._device) if self.device != "cpu" else t

    def to_numpy(self, block: Any) -> np.ndarray:
        if isinstance(block, torch.Tensor):
            t = block.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            return t.numpy()
        return np.asarray(block)

    def is_block(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def dtype_of(self, block: Any) -> np.dtype:
        if isinstance(block, torch.Tensor):
            return numpy_dtype(block.dtype)
        return np.asarray(block).dtype

    def shape_of(self, block: Any) -> tuple:
        return tuple(block.shape)

    def _arg(self, x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return self.from_numpy(x)
        if isinstance(x, np.generic):
            return x.item()
        return x

    # compute
    def elementwise(self, op: str, *args: Any):
        if len(args) == 2:  # the common case: tensor op tensor, or with a Python number on either side
            a, b = args
            ta, tb = type(a) is torch.Tensor, type(b) is torch.Tensor
            # (a number only with floating blocks: it cannot change their dtype there)
            if ta and (tb or (type(b) in _NUMBERS and a.is_floating_point())):
                fn = _BINARY.get(op)
                if fn is not None:
                    return fn(a, b)
            elif tb and type(a) in _NUMBERS and b.is_floating_point():
                fn = _REFLECTED.get(op)
                if fn is not None:
                    return fn(b, a)
        if op not in ELEMENTWISE_OPS:
            raise ValueError(f"unknown elementwise op {op!r}; expected a NumPy ufunc name such as 'add'")
        args = tuple(self._arg(a) for a in args)
        if not any(isinstance(a, torch.Tensor) for a in args):
            args = (torch.as_tensor(args[0], device=self._device),) + args[1:]
        if op == "square":
            return torch.square(args[0])
        if op == "where":
            return torch.where(*args)
        if op == "clip":
            return torch.clamp(*args)
        fn = getattr(torch, _TORCH_NAMES.get(op, op))
        if not isinstance(args[0], torch.Tensor) and len(args) == 2:
            # torch functions want a tensor first; scalar op tensor
            args = (torch.as_tensor(args[0], device=args[1].device, dtype=args[1].dtype if op in ("add", "multiply", "subtract") else None), args[1])
        return fn(*args)

    def reduce(self, op: str, block: Any, axis: Any = None, keepdims: bool = False):
        if op not in REDUCTIONS:
            raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(REDUCTIONS)}")
        fn = getattr(torch, _TORCH_REDUCE[op])
        t = block
        if op in ("argmin", "argmax"):
            if isinstance(axis, tuple):
                raise TypeError(f"{op} takes one axis, got {axis}")
            return fn(t, dim=axis, keepdim=keepdims)
        if op in ("std", "var"):
            # NumPy's default is the population variance (ddof=0)
            dims = axis if axis is not None else tuple(range(t.ndim))
            return fn(t, dim=dims, keepdim=keepdims, correction=0)
        if axis is None:
            if op in ("any", "all"):
                r = fn(t)
            elif op in ("min", "max"):
                r = fn(t, dim=tuple(range(t.ndim)), keepdim=keepdims) if t.ndim else t.clone()
                return r
            else:
                r = fn(t)
            if keepdims:
                r = r.reshape((1,) * t.ndim)
            return r
        if op in ("prod", "any", "all") and isinstance(axis, tuple):
            r = t
            for ax in sorted((a % t.ndim for a in axis), reverse=True):
                r = fn(r, dim=ax, keepdim=keepdims)
            return r
        return fn(t, dim=axis, keepdim=keepdims)

    def matmul(self, a: Any, b: Any):
        return torch.matmul(self._arg(a), self._arg(b))

    def astype(self, block: Any, dtype: Any):
        return block.to(torch_dtype(dtype))

    def reshape(self, block: Any, shape: Sequence[int]):
        return block.reshape(tuple(shape))

    def getitem(self, block: Any, index: Any):
        return block[index]

    # export
    def host_view(self, block: Any) -> np.ndarray:
        """A contiguous host NumPy array: shares memory on the CPU, a copy from a device."""
        t = block.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous().numpy()

    def to_dlpack(self, block: Any) -> Any:
        return block.contiguous()

    def from_dlpack(self, obj: Any):
        return torch.from_dlpack(obj).to(self._device)

    def synchronize(self) -> None:
        if self.kind in ("cuda", "rocm"):
            torch.cuda.synchronize()
        elif self.kind == "mps":
            torch.mps.synchronize()
        elif self.kind == "xla":
            import torch_xla.core.xla_model as xm

            xm.mark_step()
            xm.wait_device_ops()
