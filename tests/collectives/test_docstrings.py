"""The docstring examples of the data-plane modules run."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", [
    "mesharray.buffer",
    "mesharray.collectives",
    "mesharray.collectives.shm",
    "mesharray.engines",
    "mesharray.engines._registry",
    "mesharray.engines.numpy_engine",
    "mesharray.engines.torch_engine",
])
def test_docstring_examples_run(module):
    pytest.importorskip("torch") if module.endswith("torch_engine") else None
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0
