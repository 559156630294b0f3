"""Dependencies point one way: no module imports from a layer above its own.

The layers, bottom to top, are those of ``docs/internals.md`` ("Layers"). Every
import counts, those inside functions too; names imported from another part
of the package may not be ``_private`` ones.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "mesharray"

LAYERS = [
    ("mesharray._core", "mesharray.errors", "mesharray._proc_stat", "mesharray._platform", "mesharray.calls"),
    ("mesharray.mesh", "mesharray.array", "mesharray.reductions", "mesharray.storage", "mesharray.elementwise", "mesharray.indexing",
     "mesharray.transport",
     "mesharray.engines", "mesharray.collectives"),
    ("mesharray.runtime",),
    ("mesharray.actor", "mesharray.buffer"),
    ("mesharray.bootstrap", "mesharray.observe"),
    ("mesharray.proc", "mesharray.k8s", "mesharray.job", "mesharray.spmd"),
    ("mesharray.darray",),
    ("mesharray", "mesharray.__main__"),
]


def _layer(mod: str) -> int:
    best = (-1, -1)
    for i, names in enumerate(LAYERS):
        for n in names:
            if (mod == n or mod.startswith(n + ".")) and len(n) > best[1]:
                best = (i, len(n))
    assert best[0] >= 0, f"{mod} is in no layer: add it to LAYERS and to docs/internals.md"
    return best[0]


def _part(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


@functools.lru_cache(maxsize=None)
def _imports() -> tuple:
    """(importer, imported module, imported name or None, line) for every import in the package."""
    return tuple(_scan())


def _scan():
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mod = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield mod, a.name, None, node.lineno
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = parts if is_pkg else parts[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    if node.module:
                        yield mod, target, a.name, node.lineno
                    else:  # from . import submodule
                        yield mod, f"{target}.{a.name}", None, node.lineno


def test_every_module_is_in_a_layer():
    for mod, _, _, _ in _imports():
        _layer(mod)


def test_no_module_imports_from_a_layer_above():
    up = [f"{mod}:{line} imports {target}" for mod, target, _, line in _imports()
          if target.startswith("mesharray") and _layer(target) > _layer(mod)]
    assert up == []


def test_no_private_name_is_imported_across_parts():
    # within one part (mesharray.runtime, mesharray.darray, one module) private names are fine
    leaks = [f"{mod}:{line} imports {name} from {target}" for mod, target, name, line in _imports()
             if target.startswith("mesharray") and name and name.startswith("_") and not name.startswith("__")
             and _part(target) != _part(mod) and target != "mesharray._core"]
    assert leaks == []


@pytest.mark.parametrize("lower, upper", [("mesharray.proc", "mesharray.darray"),
                                          ("mesharray.bootstrap", "mesharray.proc")])
def test_named_seams(lower, upper):
    # the two seams the layering was built around: proc never imports darray,
    # no bootstrap imports proc
    hits = [f"{mod}:{line}" for mod, target, _, line in _imports()
            if (mod == lower or mod.startswith(lower + ".")) and (target == upper or target.startswith(upper + "."))]
    assert hits == []


#: private modules meant for every layer above them
SHARED_PRIVATE = {"mesharray._core", "mesharray._proc_stat", "mesharray._platform"}


def test_no_private_module_of_another_part_is_imported():
    leaks = []
    for mod, target, _, line in _imports():
        if not target.startswith("mesharray.") or target in SHARED_PRIVATE or _part(target) == _part(mod):
            continue
        if any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:]):
            leaks.append(f"{mod}:{line} imports {target}")
    assert leaks == []


def test_no_private_attribute_of_an_imported_name_across_parts():
    # e.g. ``Future._new()`` in actor.py: the runtime offers new_future() for that
    leaks = []
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mod = ".".join(parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        foreign = {}
        for m, target, name, _ in _imports():
            if m == mod and name and target.startswith("mesharray") and _part(target) != _part(mod):
                foreign[name] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in foreign and node.attr.startswith("_") and not node.attr.startswith("__")):
                leaks.append(f"{mod}:{node.lineno} {node.value.id}.{node.attr} ({foreign[node.value.id]})")
    assert leaks == []


def _resolved(target: str, name: str | None) -> str:
    """The module an import names: ``from .transport import onesided`` names ``mesharray.transport.onesided``."""
    if name and target.startswith("mesharray"):
        sub = PKG.parent.joinpath(*f"{target}.{name}".split("."))
        if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
            return f"{target}.{name}"
    return target


#: the user-facing modules: the API, with the sending and the wire left to the runtime's caller
API_MODULES = ("mesharray.actor", "mesharray.proc", "mesharray.array", "mesharray.mesh")


def _speaks_wire(target: str) -> bool:
    return target == "mesharray.transport" or target.startswith("mesharray.transport.") \
        or target == "mesharray.runtime.protocol"


def test_api_modules_speak_no_wire_protocol():
    # actor, proc, array and mesh build on runtime.caller and runtime.controller; none of
    # them frames, pickles for the wire or names a message kind
    hits = [f"{mod}:{line} imports {_resolved(target, name)}" for mod, target, name, line in _imports()
            if mod in API_MODULES and _speaks_wire(_resolved(target, name))]
    assert hits == []


def test_buffer_calls_one_transport_module():
    # the Buffer API over the one module that owns the one-sided paths (cma, stream, UCX)
    used = {_resolved(target, name) for mod, target, name, _ in _imports()
            if mod == "mesharray.buffer" and _speaks_wire(_resolved(target, name))}
    assert used == {"mesharray.transport.onesided"}
