"""``ma.spmd``: run existing SPMD scripts — written for ``torchrun`` — on a mesh, unmodified.

>>> import mesharray as ma
>>> procs = ma.proc_mesh(procs=2)                                    # doctest: +SKIP
>>> ma.spmd.run(procs, "train.py", args=["--epochs", "1"])           # doctest: +SKIP
MeshArray(hosts=1, procs=2, dtype=int64)
[[0 0]]

From a shell, with torchrun's own flags (``--job``/``--hosts`` to run across
hosts)::

    python -m mesharray torchrun --standalone --nproc-per-node 2 train.py --epochs 1

Every process of the mesh runs the script as ``__main__`` on its main
thread, with torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...), so ``init_process_group`` works as
under torchrun; afterwards the processes are as they were and the mesh
serves actors and arrays again. ``docs/spmd.rst`` says what differs from
torchrun.

Modules:

- :mod:`.launch` — :func:`run` (controller side): the layout of ranks over
  hosts, torchrun's variables, the run and how it ends (:class:`Outcome`).
- :mod:`.rank` — :class:`~.rank.ScriptRank` (worker side): the script on the
  main thread, the process's state set aside and restored, where the script
  is on each host.
- :mod:`.cli` — ``python -m mesharray torchrun [torchrun's flags] script.py [args]``.
"""

from __future__ import annotations

from .launch import ENDED, GRACE, Outcome, layout, run, run_outcome, torchrun_env

__all__ = ["run", "run_outcome", "Outcome", "layout", "torchrun_env", "ENDED", "GRACE"]
