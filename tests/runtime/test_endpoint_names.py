"""An endpoint named like an attribute of the actor mesh is refused when the class is defined."""

from __future__ import annotations

import pytest

import mesharray as ma


@pytest.mark.parametrize("name", ["size", "slice", "rename", "shape", "name", "stop", "split", "transpose"])
def test_endpoint_hidden_by_a_mesh_attribute_is_refused_with_how_to_rename(name):
    body = {name: ma.endpoint(lambda self: 1)}
    with pytest.raises(TypeError) as info:
        type("Clash", (ma.Actor,), body)
    msg = str(info.value)
    assert f"['{name}']" in msg and f"'get_{name}'" in msg and "rename" in msg


def test_other_endpoint_names_are_fine():
    class Fine(ma.Actor):
        @ma.endpoint
        def get(self) -> int:
            return 1

        @ma.endpoint
        def sizes_of(self) -> int:
            return 2

    assert sorted(Fine._mesharray_endpoints) == ["get", "sizes_of"]
