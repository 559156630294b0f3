"""Tensor engines: what a rank's block *is* and where it lives.

Public: the names in ``__all__`` (``get_engine``, ``register_engine``, the
:class:`Engine` protocol, ...); the modules are internal:

- :mod:`._registry` — the :class:`Engine` protocol and the lazy registry of engines.
- :mod:`.numpy_engine` — blocks are ``numpy.ndarray`` in host memory (no torch needed).
- :mod:`.torch_engine` — blocks are ``torch.Tensor`` on one device (cpu, cuda,
  rocm, mps, xla).
- :mod:`.probe` — what each engine can do here: device, collective backend, dtypes.

An :class:`Engine` allocates blocks, moves them to and from host memory, runs
elementwise operations and reductions on them, exports them (DLPack / buffer
protocol) and names the collective backend it prefers. Engines load lazily:
``import mesharray`` never imports torch, and asking for an engine whose package
or device is missing raises :class:`~mesharray.errors.EngineUnavailableError`
naming what to install.

>>> from mesharray.engines import get_engine
>>> eng = get_engine("numpy")
>>> eng.to_numpy(eng.full((2,), 3.0, "float32")).tolist()
[3.0, 3.0]
"""

from __future__ import annotations

from ._registry import (
    ENGINE_NAMES,
    Engine,
    available_engines,
    get_engine,
    register_engine,
    resolve_engine_name,
)
from .probe import probe_engine, probe_engines

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "available_engines",
    "get_engine",
    "probe_engine",
    "probe_engines",
    "register_engine",
    "resolve_engine_name",
]
