"""The Engine protocol and the lazy registry of engines."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ..errors import EngineUnavailableError

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "available_engines",
    "get_engine",
    "register_engine",
    "resolve_engine_name",
]


@runtime_checkable
class Engine(Protocol):
    """What every tensor engine provides (blocks are the engine's native arrays).

    Attributes
    ----------
    name : str
        Registry name, e.g. ``"numpy"``, ``"torch"`` (CPU), ``"cuda"``.
    device : str
        Where blocks live: ``"cpu"``, ``"cuda:0"``, ``"mps"``, ``"xla:0"`` ...
    collective_backend : str
        The collective backend this engine prefers: ``"shm"`` for host memory,
        ``"nccl"`` (CUDA and ROCm's RCCL, which torch calls nccl), ``"gloo"``.
    """

    name: str
    device: str
    collective_backend: str

    def empty(self, shape: Sequence[int], dtype: Any) -> Any: ...
    def zeros(self, shape: Sequence[int], dtype: Any) -> Any: ...
    def ones(self, shape: Sequence[int], dtype: Any) -> Any: ...
    def full(self, shape: Sequence[int], value: Any, dtype: Any) -> Any: ...
    def arange(self, n: int, dtype: Any) -> Any: ...
    def rand(self, shape: Sequence[int], dtype: Any, seed: int | None = None) -> Any: ...
    def from_numpy(self, array: Any) -> Any: ...
    def to_numpy(self, block: Any) -> Any: ...
    def is_block(self, obj: Any) -> bool: ...
    def dtype_of(self, block: Any) -> Any: ...
    def shape_of(self, block: Any) -> tuple: ...
    def elementwise(self, op: str, *args: Any) -> Any: ...
    def reduce(self, op: str, block: Any, axis: Any = None, keepdims: bool = False) -> Any: ...
    def matmul(self, a: Any, b: Any) -> Any: ...
    def astype(self, block: Any, dtype: Any) -> Any: ...
    def reshape(self, block: Any, shape: Sequence[int]) -> Any: ...
    def getitem(self, block: Any, index: Any) -> Any: ...
    def host_view(self, block: Any) -> Any: ...
    def to_dlpack(self, block: Any) -> Any: ...
    def synchronize(self) -> None: ...


# name -> (module, factory attribute, keyword arguments)
_FACTORIES: dict[str, tuple[str, str, dict]] = {
    "numpy": ("mesharray.engines.numpy_engine", "NumpyEngine", {}),
    "torch": ("mesharray.engines.torch_engine", "TorchEngine", {"kind": "cpu"}),
    "cuda": ("mesharray.engines.torch_engine", "TorchEngine", {"kind": "cuda"}),
    "rocm": ("mesharray.engines.torch_engine", "TorchEngine", {"kind": "rocm"}),
    "mps": ("mesharray.engines.torch_engine", "TorchEngine", {"kind": "mps"}),
    "xla": ("mesharray.engines.torch_engine", "TorchEngine", {"kind": "xla"}),
}
_ALIASES = {"torch:cpu": "torch", "cpu": "numpy", "torch:cuda": "cuda", "torch:rocm": "rocm",
            "torch:mps": "mps", "torch:xla": "xla", "hip": "rocm", "tpu": "xla"}
_CUSTOM: dict[str, Callable[[], Engine]] = {}
_CACHE: dict[str, Engine] = {}
_LOCK = threading.Lock()

ENGINE_NAMES = tuple(_FACTORIES)
"""The built-in engine names (``"auto"`` picks among them)."""


def register_engine(name: str, factory: Callable[[], Engine]) -> None:
    """Register a custom engine under ``name`` (``factory()`` is called on first use).

    Examples
    --------
    >>> from mesharray.engines import register_engine, get_engine
    >>> from mesharray.engines.numpy_engine import NumpyEngine
    >>> register_engine("mynumpy", NumpyEngine)
    >>> get_engine("mynumpy").name
    'numpy'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"engine name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"engine factory must be callable, got {type(factory).__name__}")
    with _LOCK:
        _CUSTOM[name] = factory
        _CACHE.pop(name, None)


def _maybe_gpu() -> bool:
    # Cheap hints before paying torch's import time (seconds) in every worker.
    if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"):
        return True
    return any(os.path.exists(f"/dev/nvidia{i}") for i in range(2))


def resolve_engine_name(name: str = "auto") -> str:
    """Turn ``"auto"`` (or an alias) into the name of a concrete, available engine.

    ``"auto"`` picks the best device this process has: a CUDA or ROCm GPU, then
    an XLA device (torch_xla installed), then Apple MPS, else the ``numpy``
    engine on the CPU. torch is imported only when a GPU (or torch_xla, or an
    Apple-silicon Mac) is plausible.

    Examples
    --------
    >>> resolve_engine_name("cpu")
    'numpy'
    """
    if not isinstance(name, str):
        raise TypeError(f"engine must be a str such as 'numpy', 'torch' or 'auto', got {type(name).__name__}")
    name = _ALIASES.get(name, name)
    if name != "auto":
        if name not in _FACTORIES and name not in _CUSTOM:
            known = sorted({*_FACTORIES, *_CUSTOM, "auto"})
            raise ValueError(f"unknown engine {name!r}; known engines are {known}")
        return name
    env = os.environ.get("MESHARRAY_ENGINE")
    if env and env != "auto":
        return resolve_engine_name(env)
    if importlib.util.find_spec("torch") is None:
        return "numpy"
    candidates = []
    if _maybe_gpu():
        candidates += ["cuda", "rocm"]
    if importlib.util.find_spec("torch_xla") is not None:
        candidates.append("xla")
    if sys.platform == "darwin":
        candidates.append("mps")
    for cand in candidates:
        try:
            get_engine(cand)
        except EngineUnavailableError:
            continue
        return cand
    return "numpy"


def get_engine(name: str = "auto") -> Engine:
    """Return the (process-wide, cached) engine called ``name``.

    Raises
    ------
    EngineUnavailableError
        The engine's package or device is missing; the message names the extra
        to install (e.g. ``pip install mesharray[torch]``) or the missing device.

    Examples
    --------
    >>> get_engine("numpy").device
    'cpu'
    """
    name = resolve_engine_name(name)
    eng = _CACHE.get(name)
    if eng is not None:
        return eng
    with _LOCK:
        eng = _CACHE.get(name)
        if eng is not None:
            return eng
        if name in _CUSTOM:
            eng = _CUSTOM[name]()
        else:
            module, attr, kwargs = _FACTORIES[name]
            eng = getattr(importlib.import_module(module), attr)(**kwargs)
        _CACHE[name] = eng
        return eng


def available_engines() -> list[str]:
    """Names of the built-in engines usable in this process (imports torch if installed).

    Examples
    --------
    >>> "numpy" in available_engines()
    True
    """
    out = []
    for name in _FACTORIES:
        try:
            get_engine(name)
        except EngineUnavailableError:
            continue
        out.append(name)
    return out
