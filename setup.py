"""Build the compiled core, ``mesharray._core``, the transport's ``mesharray.transport._wire`` (a connection's
per-message read and write) and, where UCX is installed, ``mesharray.transport._ucp``.

Compiler directives live in the ``.pyx`` headers (as mpi4py does), not here.

``_ucp`` (the UCX data plane's native half) is built against the ``libucx``
wheel that the ``ucx`` extra installs (headers in ``libucx/include``, libraries
in ``libucx/lib``), or a UCX prefix named by ``UCX_HOME``. Without either, it is
left out and everything else builds as before: a wheel built in an isolated
environment (``make wheel``, cibuildwheel) has no UCX and so no ``_ucp``.
``MESHARRAY_REQUIRE_UCX=1`` makes its absence an error (``make test`` sets it).
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup


def ucx_prefix():
    """``(include dir, library dir)`` of an installed UCX, or ``None``."""
    home = os.environ.get("UCX_HOME")
    if home:
        return os.path.join(home, "include"), os.path.join(home, "lib")
    try:
        import importlib.util

        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    inc, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    if os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")) and os.path.isdir(lib):
        return inc, lib
    return None


extensions = [
    Extension(
        "mesharray._core",
        ["mesharray/_core.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    ),
    # a connection's per-message read and write (the transport's I/O: not in _core, which has none)
    Extension("mesharray.transport._wire", ["mesharray/transport/_wire.pyx"], extra_compile_args=["-O3"]),
]

ucx = ucx_prefix() if sys.platform.startswith("linux") else None
if ucx is not None:
    inc, lib = ucx
    extensions.append(
        Extension(
            "mesharray.transport._ucp",
            ["mesharray/transport/_ucp.pyx"],
            include_dirs=[inc, "mesharray/transport"],
            library_dirs=[lib],
            # libucp/libucs come from the libucx wheel: transport/ucx.py preloads them
            # (libucx.load_library) before importing _ucp; the rpath finds them without it
            libraries=["ucp", "ucs"],
            runtime_library_dirs=[lib],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
        )
    )
elif os.environ.get("MESHARRAY_REQUIRE_UCX") == "1":
    raise SystemExit("MESHARRAY_REQUIRE_UCX=1 but no UCX found: install the libucx wheel "
                     "(pip install 'mesharray[ucx]') or set UCX_HOME")

setup(ext_modules=cythonize(extensions, language_level=3))
