"""Every package's docstring names each of its modules, so a reader who opens ``__init__.py`` finds them all.

A module is named by a ``:mod:`` role whose target ends with its name (``:mod:`.shm```,
``:mod:`~mesharray.darray.worker```, ``:mod:`mesharray.transport.ucx```). The modules of a
package: its ``.py`` files but ``__init__``, its compiled ``.pyx`` modules (their ``.pxi``
includes are part of them) and its subpackages. A relative ``:mod:`.name``` must name a
module that exists.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "mesharray"

PACKAGES = sorted(p.parent for p in PKG.rglob("__init__.py"))

_MOD_ROLE = re.compile(r":mod:`~?([\w.]+)`")


def _name(package: pathlib.Path) -> str:
    return ".".join(package.relative_to(PKG.parent).parts)


def _init(package: pathlib.Path) -> str:
    return str((package / "__init__.py").relative_to(PKG.parent))


def _modules(package: pathlib.Path) -> set[str]:
    names = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    names |= {p.stem for p in package.glob("*.pyx")}
    names |= {d.name for d in package.iterdir() if (d / "__init__.py").exists()}
    return names


def _named(package: pathlib.Path) -> tuple[set[str], set[str]]:
    """(module names the docstring's :mod: roles end with, relative targets it names)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    targets = _MOD_ROLE.findall(doc)
    return {t.rsplit(".", 1)[-1] for t in targets}, {t[1:] for t in targets if t.startswith(".")}


@pytest.mark.parametrize("package", PACKAGES, ids=_name)
def test_package_docstring_names_every_module(package):
    named, _ = _named(package)
    missing = sorted(_modules(package) - named)
    assert not missing, f"{_init(package)}'s docstring names no :mod: for {missing}"


@pytest.mark.parametrize("package", PACKAGES, ids=_name)
def test_package_docstring_names_no_module_that_is_gone(package):
    _, relative = _named(package)
    stale = sorted(t for t in relative if t.split(".")[0] not in _modules(package))
    assert not stale, f"{_init(package)}'s docstring names modules it does not have: {stale}"


def test_every_package_is_checked():
    # the packages of the layer map, at least: a package without __init__.py would escape
    assert {_name(p) for p in PACKAGES} >= {
        "mesharray", "mesharray.runtime", "mesharray.transport", "mesharray.bootstrap",
        "mesharray.bootstrap.k8s", "mesharray.collectives", "mesharray.engines",
        "mesharray.darray", "mesharray.observe"}
