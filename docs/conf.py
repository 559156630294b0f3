"""Sphinx configuration: the user guide and the API reference (``make docs``).

The API reference is built from the docstrings (autodoc; numpydoc-style
sections through napoleon). Importing mesharray imports neither torch nor
mpi4py, so the docs build without them. ``make docs`` turns warnings into
errors (``-W``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import mesharray  # noqa: E402

project = "mesharray"
author = "the mesharray authors"
copyright = "2026, the mesharray authors"
release = version = mesharray.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "*.md"]  # internals.md and failures-transport.md are for contributors (README links them)

napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# forward references in signatures that autodoc cannot resolve are not worth a warning
suppress_warnings = ["autodoc.import_object"]

html_theme = "alabaster"
html_title = f"mesharray {release}"
