"""``import mesharray`` stays light, and its public names are sound."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mesharray

HEAVY = ("torch", "mpi4py", "ucxx", "libucx")


def test_import_does_not_import_heavy_packages():
    # A fresh interpreter: this test process may already have imported them.
    code = (
        "import json, sys; import mesharray; from mesharray import Shape; Shape(a=2)[0]; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True, cwd=root, env=env)
    assert json.loads(out.stdout) == []


def test_every_public_name_resolves():
    for name in mesharray.__all__:
        assert getattr(mesharray, name) is not None, name


def test_every_public_name_is_exported_once():
    assert len(mesharray.__all__) == len(set(mesharray.__all__))
    assert set(mesharray.__all__) <= set(dir(mesharray))
    seen = {}
    for name in mesharray.__all__:
        obj = getattr(mesharray, name)
        if isinstance(obj, (str, int, float)):
            continue
        assert id(obj) not in seen, f"{name} and {seen.get(id(obj))} are the same object"
        seen[id(obj)] = name


def test_core_names_are_the_compiled_ones():
    from mesharray import _core

    assert mesharray.Shape is _core.Shape
    assert mesharray.broadcast_shapes is _core.broadcast_shapes
    assert mesharray.reduction_plan is _core.reduction_plan


# packages that are internal (documented so in their __init__): nothing public may live there
INTERNAL_PACKAGES = ("mesharray.runtime", "mesharray.transport", "mesharray.bootstrap")


def test_public_names_report_public_modules():
    """Classes and functions of ``mesharray.__all__`` name a public module, where they resolve."""
    for name in mesharray.__all__:
        obj = getattr(mesharray, name)
        if not (isinstance(obj, type) or callable(obj)):
            continue
        module = obj.__module__
        assert not any(part.startswith("_") for part in module.split(".")), (name, module)
        assert not module.startswith(INTERNAL_PACKAGES), (name, module)
        assert getattr(importlib.import_module(module), obj.__qualname__) is obj, (name, module)


def test_public_names_pickle_by_reference():
    import pickle

    for name in mesharray.__all__:
        obj = getattr(mesharray, name)
        if isinstance(obj, type) or callable(obj):
            for proto in (2, pickle.HIGHEST_PROTOCOL):
                assert pickle.loads(pickle.dumps(obj, proto)) is obj, name


def test_instances_still_pickle():
    import pickle

    s = mesharray.Shape({"hosts": 2, "procs": 4})
    for shape in (s, s[1, ::2], s[:, [3, 0]]):
        for proto in (2, pickle.HIGHEST_PROTOCOL):
            back = pickle.loads(pickle.dumps(shape, proto))
            assert type(back) is mesharray.Shape and back == shape
            assert back.ranks().tolist() == shape.ranks().tolist()
    err = mesharray.ActorDiedError(ranks=[1], pid=42, reason="gone")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is mesharray.ActorDiedError and str(back) == str(err)
    dim = mesharray.DimensionError("gpu", ("hosts", "procs"))
    assert str(pickle.loads(pickle.dumps(dim))) == str(dim)
