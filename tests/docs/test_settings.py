"""docs/settings.rst lists every MESHARRAY_* environment variable the code reads (its Python and
its compiled modules' sources)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _names(paths) -> set[str]:
    out: set[str] = set()
    for p in paths:
        out |= set(re.findall(r"MESHARRAY_[A-Z][A-Z_]*[A-Z]", p.read_text(encoding="utf-8")))
    return out


def _code() -> list:
    pkg = ROOT.joinpath("mesharray")
    return [*pkg.rglob("*.py"), *pkg.rglob("*.pyx"), *pkg.rglob("*.pxi"), *ROOT.joinpath("tests").rglob("*.py")]


def test_every_variable_is_documented():
    used = _names(_code())
    page = _names([ROOT / "docs" / "settings.rst"])
    assert used - page == set(), "add these to docs/settings.rst (with their defaults)"


def test_documented_variables_exist():
    used = _names(_code())
    page = _names([ROOT / "docs" / "settings.rst"])
    assert page - used == set(), "docs/settings.rst lists variables nothing reads"


def test_readme_links_the_settings_page():
    assert "docs/settings.rst" in (ROOT / "README.md").read_text(encoding="utf-8")
