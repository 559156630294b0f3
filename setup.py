"""Build the compiled core, ``mesharray._core``, from ``mesharray/_core.pyx``.

Compiler directives live in the ``.pyx`` header (as mpi4py does), not here.
"""
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "mesharray._core",
        ["mesharray/_core.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
]

setup(ext_modules=cythonize(extensions, language_level=3))
