"""The type stub ``mesharray/_core.pyi`` matches the compiled module, both ways.

Generic on purpose: whatever any part of ``_core`` adds (functions, classes,
their methods and properties, constants) must appear in the stub with the same
kind and parameter names, and the stub must not promise anything the binary
lacks.  Private names (leading underscore) are not checked.
"""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest

from mesharray import _core

STUB = Path(_core.__file__).with_name("_core.pyi")
if not STUB.exists():  # built in place or installed: the stub sits next to the .pyx
    STUB = Path(__file__).resolve().parents[2] / "mesharray" / "_core.pyi"


def _public(name: str) -> bool:
    return not name.startswith("_")


def _stub_tree():
    return ast.parse(STUB.read_text())


def _kind_of_stub_def(node) -> str:
    if isinstance(node, ast.ClassDef):
        return "class"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        decos = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list}
        if "property" in decos:
            return "property"
        if "staticmethod" in decos:
            return "staticmethod"
        if "classmethod" in decos:
            return "classmethod"
        return "function"
    return "constant"


def _stub_members(body) -> dict[str, ast.AST]:
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if _public(node.name):
                # a property setter repeats the name; the first definition decides the kind
                out.setdefault(node.name, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _public(node.target.id):
                out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and _public(t.id):
                    out[t.id] = node
    return out


def _binary_module_names() -> dict[str, object]:
    out = {}
    for name, obj in vars(_core).items():
        if not _public(name) or isinstance(obj, types.ModuleType):
            continue
        module = getattr(obj, "__module__", None)
        if isinstance(obj, (type, types.BuiltinFunctionType, types.FunctionType)) or callable(obj):
            # defined here: in _core, or public as mesharray.<name> (its __module__ says "mesharray")
            if module not in (_core.__name__, "mesharray"):
                continue  # imported from elsewhere (e.g. mesharray.errors), not defined here
        out[name] = obj
    return out


def _binary_kind(cls, name) -> str:
    raw = cls.__dict__[name]
    if isinstance(raw, (property, types.GetSetDescriptorType, types.MemberDescriptorType)):
        return "property"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, classmethod) or type(raw).__name__ == "classmethod_descriptor":
        return "classmethod"
    if isinstance(raw, type):
        return "class"
    if callable(raw):
        return "function"
    return "constant"


def _stub_params(node) -> list[str]:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def _binary_params(obj, name: str) -> list[str] | None:
    """Parameter names from the signature Cython embeds in the docstring (or inspect)."""
    try:
        return [
            ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
            for p in inspect.signature(obj).parameters.values()
        ]
    except (TypeError, ValueError):
        pass
    doc = (getattr(obj, "__doc__", None) or "").lstrip()
    first = doc.splitlines()[0] if doc else ""
    head = first.split("(", 1)[0]
    if not first or head.rsplit(".", 1)[-1] != name or "(" not in first:
        return None
    inner = first[first.index("(") + 1 : first.rindex(")")]
    out = []
    for part in _split_top(inner):
        part = part.split("=", 1)[0].strip()
        if part in ("/", "*"):
            continue
        stars = "**" if part.startswith("**") else "*" if part.startswith("*") else ""
        out.append(stars + part.lstrip("*").split()[-1])
    return out


def _compare_params(stub_node, obj, name, where):
    stub = _stub_params(stub_node)
    binary = _binary_params(obj, name)
    if binary is None:
        return
    if stub and stub[0] in ("self", "cls") and (not binary or binary[0] not in ("self", "cls")):
        stub = stub[1:]
    assert stub == binary, f"{where}: stub parameters {stub} != compiled {binary}"


def test_stub_module_names_match_the_binary():
    stub = _stub_members(_stub_tree().body)
    binary = _binary_module_names()
    assert sorted(set(binary) - set(stub)) == [], "compiled but missing from _core.pyi"
    assert sorted(set(stub) - set(binary)) == [], "in _core.pyi but not compiled"


def _classes():
    stub = _stub_members(_stub_tree().body)
    return [n for n, node in stub.items() if isinstance(node, ast.ClassDef)]


def _functions():
    stub = _stub_members(_stub_tree().body)
    return [n for n, node in stub.items() if isinstance(node, ast.FunctionDef)]


@pytest.mark.parametrize("name", _functions())
def test_stub_function_signatures(name):
    node = _stub_members(_stub_tree().body)[name]
    obj = getattr(_core, name)
    assert callable(obj)
    _compare_params(node, obj, name, name)


@pytest.mark.parametrize("cls_name", _classes())
def test_stub_class_members_match_the_binary(cls_name):
    node = _stub_members(_stub_tree().body)[cls_name]
    cls = getattr(_core, cls_name)
    assert isinstance(cls, type)
    stub = _stub_members(node.body)
    binary = {n for n in cls.__dict__ if _public(n)}
    assert sorted(binary - set(stub)) == [], f"{cls_name}: compiled but missing from _core.pyi"
    assert sorted(set(stub) - binary) == [], f"{cls_name}: in _core.pyi but not compiled"
    for member, mnode in stub.items():
        kind = _kind_of_stub_def(mnode)
        if kind == "function" and _binary_kind(cls, member) == "staticmethod":
            pytest.fail(f"{cls_name}.{member} is a staticmethod; mark it @staticmethod in the stub")
        if kind == "constant" and _binary_kind(cls, member) == "property":
            continue  # (a C field, `cdef public`: an instance attribute, annotated as one)
        assert _binary_kind(cls, member) == kind, f"{cls_name}.{member}: stub says {kind}"
        if kind in ("function", "staticmethod", "classmethod"):
            _compare_params(mnode, getattr(cls, member), member, f"{cls_name}.{member}")


@pytest.mark.parametrize("cls_name", _classes())
def test_stub_dunders_exist_in_the_binary(cls_name):
    node = _stub_members(_stub_tree().body)[cls_name]
    cls = getattr(_core, cls_name)
    for sub in node.body:
        if isinstance(sub, ast.FunctionDef) and sub.name.startswith("__") and sub.name != "__init__":
            assert hasattr(cls, sub.name), f"{cls_name}.{sub.name} is in the stub but not compiled"


def test_stub_sections_are_marked():
    text = STUB.read_text()
    for section in ("# --- _shape.pxi ---", "# --- _frame.pxi ---", "# --- _kernels.pxi ---", "# --- _dispatch.pxi ---"):
        assert section in text
