"""docs/settings.rst lists every MESHARRAY_* environment variable the code reads."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _names(paths) -> set[str]:
    out: set[str] = set()
    for p in paths:
        out |= set(re.findall(r"MESHARRAY_[A-Z][A-Z_]*[A-Z]", p.read_text(encoding="utf-8")))
    return out


def test_every_variable_is_documented():
    used = _names(ROOT.joinpath("mesharray").rglob("*.py")) | _names(ROOT.joinpath("tests").rglob("*.py"))
    page = _names([ROOT / "docs" / "settings.rst"])
    assert used - page == set(), "add these to docs/settings.rst (with their defaults)"


def test_documented_variables_exist():
    used = _names(ROOT.joinpath("mesharray").rglob("*.py")) | _names(ROOT.joinpath("tests").rglob("*.py"))
    page = _names([ROOT / "docs" / "settings.rst"])
    assert page - used == set(), "docs/settings.rst lists variables nothing reads"


def test_readme_links_the_settings_page():
    assert "docs/settings.rst" in (ROOT / "README.md").read_text(encoding="utf-8")
