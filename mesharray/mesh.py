"""``MeshTrait``: indexing, slicing and reshaping for every mesh-like object.

A mesh-like class (``ProcMesh``, ``ActorMesh``, ``MeshArray``) holds a
:class:`~mesharray.Shape` over global ranks and knows how to rebuild itself on
another ``Shape``. ``MeshTrait`` turns those two hooks into the whole mesh API,
so no class re-implements slicing: every index is resolved by ``Shape``.

The hooks a subclass provides:

``_mesh_shape`` (property)
    The object's ``Shape``.
``_with_mesh_shape(shape)``
    A new instance over ``shape``, sharing everything else (processes, actors,
    values). ``shape`` is always a view derived from ``_mesh_shape`` by one of the
    methods below.

:class:`MeshTrait`'s docstring shows a minimal subclass.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self

from .errors import DimensionError

if TYPE_CHECKING:  # pragma: no cover
    from ._core import Shape

__all__ = ["MeshTrait", "mesh_size"]


class MeshTrait:
    """Mixin giving NumPy-style indexing and Monarch-style reshaping to a mesh-like class.

    Subclasses provide ``_mesh_shape`` (a property returning their
    :class:`~mesharray.Shape`) and ``_with_mesh_shape(shape)`` (a new instance
    over ``shape``). Everything else is derived from those two hooks.

    Examples
    --------
    >>> import mesharray as ma
    >>> class Ranks(ma.MeshTrait):
    ...     def __init__(self, shape):
    ...         self._shape = shape
    ...     @property
    ...     def _mesh_shape(self):
    ...         return self._shape
    ...     def _with_mesh_shape(self, shape):
    ...         return Ranks(shape)
    >>> m = Ranks(ma.Shape({"hosts": 2, "procs": 4}))
    >>> m.shape, m.names, len(m)
    ((2, 4), ('hosts', 'procs'), 8)
    >>> m[1, ::2].mesh_shape.ranks().tolist()
    [4, 6]
    >>> m.slice(procs=-1).sizes
    {'hosts': 2}
    >>> m.flatten("gpus").sizes
    {'gpus': 8}
    """

    __slots__ = ()

    # -- hooks ---------------------------------------------------------------------

    @property
    def _mesh_shape(self) -> Shape:
        raise NotImplementedError(f"{type(self).__name__} must define the _mesh_shape property")

    def _with_mesh_shape(self, shape: Shape) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define _with_mesh_shape(shape)")

    # -- views -----------------------------------------------------------------------
    # (every example below builds its own small mesh: a doctest runs one docstring alone,
    # and a reader sees each method's example whole)

    def with_shape(self, shape: Shape) -> Self:
        """The same object over another :class:`~mesharray.Shape` of its ranks.

        What every view below is built on; for layers above (e.g. a view of
        an actor mesh over an explicit list of ranks). ``shape`` must name
        ranks the object has.

        >>> from mesharray.mesh import _ShapeMesh
        >>> import mesharray as ma
        >>> _ShapeMesh(ma.Shape(procs=4)).with_shape(ma.Shape(procs=2)).sizes
        {'procs': 2}
        """
        return self._with_mesh_shape(shape)

    def __getitem__(self, key: Any) -> Self:
        """A view selected by a NumPy-style index or by a ``{name: selector}`` dict.

        Positional keys follow NumPy's indexing rules (ints, negative ints,
        slices with any step, ``...``, ``None``, integer arrays, boolean masks);
        a dict selects dims by name, like :meth:`slice`.

        Examples
        --------
        >>> import mesharray as ma
        >>> from mesharray.mesh import _ShapeMesh
        >>> m = _ShapeMesh(ma.Shape({"hosts": 2, "procs": 4}))
        >>> m[0, 1:3].mesh_shape.ranks().tolist()
        [1, 2]
        >>> m[{"procs": 1}].mesh_shape.ranks().tolist()
        [1, 5]
        """
        return self._with_mesh_shape(self._mesh_shape[key])

    def slice(self, **dims: Any) -> Self:
        """A view selected by dimension name: ``m.slice(procs=1, hosts=slice(0, 2))``.

        An int removes the dim, a slice (any step, negative bounds) keeps it;
        integer sequences and boolean masks select like NumPy.

        Examples
        --------
        >>> import mesharray as ma
        >>> from mesharray.mesh import _ShapeMesh
        >>> m = _ShapeMesh(ma.Shape({"hosts": 2, "procs": 4}))
        >>> m.slice(procs=slice(None, None, -2)).mesh_shape.ranks().tolist()
        [3, 1, 7, 5]
        """
        return self._with_mesh_shape(self._mesh_shape.slice(**dims))

    def rename(self, **old_to_new: str) -> Self:
        """The same ranks with dims renamed: ``m.rename(procs="gpus")``.

        Examples
        --------
        >>> import mesharray as ma
        >>> from mesharray.mesh import _ShapeMesh
        >>> _ShapeMesh(ma.Shape({"hosts": 2, "procs": 4})).rename(procs="gpus").names
        ('hosts', 'gpus')
        """
        return self._with_mesh_shape(self._mesh_shape.rename(**old_to_new))

    def flatten(self, name: str) -> Self:
        """All dims merged into one dim ``name``, in row-major order (sparse views too).

        Examples
        --------
        >>> import mesharray as ma
        >>> from mesharray.mesh import _ShapeMesh
        >>> m = _ShapeMesh(ma.Shape({"hosts": 2, "procs": 4}))
        >>> m[:, ::2].flatten("r").mesh_shape.ranks().tolist()
        [0, 2, 4, 6]
        """
        return self._with_mesh_shape(self._mesh_shape.flatten(name))

    def split(self, **spec: Any) -> Self:
        """One dim split into several: ``m.split(procs=("a", "b"), b=2)``.

        Examples
        --------
        >>> import mesharray as ma
        >>> from mesharray.mesh import _ShapeMesh
        >>> _ShapeMesh(ma.Shape({"procs": 8})).split(procs=("a", "b"), b=2).sizes
        {'a': 4, 'b': 2}
        """
        return self._with_mesh_shape(self._mesh_shape.split(**spec))

    def transpose(self, *dims: str | int) -> Self:
        """The same ranks with dims reordered (names or axis numbers; none reverses).

        Examples
        --------
        >>> import mesharray as ma
        >>> from mesharray.mesh import _ShapeMesh
        >>> _ShapeMesh(ma.Shape({"hosts": 2, "procs": 4})).transpose("procs", "hosts").sizes
        {'procs': 4, 'hosts': 2}
        """
        return self._with_mesh_shape(self._mesh_shape.transpose(*dims))

    # -- sizes -----------------------------------------------------------------------

    def size(self, dims: str | tuple[str, ...] | list[str] | None = None) -> int:
        """Number of ranks: in total, along one dim, or the product over several dims.

        Raises
        ------
        DimensionError
            For a name the mesh does not have.

        Examples
        --------
        >>> from mesharray import Shape
        >>> _ShapeMesh(Shape({"hosts": 2, "procs": 4})).size(), _ShapeMesh(Shape({"hosts": 2, "procs": 4})).size("procs")
        (8, 4)
        >>> _ShapeMesh(Shape({"hosts": 2, "procs": 4})).size(("hosts", "procs"))
        8
        """
        return mesh_size(self._mesh_shape, dims)

    @property
    def sizes(self) -> dict[str, int]:
        """``{name: size}`` in dim order."""
        shape = self._mesh_shape
        return dict(zip(shape.names, shape.sizes))

    @property
    def names(self) -> tuple[str, ...]:
        """Dimension names, in order."""
        return tuple(self._mesh_shape.names)

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return self._mesh_shape.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of the dims, as a tuple (NumPy's ``shape``)."""
        return tuple(self._mesh_shape.sizes)

    @property
    def mesh_shape(self) -> Shape:
        """The :class:`~mesharray.Shape` (names over global ranks) of this mesh."""
        return self._mesh_shape

    def __len__(self) -> int:
        """Number of ranks."""
        return self._mesh_shape.size

    def __iter__(self) -> Iterator[Self]:
        """0-d views, one per rank, in row-major order."""
        shape = self._mesh_shape
        for coords in _row_major(shape.sizes):
            yield self._with_mesh_shape(shape[coords])


