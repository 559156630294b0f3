"""A printed tour of ``Shape`` and ``MeshArray``: a mesh of processes is an array.

Run it with ``python examples/shapes.py`` (``make demo`` runs it before the
runtime exists). No process is started: this is the rank algebra every mesh
uses, and the array that ``endpoint.call()`` returns.
"""

from __future__ import annotations

import numpy as np

import mesharray as ma


def show(label: str, value: object) -> None:
    text = repr(value)
    if "\n" in text:
        print(f"{label} ->")
        for line in text.splitlines():
            print(f"    {line}")
    else:
        print(f"{label:<44} -> {text}")


def ranks(shape: ma.Shape) -> list:
    return shape.ranks().tolist()


def main() -> None:
    print("== Shape: named dims over global ranks, indexed exactly like NumPy ==\n")
    s = ma.Shape({"hosts": 2, "procs": 4})
    show("s = Shape({'hosts': 2, 'procs': 4})", s)
    show("s.ranks()", ranks(s))
    show("s[0, 1:3]", s[0, 1:3])
    show("s[0, 1:3].ranks()", ranks(s[0, 1:3]))
    show("s[:, ::-1].ranks()", ranks(s[:, ::-1]))
    show("s[[0, 1], [1, 2]]   (advanced)", s[[0, 1], [1, 2]])
    show("s[[0, 1], [1, 2]].ranks()", ranks(s[[0, 1], [1, 2]]))
    show("s.slice(procs=-1).ranks()", ranks(s.slice(procs=-1)))
    show("s[{'hosts': 1}].ranks()", ranks(s[{"hosts": 1}]))
    show("s.coordinates(6)", s.coordinates(6))
    show("s.rank_of({'hosts': 1, 'procs': 2})", s.rank_of({"hosts": 1, "procs": 2}))
    sparse = s[:, 1::2]
    show("sparse = s[:, 1::2]", sparse)
    show("sparse.flatten('r')", sparse.flatten("r"))
    show("sparse.flatten('r').ranks()", ranks(sparse.flatten("r")))
    show("s.split(procs=('a', 'b'), b=2)", s.split(procs=("a", "b"), b=2))
    show("s.transpose('procs', 'hosts').ranks()", ranks(s.transpose("procs", "hosts")))
    show("broadcast_shapes({'procs': 4}, s)", ma.broadcast_shapes({"procs": 4}, s))
    groups, result = ma.reduction_plan(s, "procs")
    show("reduction_plan(s, 'procs') groups", groups.tolist())
    show("reduction_plan(s, 'procs') result", result)
    groups, result = ma.reduction_plan(s[:, ::2], ("hosts",))
    show("reduction_plan(s[:, ::2], ('hosts',))", (groups.tolist(), result))

    print("\n== MeshArray: one element per rank, NumPy semantics, dims by name ==\n")
    # what `counters.get.call().get()` gives on that mesh: one value per actor
    vals = ma.MeshArray.from_results(s, [10 * r for r in range(8)])
    show("vals", vals)
    show("vals.sum()", vals.sum())
    show("vals.sum(axis='procs')", vals.sum(axis="procs"))
    show("vals.mean(axis='hosts', keepdims=True)", vals.mean(axis="hosts", keepdims=True))
    show("vals[0, 1:3]", vals[0, 1:3])
    show("vals.slice(procs=-1)", vals.slice(procs=-1))
    show("vals.item(hosts=1, procs=2)", vals.item(hosts=1, procs=2))
    # a per-rank block of 3 floats, and a per-`procs` scale: aligned by name
    blocks = ma.MeshArray(np.arange(24, dtype="float32").reshape(2, 4, 3), ["hosts", "procs"])
    scale = ma.MeshArray(np.array([1, 2, 3, 4], dtype="float32"), ["procs"])
    show("blocks", blocks)
    show("scale", scale)
    y = blocks * scale + 1
    show("y = blocks * scale + 1", y)
    show("y.sum(axis='procs')", y.sum(axis="procs"))
    # NumPy hands np.sum to MeshArray, which takes dim names; NumPy's stub knows only ints
    show("np.sum(y, axis=('hosts', -1))", np.sum(y, axis=("hosts", -1)))  # type: ignore[arg-type]
    show("np.sqrt(blocks)[1, 0]", np.sqrt(blocks)[1, 0])
    show("(blocks > 20).any(axis='procs')", (blocks > 20).any(axis="procs"))
    show("y.sum(axis='procs').mesh_shape  (group roots)", y.sum(axis="procs").mesh_shape)
    try:
        blocks + ma.MeshArray([1, 2, 3], ["procs"])
    except ma.MeshShapeError as e:
        print(f"{'blocks + MeshArray([1, 2, 3], [procs])':<44} -> MeshShapeError: {e}")
    mixed = ma.MeshArray.from_results(ma.Shape(procs=3), ["ok", {"loss": 0.5}, None])
    show("any Python values (object array)", mixed)
    show("list(mixed.items())", list(mixed.items()))


if __name__ == "__main__":
    main()
