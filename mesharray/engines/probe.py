"""What each tensor engine can do here: device, collective backend, dtypes.

:func:`probe_engine` *uses* the engine (it loads it, allocates a small block
of every candidate dtype on its device, adds and sums it, and brings it back
to host memory), so its answers are what this machine actually did, not what
a package claims. It imports torch for the torch engines (seconds): ``python
-m mesharray info`` runs it only with ``--probe``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from ..errors import EngineUnavailableError
from ._registry import ENGINE_NAMES, get_engine

__all__ = ["probe_engine", "probe_engines", "DTYPES"]

#: the dtypes a probe tries, in this order
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64")


def _collective(backend: str) -> tuple[bool, str]:
    """Whether the collective ``backend`` can run here, and what it is."""
    if backend == "shm":
        ok = os.name == "posix"
        return ok, "host shared memory (built in)" if ok else "host shared memory: needs a POSIX system"
    if importlib.util.find_spec("torch") is None:
        return False, f"{backend}: needs torch.distributed (pip install 'mesharray[torch]')"
    import torch.distributed as dist

    if backend == "nccl":
        ok = dist.is_available() and dist.is_nccl_available()
        return ok, "torch.distributed NCCL (RCCL on ROCm)" if ok else "nccl: this torch has no NCCL"
    if backend == "gloo":
        ok = dist.is_available() and dist.is_gloo_available()
        return ok, "torch.distributed gloo" if ok else "gloo: this torch has no gloo"
    if backend == "xla":
        ok = importlib.util.find_spec("torch_xla") is not None
        return ok, "torch_xla collectives" if ok else "xla: needs torch_xla"
    return False, f"unknown collective backend {backend!r}"


def _dtype_works(eng: Any, dtype: str) -> bool:
    try:
        a = eng.ones((4,), dtype)
        b = eng.elementwise("add", a, a) if dtype != "bool" else eng.elementwise("logical_or", a, a)
        eng.reduce("sum", b)
        if dtype != "bfloat16":  # no NumPy dtype: host_view would have to convert
            eng.to_numpy(b)
        eng.synchronize()
    except Exception:  # any failure (TypeError, RuntimeError from a device) means: not supported here
        return False
    return True


def probe_engine(name: str) -> dict[str, Any]:
    """Load engine ``name`` and report what it can do on this machine.

    Returns
    -------
    dict
        ``available`` (bool); ``reason`` (why not, naming what to install or
        the missing device; None if available); ``device`` (where blocks
        live); ``collective_backend`` and ``collective_available`` /
        ``collective`` (whether that backend runs here, and what it is);
        ``dtypes`` (those an allocation, an add, a sum and a copy to host
        memory worked for).

    Examples
    --------
    >>> from mesharray.engines import probe_engine
    >>> p = probe_engine("numpy")
    >>> p["available"], p["device"], p["collective_backend"]
    (True, 'cpu', 'shm')
    >>> "float32" in p["dtypes"], "bfloat16" in p["dtypes"]
    (True, False)
    """
    out: dict[str, Any] = {"name": name, "available": False, "reason": None, "device": None,
                           "collective_backend": None, "collective_available": False, "collective": None,
                           "dtypes": []}
    try:
        eng = get_engine(name)
    except EngineUnavailableError as exc:
        out["reason"] = str(exc)
        return out
    except Exception as exc:  # a broken install (e.g. a torch_xla for another torch): say what happened
        out["reason"] = f"{type(exc).__name__}: {exc}"
        return out
    out["available"] = True
    out["device"] = eng.device
    out["collective_backend"] = eng.collective_backend
    out["collective_available"], out["collective"] = _collective(eng.collective_backend)
    out["dtypes"] = [d for d in DTYPES if _dtype_works(eng, d)]
    return out


def probe_engines(names: tuple[str, ...] = ENGINE_NAMES) -> dict[str, dict[str, Any]]:
    """:func:`probe_engine` for every built-in engine (imports torch when installed)."""
    return {n: probe_engine(n) for n in names}