def mesh_size(shape: Shape, dims: Any) -> int:
    """Number of ranks of ``shape`` along ``dims`` (a name, names, or None for all): ``MeshTrait.size``."""
    if dims is None:
        return shape.size
    sizes = dict(zip(shape.names, shape.sizes))
    if isinstance(dims, str):
        if dims not in sizes:
            raise DimensionError(dims, shape.names)
        return sizes[dims]
    if isinstance(dims, (tuple, list)):
        for d in dims:
            if not isinstance(d, str):
                raise TypeError(f"dimension names must be str, got {type(d).__name__}: {d!r}")
            if d not in sizes:
                raise DimensionError(d, shape.names)
        return math.prod(sizes[d] for d in dims)
    raise TypeError(
        f"size() takes a dimension name or a tuple of names, got {type(dims).__name__}: {dims!r}"
    )


def _row_major(sizes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(n) for n in sizes))


class _ShapeMesh(MeshTrait):
    """The smallest mesh: just a ``Shape`` (used by examples and tests)."""

    __slots__ = ("_shape",)

    def __init__(self, shape: Shape) -> None:
        self._shape = shape

    @property
    def _mesh_shape(self) -> Shape:
        return self._shape

    def _with_mesh_shape(self, shape: Shape) -> _ShapeMesh:
        return _ShapeMesh(shape)

    def __repr__(self) -> str:
        return f"_ShapeMesh({self._shape!r})"
