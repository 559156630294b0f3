# _shape: ``Shape`` (named views over global ranks), NumPy indexing,
# ``broadcast_shapes`` and ``reduction_plan``.  Included by _core.pyx.
#
# Layout.  A Shape is ``ndim`` sizes and strides (C arrays, at most MAX_DIMS)
# plus an offset, over a *base*:
#   - strided  (``_base is None``): rank = offset + sum(i[d] * stride[d])
#   - explicit (``_base`` a read-only 1-d int64 array): the same formula gives a
#     position into ``_base`` and the rank is ``_base[position]``.
# Basic indexing only moves offset/sizes/strides, so it is O(ndim) for both
# layouts and never copies; advanced indexing gathers with NumPy and normalises
# the gathered ranks back to a strided layout whenever they are one.

cimport cython
cimport numpy as cnp
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.slice cimport PySlice_Unpack, PySlice_AdjustIndices
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_SIZE, PyTuple_GET_ITEM
from libc.stdint cimport int64_t

import operator as _operator
from collections.abc import Mapping as _Mapping

import numpy as _np

from mesharray.errors import DimensionError, InvalidIndexError, MeshIndexError, MeshShapeError

cnp.import_array()

cdef extern from "Python.h":
    bint PyLong_CheckExact(object o)
    bint PySlice_Check(object o)
    bint PyTuple_CheckExact(object o)
    bint PyDict_Check(object o)
    Py_ssize_t _raw_as_ssize "PyLong_AsSsize_t"(object o) noexcept
    PyObject* PyErr_Occurred() noexcept
    void PyErr_Clear() noexcept
    PyObject** PySequence_Fast_ITEMS(object o) noexcept
    int PyDict_Next(object d, Py_ssize_t* pos, PyObject** key, PyObject** value) noexcept

cdef enum:
    MAX_DIMS = 32

# Module-level singletons compared by identity on the fast path.
cdef object _ELLIPSIS = Ellipsis
cdef object _FULL = slice(None)
cdef object _INT64 = _np.dtype(_np.int64)

_INVALID_INDEX = ("only integers, slices (`:`), ellipsis (`...`), numpy.newaxis (`None`) "
                  "and integer or boolean arrays are valid indices")
_ONE_ELLIPSIS = "an index can only have a single ellipsis ('...')"


cdef inline object _fresh_name(int pos, object used):
    # Name of a dim that no input dim names (made by ``None`` or a 0-d bool):
    # ``_<pos>`` with ``pos`` its position in the result, made unique.
    name = "_" + str(pos)
    while name in used:
        name = name + "_"
    return name


cdef object _unique(object name, object used):
    if name not in used:
        return name
    cdef int j = 1
    while (name + "_" + str(j)) in used:
        j += 1
    return name + "_" + str(j)


cdef object _too_many(int ndim, int n):
    return MeshIndexError(
        f"too many indices for mesh: mesh is {ndim}-dimensional, but {n} were indexed")


cdef object _out_of_bounds(Py_ssize_t index, int axis, object name, Py_ssize_t size):
    return MeshIndexError(
        f"index {index} is out of bounds for axis {axis} ({name!r}) with size {size}")


cdef Py_ssize_t _as_index(object o) except? -1:
    # An int-like (int, np.integer, __index__) as Py_ssize_t; too large → IndexError.
    try:
        return o
    except OverflowError:
        raise MeshIndexError(f"index {o} is out of bounds (it does not fit in an index)") from None


cdef inline bint _is_int_like(object o):
    # bools are *not* integers for indexing (NumPy treats them as 0-d masks).
    if PyLong_CheckExact(o):
        return True
    if isinstance(o, (bool, _np.bool_)):
        return False
    if isinstance(o, _np.integer):
        return True
    if isinstance(o, _np.ndarray):
        return False
    try:
        _operator.index(o)
    except TypeError:
        return False
    return True


cdef tuple _classify(object idx):
    # The one index classifier (Shape and MeshArray both use it): each item of a
    # NumPy-style index as (value, kind) with kind 'i' int, 's' slice, 'n' None,
    # 'e' ellipsis, 'a' integer array, 'm' boolean mask, 'b' 0-d bool; checked as
    # NumPy checks it, except bounds, which need the sizes.
    if not PyTuple_CheckExact(idx):
        if isinstance(idx, tuple):
            idx = tuple(idx)
        else:
            idx = (idx,)
    cdef list items = []
    cdef list kinds = []   # 'i' int, 's' slice, 'n' None, 'e' ellipsis, 'a' int array, 'm' mask, 'b' 0-d bool
    cdef int consumed = 0, ell = 0
    for o in idx:
        if o is None:
            items.append(None); kinds.append("n")
        elif o is _ELLIPSIS:
            ell += 1
            if ell > 1:
                raise MeshIndexError(_ONE_ELLIPSIS)
            items.append(o); kinds.append("e")
        elif PySlice_Check(o):
            items.append(o); kinds.append("s"); consumed += 1
        elif isinstance(o, (bool, _np.bool_)):
            items.append(bool(o)); kinds.append("b")
        elif PyLong_CheckExact(o) or isinstance(o, _np.integer):
            items.append(_operator.index(o)); kinds.append("i"); consumed += 1
        elif not isinstance(o, (_np.ndarray, list, tuple, range)) and _is_int_like(o):
            items.append(_operator.index(o)); kinds.append("i"); consumed += 1
        elif isinstance(o, (_np.ndarray, list, tuple, range)) or (
                hasattr(o, "__array__") and not isinstance(o, (str, bytes))):
            a = _np.asarray(o)
            if a.dtype == _np.bool_:
                if a.ndim == 0:
                    items.append(bool(a)); kinds.append("b")
                else:
                    items.append(a); kinds.append("m"); consumed += a.ndim
                continue
            if a.size == 0 and a.dtype.kind in "fO" and not isinstance(o, _np.ndarray):
                a = a.astype(_np.intp)  # ``[]`` is an empty integer index, as in NumPy
            if a.dtype.kind not in "iu":
                raise InvalidIndexError(
                    f"arrays used as indices must be of integer (or boolean) type, not {a.dtype}")
            if a.dtype.kind == "u" and a.size and int(a.max()) > 0x7FFFFFFFFFFFFFFF:
                # would wrap to a negative int64 below; no mesh is that large
                raise MeshIndexError(f"index {int(a.max())} is out of bounds for the mesh")
            if a.ndim == 0:
                items.append(int(a)); kinds.append("i"); consumed += 1
            else:
                items.append(a); kinds.append("a"); consumed += 1
        else:
            raise InvalidIndexError(f"{_INVALID_INDEX}; got {type(o).__name__} {o!r}")
    return items, kinds, consumed


def classify_index(idx, int ndim, str what="mesh"):
    """Classify a NumPy-style index: ``(items, kinds, consumed)``.

    ``kinds`` has one letter per item: ``i`` int, ``s`` slice, ``n`` None,
    ``e`` ellipsis, ``a`` integer array, ``m`` boolean mask (consumes its
    ndim dims), ``b`` 0-d bool. Array-likes become ndarrays, integer scalars
    ints. Everything NumPy checks but the bounds is checked here, with NumPy's
    messages: :class:`~mesharray.InvalidIndexError` for a type nothing
    indexes with, :class:`~mesharray.MeshIndexError` for a second ellipsis or
    too many indices for an object of ``ndim`` dims (called a ``what``).

    >>> classify_index((0, slice(None), [1, 2]), 3)[1]
    ['i', 's', 'a']
    """
    items, kinds, consumed = _classify(idx)
    if consumed > ndim:
        raise MeshIndexError(
            f"too many indices for {what}: {what} is {ndim}-dimensional, but {consumed} were indexed")
    return items, kinds, consumed


@cython.final
@cython.freelist(64)
@cython.no_gc  # holds only str tuples, int tuples and an int64 array: it cannot be in a cycle
cdef class Shape:
    """Named dimensions over a set of global ranks, laid out row-major.

    A ``Shape`` is what a mesh *is*: ``Shape({"hosts": 2, "procs": 4})`` is the
    dense 2 x 4 view over ranks 0..7.  Indexing follows NumPy exactly and always
    gives a ``Shape``: basic indexing (ints, slices with any step, ``...``,
    ``None``) gives a strided view (``offset``, ``sizes``, ``strides``); advanced
    indexing (integer arrays, boolean masks) gives an explicit list of ranks.

    Parameters
    ----------
    extent : mapping of str to int, optional
        Dimension names to sizes, in order.
    **sizes : int
        The same as keywords (``Shape(hosts=2, procs=4)``).

    Examples
    --------
    >>> s = Shape({"hosts": 2, "procs": 4})
    >>> s
    Shape{hosts=2, procs=4}
    >>> s[1, ::2].ranks().tolist()
    [4, 6]
    >>> s.slice(procs=1)
    Shape{hosts=2; offset=1, strides=(4,)}
    """

    cdef int _ndim
    cdef Py_ssize_t _size
    cdef Py_ssize_t _offset
    cdef Py_ssize_t _sizes[MAX_DIMS]
    cdef Py_ssize_t _strides[MAX_DIMS]
    cdef tuple _names
    cdef object _base          # None (strided) or read-only 1-d int64 ndarray (explicit)
    cdef const int64_t* _bptr  # data of _base
    cdef object _sizes_t       # cached tuple
    cdef Py_hash_t _hash       # 0 = not yet computed
    cdef tuple _names_cache    # names of the last basic-index result (see _basic)
    cdef unsigned long long _names_cache_mask  # which input dims it kept

    def __init__(self, extent=None, /, **sizes):
        if extent is not None:
            if sizes:
                raise TypeError("give the dimensions either as a mapping or as keywords, not both")
            if not isinstance(extent, _Mapping):
                raise TypeError(
                    f"Shape() takes a mapping of dimension names to sizes, not {type(extent).__name__}")
            items = list(extent.items())
        else:
            items = list(sizes.items())
        names = []
        szs = []
        for name, size in items:
            names.append(name)
            szs.append(size)
        self._init_dense(tuple(names), szs)

    cdef _init_dense(self, tuple names, object sizes):
        cdef int n = len(names)
        _check_names(names, n)
        self._names = names
        self._ndim = n
        self._offset = 0
        self._base = None
        self._bptr = NULL
        self._hash = 0
        self._sizes_t = None
        cdef Py_ssize_t stride = 1
        cdef int d
        for d in range(n):
            self._sizes[d] = _check_size(sizes[d], names[d])
        for d in range(n - 1, -1, -1):
            self._strides[d] = stride
            stride *= self._sizes[d] if self._sizes[d] > 0 else 1
        self._finish()

    cdef inline void _finish(self) noexcept:
        cdef Py_ssize_t n = 1
        cdef int d
        for d in range(self._ndim):
            n *= self._sizes[d]
        self._size = n

    # ------------------------------------------------------------------ constructors

    @staticmethod
    def from_view(names, Py_ssize_t offset, sizes, strides):
        """A strided view: rank at coordinates ``i`` is ``offset + sum(i[d] * strides[d])``.

        Parameters
        ----------
        names : sequence of str
        offset : int
            Global rank at coordinates ``(0, ..., 0)``.
        sizes, strides : sequence of int
            One per name; strides may be negative or zero.

        Examples
        --------
        >>> Shape.from_view(("procs",), 1, (3,), (2,)).ranks().tolist()
        [1, 3, 5]
        """
        names = tuple(names)
        sizes = tuple(sizes)
        strides = tuple(strides)
        cdef int n = len(names)
        if len(sizes) != n or len(strides) != n:
            raise ValueError(
                f"names, sizes and strides must have the same length; got {n}, {len(sizes)} and {len(strides)}")
        _check_names(names, n)
        cdef Shape s = Shape.__new__(Shape)
        s._names = names
        s._ndim = n
        s._offset = offset
        cdef int d
        for d in range(n):
            s._sizes[d] = _check_size(sizes[d], names[d])
            if not _is_int_like(strides[d]):
                raise TypeError(f"stride of dimension {names[d]!r} must be an int, not {type(strides[d]).__name__}")
            s._strides[d] = strides[d]
        s._finish()
        s._check_nonnegative()
        return s

    @staticmethod
    def from_ranks(names, sizes, ranks):
        """A view over an explicit list of global ranks, in row-major order.

        The result is stored strided whenever the ranks form a strided view.

        Parameters
        ----------
        names : sequence of str
        sizes : sequence of int
        ranks : array_like of int
            ``prod(sizes)`` non-negative global ranks (repeats allowed).

        Examples
        --------
        >>> s = Shape.from_ranks(("procs",), (3,), [7, 2, 5])
        >>> s.ranks().tolist(), s.strides
        ([7, 2, 5], None)
        >>> Shape.from_ranks(("procs",), (3,), [1, 3, 5]).strides
        (2,)
        """
        names = tuple(names)
        sizes = tuple(sizes)
        cdef int n = len(names)
        if len(sizes) != n:
            raise ValueError(f"names and sizes must have the same length; got {n} and {len(sizes)}")
        _check_names(names, n)
        cdef Py_ssize_t total = 1
        cdef int d
        szs = []
        for d in range(n):
            szs.append(_check_size(sizes[d], names[d]))
            total *= szs[d]
        arr = _np.asarray(ranks)
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(_np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ranks must be integers, not {arr.dtype}")
        arr = _np.ascontiguousarray(arr.reshape(-1), dtype=_np.int64)
        if arr.shape[0] != total:
            raise ValueError(f"{arr.shape[0]} ranks do not fill sizes {tuple(szs)} ({total} ranks)")
        if total and arr.min() < 0:
            raise ValueError(f"ranks must be non-negative; got {int(arr.min())}")
        return _from_ranks(names, szs, arr)

    # ------------------------------------------------------------------ attributes

    @property
    def names(self):
        """Dimension names, a tuple of str."""
        return self._names

    @property
    def sizes(self):
        """Dimension sizes, a tuple of int."""
        if self._sizes_t is None:
            self._sizes_t = tuple([self._sizes[d] for d in range(self._ndim)])
        return self._sizes_t

    @property
    def strides(self):
        """Rank strides per dimension (tuple of int), or ``None`` for an explicit rank list."""
        if self._base is not None:
            return None
        return tuple([self._strides[d] for d in range(self._ndim)])

    @property
    def offset(self):
        """Global rank at coordinates ``(0, ..., 0)`` (of the first rank when explicit)."""
        if self._base is not None:
            return int(self._bptr[self._offset]) if self._size > 0 else 0
        return self._offset

    @property
    def ndim(self):
        """Number of dimensions."""
        return self._ndim

    @property
    def size(self):
        """Number of ranks in the view."""
        return self._size

    @property
    def extent(self):
        """Dimension names to sizes, a dict in order."""
        return {self._names[d]: self._sizes[d] for d in range(self._ndim)}

    def __len__(self):
        return self._size

    def __iter__(self):
        return iter(self.ranks().tolist())

    def __contains__(self, rank):
        if not _is_int_like(rank):
            return False
        return self._find(_operator.index(rank)) >= 0

    # ------------------------------------------------------------------ ranks

    def ranks(self):
        """Global ranks of the view in row-major order, a fresh int64 array.

        Examples
        --------
        >>> Shape(hosts=2, procs=4)[:, ::-2].ranks().tolist()
        [3, 1, 7, 5]
        """
        cdef cnp.npy_intp n = self._size
        out = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT64, 0)
        if n:
            _fill(self._ndim, self._sizes, self._strides, self._offset, self._bptr,
                  <int64_t*>cnp.PyArray_DATA(out))
        return out

    cdef inline Py_ssize_t _rank_at_pos(self, Py_ssize_t pos) noexcept:
        # pos: position in base index space (strided: the rank itself)
        if self._bptr != NULL:
            return self._bptr[pos]
        return pos

    def rank(self, Py_ssize_t i):
        """Global rank at flat row-major position ``i`` (negative counts from the end).

        Examples
        --------
        >>> Shape(hosts=2, procs=4)[:, 1:].rank(3)
        5
        """
        cdef Py_ssize_t j = i
        if j < 0:
            j += self._size
        if j < 0 or j >= self._size:
            raise MeshIndexError(f"index {i} is out of bounds for a mesh of {self._size} ranks")
        cdef Py_ssize_t pos = self._offset
        cdef int d
        for d in range(self._ndim - 1, -1, -1):
            pos += (j % self._sizes[d]) * self._strides[d]
            j //= self._sizes[d]
        return self._rank_at_pos(pos)

    cdef Py_ssize_t _find(self, Py_ssize_t rank) except -2:
        # Flat position of ``rank`` or -1.  Division for the common nested
        # layout (positive strides, each enclosing the next), else a search.
        cdef int d
        cdef Py_ssize_t r, c, pos, span, flat
        cdef bint nested = self._base is None and self._size > 0
        if nested:
            span = 1
            for d in range(self._ndim - 1, -1, -1):
                if self._sizes[d] == 1:
                    continue
                if self._strides[d] < span:
                    nested = False
                    break
                span = self._strides[d] * self._sizes[d]
        if nested:
            r = rank - self._offset
            if r < 0:
                return -1
            flat = 0
            for d in range(self._ndim):
                if self._sizes[d] == 1:
                    c = 0
                else:
                    c = r // self._strides[d]
                    if c >= self._sizes[d]:
                        return -1
                    r -= c * self._strides[d]
                flat = flat * self._sizes[d] + c
            return flat if r == 0 else -1
        if self._size == 0:
            return -1
        hits = _np.flatnonzero(self.ranks() == rank)
        return int(hits[0]) if hits.shape[0] else -1

    def index_of(self, rank):
        """Flat row-major position of global ``rank`` in the view (the first if repeated).

        Raises
        ------
        ValueError
            If the rank is not in the view.

        Examples
        --------
        >>> Shape(hosts=2, procs=4)[:, 1::2].index_of(7)
        3
        """
        if not _is_int_like(rank):
            raise TypeError(f"rank must be an int, not {type(rank).__name__}")
        cdef Py_ssize_t p = self._find(_as_index(rank))
        if p < 0:
            raise ValueError(f"rank {rank} is not in {self!r}")
        return p

    def coordinates(self, rank):
        """Coordinates of global ``rank`` in the view, a dict name -> int.

        Examples
        --------
        >>> Shape(hosts=2, procs=4).coordinates(6)
        {'hosts': 1, 'procs': 2}
        """
        cdef Py_ssize_t p = self.index_of(rank)
        coords = [0] * self._ndim
        cdef int d
        for d in range(self._ndim - 1, -1, -1):
            coords[d] = p % self._sizes[d]
            p //= self._sizes[d]
        return {self._names[d]: coords[d] for d in range(self._ndim)}

    def rank_of(self, coords):
        """Global rank at ``coords``: a dict name -> int (every dim) or a sequence.

        Negative coordinates count from the end, as in NumPy.

        Examples
        --------
        >>> s = Shape(hosts=2, procs=4)
        >>> s.rank_of({"hosts": 1, "procs": 2}), s.rank_of((1, -1))
        (6, 7)
        """
        cdef int d
        if isinstance(coords, _Mapping):
            for k in coords:
                if k not in self._names:
                    raise DimensionError(k, self._names)
            missing = [n for n in self._names if n not in coords]
            if missing:
                raise ValueError(f"coordinates miss dimensions {tuple(missing)}; dimensions are {self._names}")
            values = [coords[n] for n in self._names]
        else:
            if isinstance(coords, (str, bytes)) or not hasattr(coords, "__len__"):
                raise TypeError(f"coordinates must be a dict or a sequence of ints, not {type(coords).__name__}")
            values = list(coords)
            if len(values) != self._ndim:
                raise ValueError(f"{len(values)} coordinates given for a mesh of {self._ndim} dimensions {self._names}")
        cdef Py_ssize_t pos = self._offset, c
        for d in range(self._ndim):
            v = values[d]
            if not _is_int_like(v):
                raise TypeError(f"coordinate of {self._names[d]!r} must be an int, not {type(v).__name__}")
            c = _as_index(v)
            if c < 0:
                c += self._sizes[d]
            if c < 0 or c >= self._sizes[d]:
                raise _out_of_bounds(_as_index(v), d, self._names[d], self._sizes[d])
            pos += c * self._strides[d]
        return self._rank_at_pos(pos)

    # ------------------------------------------------------------------ indexing

    def __getitem__(self, idx):
        """``shape[idx]``: NumPy's indexing rules, always giving a ``Shape``.

        Basic indices (ints, slices with any step, ``...``, ``None``) give a
        strided view; ints drop their dim.  Advanced indices (integer arrays or
        sequences of any dims, boolean masks, 0-d bools) give an explicit rank
        list, placed as NumPy places them (together where the advanced indices
        are adjacent, else first).  A dict ``{name: index}`` indexes by name.

        Naming of dims that no input dim names:

        - ``None`` makes a size-1 dim named ``"_<p>"``, ``p`` its position in
          the result; so are named the dims of advanced indices that consume
          no dim (0-d bools, with ints only).
        - The dims of the broadcast advanced indices take the names of the dims
          the index arrays/masks consume, joined with ``"_"`` (one array on
          ``procs`` → ``procs``; arrays or a 2-d mask on ``hosts`` and
          ``procs`` → ``hosts_procs``).  When the broadcast has k > 1 dims they
          are ``<base>_0`` ... ``<base>_<k-1>``.
        - A made name that clashes with another dim of the result gets
          ``"_1"``, ``"_2"``, ... appended (``"_"`` for the ``None`` names).

        Examples
        --------
        >>> s = Shape(hosts=2, procs=4)
        >>> s[1, 1:].ranks().tolist()
        [5, 6, 7]
        >>> s[:, [0, 3]]
        Shape{hosts=2, procs=2; offset=0, strides=(4, 3)}
        >>> s[[[0], [1]], [0, 3]].names
        ('hosts_procs_0', 'hosts_procs_1')
        >>> s[None].names
        ('_0', 'hosts', 'procs')
        """
        cdef Shape r
        cdef PyObject* one
        if PyTuple_CheckExact(idx):
            r = self._basic(PySequence_Fast_ITEMS(idx), PyTuple_GET_SIZE(idx))
            if r is not None:
                return r
        elif PyLong_CheckExact(idx) or PySlice_Check(idx) or idx is None or idx is _ELLIPSIS:
            one = <PyObject*>idx
            r = self._basic(&one, 1)
            if r is not None:
                return r
        elif PyDict_Check(idx):
            return self._index_named(<dict>idx)
        return self._general(idx)

    def slice(self, **index):
        """Index by dimension name: ``s.slice(procs=1, hosts=slice(0, 2))``.

        Values are ints, slices, integer sequences/arrays or boolean masks; an
        int drops its dim, as in ``s[...]``.

        Examples
        --------
        >>> Shape(hosts=2, procs=4).slice(procs=slice(1, None, 2))
        Shape{hosts=2, procs=2; offset=1, strides=(4, 2)}
        """
        return self._index_named(index)

    cdef Shape _index_named(self, dict index):
        # Fast path of the named forms: items go straight to _basic (borrowed
        # pointers, a shared ``slice(None)`` for the dims not named).
        cdef PyObject* items[MAX_DIMS]
        cdef int d, found
        cdef Py_ssize_t pos = 0
        cdef PyObject* key
        cdef PyObject* value
        cdef Shape r
        for d in range(self._ndim):
            items[d] = <PyObject*>_FULL
        while PyDict_Next(index, &pos, &key, &value):
            found = -1
            for d in range(self._ndim):
                if <PyObject*>self._names[d] is key:
                    found = d
                    break
            if found < 0:
                for d in range(self._ndim):
                    if self._names[d] == <object>key:
                        found = d
                        break
            if found < 0 or not (PyLong_CheckExact(<object>value) or PySlice_Check(<object>value)):
                return self._general(self._named_index(index))
            items[found] = value
        r = self._basic(items, self._ndim)
        if r is None:
            return self._general(self._named_index(index))
        return r

    cdef tuple _named_index(self, object index):
        cdef list items = [slice(None)] * self._ndim
        cdef int d
        for name, v in index.items():
            try:
                d = self._names.index(name)
            except ValueError:
                raise DimensionError(name, self._names) from None
            if v is None or v is _ELLIPSIS:
                raise InvalidIndexError(
                    f"index of dimension {name!r} must be an int, a slice, an integer array or a "
                    f"boolean mask, not {v!r}")
            items[d] = v
        return tuple(items)

    cdef Shape _basic(self, PyObject** idx, Py_ssize_t n):
        # Fast path: ``n`` items (borrowed) that are ints, slices, None and at most
        # one Ellipsis.  Returns None when anything else is present (the general
        # path decides).  No Python allocation but the result and its names.
        cdef Py_ssize_t i
        cdef int consumed = 0, nnew = 0, ell = -1
        cdef object o
        for i in range(n):
            o = <object>idx[i]
            if PyLong_CheckExact(o) or PySlice_Check(o):
                consumed += 1
            elif o is None:
                nnew += 1
            elif o is _ELLIPSIS:
                if ell >= 0:
                    raise MeshIndexError(_ONE_ELLIPSIS)
                ell = <int>i
            else:
                return None
        if consumed > self._ndim:
            raise _too_many(self._ndim, consumed)
        cdef int out_ndim = self._ndim - consumed + nnew
        cdef Shape r = Shape.__new__(Shape)
        cdef int dim = 0, out = 0, k
        cdef Py_ssize_t v, size, start, stop, step, length
        cdef Py_ssize_t offset = self._offset
        cdef int nint = 0
        cdef unsigned long long kept = 0
        cdef PyObject* names_buf[MAX_DIMS]
        cdef tuple names = self._names
        for i in range(n):
            o = <object>idx[i]
            if PyLong_CheckExact(o):
                v = _raw_as_ssize(o)
                if v == -1 and PyErr_Occurred() != NULL:
                    PyErr_Clear()
                    raise MeshIndexError(
                        f"index {o} is out of bounds for axis {dim} ({names[dim]!r}) with size {self._sizes[dim]}")
                size = self._sizes[dim]
                if v < 0:
                    v += size
                if v < 0 or v >= size:
                    raise _out_of_bounds(o, dim, names[dim], size)
                offset += v * self._strides[dim]
                dim += 1
                nint += 1
            elif PySlice_Check(o):
                if out >= MAX_DIMS:
                    raise ValueError(f"a mesh has at most {MAX_DIMS} dimensions")
                PySlice_Unpack(o, &start, &stop, &step)
                length = PySlice_AdjustIndices(self._sizes[dim], &start, &stop, step)
                r._sizes[out] = length
                r._strides[out] = self._strides[dim] * step
                if length > 0:
                    offset += start * self._strides[dim]
                names_buf[out] = PyTuple_GET_ITEM(names, dim)
                kept |= (<unsigned long long>1) << dim
                out += 1
                dim += 1
            elif o is None:
                if out >= MAX_DIMS:
                    raise ValueError(f"a mesh has at most {MAX_DIMS} dimensions")
                r._sizes[out] = 1
                r._strides[out] = 0
                names_buf[out] = NULL
                out += 1
            else:  # Ellipsis
                for k in range(self._ndim - consumed):
                    if out >= MAX_DIMS:
                        raise ValueError(f"a mesh has at most {MAX_DIMS} dimensions")
                    r._sizes[out] = self._sizes[dim]
                    r._strides[out] = self._strides[dim]
                    names_buf[out] = PyTuple_GET_ITEM(names, dim)
                    kept |= (<unsigned long long>1) << dim
                    out += 1
                    dim += 1
        while dim < self._ndim:
            if out >= MAX_DIMS:
                raise ValueError(f"a mesh has at most {MAX_DIMS} dimensions")
            r._sizes[out] = self._sizes[dim]
            r._strides[out] = self._strides[dim]
            names_buf[out] = PyTuple_GET_ITEM(names, dim)
            kept |= (<unsigned long long>1) << dim
            out += 1
            dim += 1
        r._ndim = out
        r._offset = offset
        r._base = self._base
        r._bptr = self._bptr
        r._finish()
        if nint == 0 and nnew == 0 and out == self._ndim:
            r._names = names
        elif nnew == 0:
            # one-entry cache: indexing the same dims away again (mesh[i] in a
            # loop) reuses the names tuple instead of building a new one
            if self._names_cache is not None and self._names_cache_mask == kept:
                r._names = self._names_cache
            else:
                r._names = _names_tuple(names_buf, out)
                self._names_cache = r._names
                self._names_cache_mask = kept
        else:
            used = set()
            for k in range(out):
                if names_buf[k] != NULL:
                    used.add(<object>names_buf[k])
            lst = []
            for k in range(out):
                if names_buf[k] != NULL:
                    lst.append(<object>names_buf[k])
                else:
                    nm = _fresh_name(k, used)
                    used.add(nm)
                    lst.append(nm)
            r._names = tuple(lst)
        return r

    cdef Shape _general(self, object idx):
        # Classify every item, check it as NumPy does (with our messages), then
        # either go back to the basic path (ints given as np.integer etc.) or
        # gather with NumPy for advanced indices.
        cdef list items, kinds
        cdef int consumed
        items, kinds, consumed = _classify(idx)
        cdef bint advanced = any(k in ("a", "m", "b") for k in kinds)
        if consumed > self._ndim:
            raise _too_many(self._ndim, consumed)
        # bounds (NumPy's messages, with the dim's name) and mask shapes
        cdef int dim = 0, j
        cdef Py_ssize_t sz
        for j in range(len(items)):
            k = kinds[j]
            if k == "e":
                dim += self._ndim - consumed
            elif k == "i" or k == "s":
                if k == "i":
                    v = items[j]
                    sz = self._sizes[dim]
                    if v < -sz or v >= sz:
                        raise _out_of_bounds(v, dim, self._names[dim], sz)
                dim += 1
            elif k == "a":
                dim += 1  # bounds of arrays: NumPy skips them when the gather is empty
            elif k == "m":
                a = items[j]
                for ax in range(a.ndim):
                    if a.shape[ax] != self._sizes[dim + ax]:
                        raise MeshIndexError(
                            f"boolean index did not match indexed mesh along axis {dim + ax} "
                            f"({self._names[dim + ax]!r}); size of axis is {self._sizes[dim + ax]} but "
                            f"size of corresponding boolean axis is {a.shape[ax]}")
                dim += a.ndim
        if not advanced:
            t = tuple(items)
            return self._basic(PySequence_Fast_ITEMS(t), len(items))
        # One 1-d array (or 1-d mask) among basic items: its dim stays in place
        # and keeps its name, so it is a basic view with that dim gathered.
        cdef int n_adv = 0, which = -1
        for j in range(len(kinds)):
            k = kinds[j]
            if k == "a" or k == "m":
                n_adv += 1
                which = j
            elif k == "i" or k == "b":
                n_adv += 2
        if n_adv == 1 and items[which].ndim == 1:
            return self._one_array(items, kinds, which, consumed)
        return self._advanced(items, kinds, consumed)

    cdef Shape _one_array(self, list items, list kinds, int which, int consumed):
        a = items[which]
        pos = _np.flatnonzero(a) if kinds[which] == "m" else a
        cdef int p = 0, j, dim = 0
        for j in range(which):
            k = kinds[j]
            if k == "s" or k == "n":
                p += 1
            elif k == "e":
                p += self._ndim - consumed
            if k == "s" or k == "i":
                dim += 1
            elif k == "e":
                dim += self._ndim - consumed
            elif k == "m":
                dim += items[j].ndim
        items2 = list(items)
        items2[which] = _FULL
        t = tuple(items2)
        cdef Shape v = self._basic(PySequence_Fast_ITEMS(t), len(items2))
        cdef Py_ssize_t size = v._sizes[p]
        pos = _np.array(pos, dtype=_np.int64, copy=True)   # ours to normalise in place
        cdef int64_t* pv = <int64_t*>cnp.PyArray_DATA(pos)
        cdef Py_ssize_t n = pos.shape[0], q, step
        for q in range(n):
            if pv[q] < 0:
                pv[q] += size
            if pv[q] < 0 or pv[q] >= size:
                raise _out_of_bounds(int(a[q]) if kinds[which] == "a" else pv[q], dim, self._names[dim], size)
        cdef bint progression = True
        step = pv[1] - pv[0] if n > 1 else 1
        for q in range(2, n):
            if pv[q] - pv[q - 1] != step:
                progression = False
                break
        if progression:
            if n:
                v._offset += pv[0] * v._strides[p]
            v._strides[p] *= step
            v._sizes[p] = n
            v._sizes_t = None
            v._finish()
            return v
        # not a progression: gather in C straight into the new rank list
        v._sizes[p] = n
        v._sizes_t = None
        v._finish()
        cdef cnp.npy_intp total = v._size
        out = cnp.PyArray_EMPTY(1, &total, cnp.NPY_INT64, 0)
        if total:
            _fill_gather(v._ndim, v._sizes, v._strides, v._offset, v._bptr, p, pv,
                         <int64_t*>cnp.PyArray_DATA(out))
        return _from_ranks(v._names, list(v.sizes), out, True)

    cdef _array_bounds(self, list items, list kinds, int consumed):
        # Raise our message (with the dim's name) for an out-of-range index array.
        cdef int dim = 0, j
        cdef Py_ssize_t sz
        for j in range(len(items)):
            k = kinds[j]
            if k == "e":
                dim += self._ndim - consumed
            elif k == "i" or k == "s":
                dim += 1
            elif k == "m":
                dim += items[j].ndim
            elif k == "a":
                a = items[j]
                sz = self._sizes[dim]
                if a.size:
                    bad = a[(a >= sz) | (a < -sz)]
                    if bad.size:
                        raise _out_of_bounds(int(bad.flat[0]), dim, self._names[dim], sz)
                dim += 1

    cdef Shape _advanced(self, list items, list kinds, int consumed):
        arr = self.ranks().reshape(self.sizes)
        try:
            res = arr[tuple(items)]
        except IndexError as e:
            self._array_bounds(items, kinds, consumed)
            raise MeshIndexError(str(e).strip()) from None
        # Where does the broadcast block go?  NumPy: at the first advanced
        # index if all advanced indices (ints included) are adjacent, else first.
        cdef int consec = 0  # 0 none yet, 1 in run, 2 run ended, 3 separated
        cdef int dim = 0, nbasic_before = 0, j, ax
        basic_names = []      # (name or None) per basic result dim, in order
        src = []              # dims consumed by arrays/masks
        cdef int insert_at = -1
        for j in range(len(items)):
            k = kinds[j]
            if k in ("i", "a", "m", "b"):
                if consec == 0:
                    consec = 1
                    insert_at = len(basic_names)
                elif consec == 2:
                    consec = 3
                if k == "a":
                    src.append(self._names[dim])
                    dim += 1
                elif k == "m":
                    for ax in range(items[j].ndim):
                        src.append(self._names[dim + ax])
                    dim += items[j].ndim
                elif k == "i":
                    dim += 1
            else:
                if consec == 1:
                    consec = 2
                if k == "s":
                    basic_names.append(self._names[dim]); dim += 1
                elif k == "n":
                    basic_names.append(None)
                elif k == "e":
                    for ax in range(self._ndim - consumed):
                        basic_names.append(self._names[dim]); dim += 1
        while dim < self._ndim:
            basic_names.append(self._names[dim]); dim += 1
        if consec == 3:
            insert_at = 0
        nb = res.ndim - len(basic_names)
        base = "_".join(src)
        if nb <= 0:
            made = []
        elif nb == 1:
            made = [base if base else None]
        elif base:
            made = [f"{base}_{q}" for q in range(nb)]
        else:
            made = [None] * nb
        out = basic_names[:insert_at] + [("m", m) for m in made] + basic_names[insert_at:]
        used = {n for n in basic_names if n is not None}
        names = []
        for p, n in enumerate(out):
            if isinstance(n, tuple):
                n = n[1]
                if n is not None:
                    n = _unique(n, used)
                else:
                    n = _fresh_name(p, used)
                used.add(n)
            elif n is None:
                n = _fresh_name(p, used)
                used.add(n)
            names.append(n)
        if len(names) > MAX_DIMS:
            raise ValueError(f"a mesh has at most {MAX_DIMS} dimensions")
        return _from_ranks(tuple(names), list(res.shape),
                           _np.ascontiguousarray(res.reshape(-1), dtype=_np.int64))

    # ------------------------------------------------------------------ reshaping

    def rename(self, **old_to_new):
        """Rename dimensions: ``s.rename(procs="gpus")``.

        Examples
        --------
        >>> Shape(hosts=2, procs=4).rename(procs="gpus").names
        ('hosts', 'gpus')
        """
        for old in old_to_new:
            if old not in self._names:
                raise DimensionError(old, self._names)
        names = tuple([old_to_new.get(n, n) for n in self._names])
        _check_names(names, self._ndim)
        cdef Shape r = self._copy()
        r._names = names
        return r

    cdef Shape _copy(self):
        cdef Shape r = Shape.__new__(Shape)
        r._ndim = self._ndim
        r._size = self._size
        r._offset = self._offset
        r._names = self._names
        r._base = self._base
        r._bptr = self._bptr
        r._sizes_t = self._sizes_t
        cdef int d
        for d in range(self._ndim):
            r._sizes[d] = self._sizes[d]
            r._strides[d] = self._strides[d]
        return r

    def flatten(self, name):
        """One dimension ``name`` over all the view's ranks, in row-major order.

        Works on any view: a strided result when the ranks allow, else an
        explicit rank list.

        Examples
        --------
        >>> Shape(hosts=2, procs=4)[:, ::2].flatten("all").ranks().tolist()
        [0, 2, 4, 6]
        """
        if not isinstance(name, str):
            raise TypeError(f"dimension name must be a str, not {type(name).__name__}")
        cdef Shape r = Shape.__new__(Shape)
        r._names = (name,)
        r._ndim = 1
        r._sizes[0] = self._size
        r._size = self._size
        r._base = self._base
        r._bptr = self._bptr
        # Collapse in base index space: drop size-1 dims, merge nested neighbours.
        cdef Py_ssize_t stride = 0
        cdef int d
        cdef bint ok = True
        cdef Py_ssize_t last_size = 1
        for d in range(self._ndim - 1, -1, -1):
            if self._sizes[d] == 1:
                continue
            if last_size == 1:
                stride = self._strides[d]
                last_size = self._sizes[d]
            elif self._strides[d] == stride * last_size:
                last_size *= self._sizes[d]
            else:
                ok = False
                break
        if self._size == 0:
            r._offset = 0
            r._strides[0] = 1
            r._base = None
            r._bptr = NULL
            return r
        if ok:
            r._offset = self._offset
            r._strides[0] = stride if self._size > 1 else 1
            return r
        return _from_ranks((name,), [self._size], self.ranks())

    def split(self, **spec):
        """Split dimensions into several, Monarch-style.

        ``s.split(hosts=("dp", "pp"), pp=2)``: each dim given with a tuple of new
        names is split row-major into those dims; sizes of the new dims are
        given as keywords, and at most one size per split may be left out (it
        is inferred).

        Examples
        --------
        >>> Shape(hosts=2, gpus=8).split(gpus=("tp", "dp"), tp=2)
        Shape{hosts=2, tp=2, dp=4}
        """
        splits = {}
        constraints = {}
        for k, v in spec.items():
            if isinstance(v, (tuple, list)):
                if k not in self._names:
                    raise DimensionError(k, self._names)
                if not v:
                    raise ValueError(f"dimension {k!r} cannot be split into no dimensions")
                for nm in v:
                    if not isinstance(nm, str):
                        raise TypeError(f"new dimension names must be str, not {type(nm).__name__}")
                splits[k] = tuple(v)
            elif _is_int_like(v):
                constraints[k] = _operator.index(v)
                if constraints[k] < 0:
                    raise ValueError(f"size of {k!r} must be non-negative, got {constraints[k]}")
            else:
                raise TypeError(
                    f"split() takes dim=(new names...) or name=size keywords; got {k}={v!r}")
        new_names = []
        new_sizes = []
        new_strides = []
        used_constraints = set()
        cdef int d
        for d in range(self._ndim):
            nm = self._names[d]
            if nm not in splits:
                new_names.append(nm); new_sizes.append(self._sizes[d]); new_strides.append(self._strides[d])
                continue
            parts = splits[nm]
            known = 1
            unknown = [p for p in parts if p not in constraints]
            for p in parts:
                if p in constraints:
                    known *= constraints[p]
                    used_constraints.add(p)
            if len(unknown) > 1:
                raise ValueError(
                    f"cannot infer the sizes of {tuple(unknown)} when splitting {nm!r}: give all but one")
            total = self._sizes[d]
            if unknown:
                if known == 0 or total % known:
                    raise ValueError(
                        f"dimension {nm!r} of size {total} cannot be split evenly by {known}")
                sizes_p = [constraints.get(p, total // known) for p in parts]
            else:
                if known != total:
                    raise ValueError(
                        f"dimension {nm!r} has size {total} but the sizes of {parts} multiply to {known}")
                sizes_p = [constraints[p] for p in parts]
            stride = self._strides[d]
            strides_p = [0] * len(parts)
            for q in range(len(parts) - 1, -1, -1):
                strides_p[q] = stride
                stride *= sizes_p[q]
            new_names.extend(parts); new_sizes.extend(sizes_p); new_strides.extend(strides_p)
        unused = [k for k in constraints if k not in used_constraints]
        if unused:
            raise ValueError(f"sizes given for {tuple(unused)}, which no split creates")
        names = tuple(new_names)
        _check_names(names, len(names))
        if len(names) > MAX_DIMS:
            raise ValueError(f"a mesh has at most {MAX_DIMS} dimensions")
        cdef Shape r = Shape.__new__(Shape)
        r._names = names
        r._ndim = len(names)
        r._offset = self._offset
        r._base = self._base
        r._bptr = self._bptr
        for d in range(r._ndim):
            r._sizes[d] = new_sizes[d]
            r._strides[d] = new_strides[d]
        r._finish()
        return r

    def transpose(self, *dims):
        """Reorder dimensions, by name or axis; no arguments reverses them (as NumPy).

        Examples
        --------
        >>> Shape(hosts=2, procs=4).transpose("procs", "hosts").ranks().tolist()
        [0, 4, 1, 5, 2, 6, 3, 7]
        """
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        cdef int d
        if not dims:
            perm = list(range(self._ndim - 1, -1, -1))
        else:
            if len(dims) != self._ndim:
                raise ValueError(
                    f"axes don't match mesh: transpose needs all {self._ndim} dimensions "
                    f"{self._names}, got {dims}")
            perm = [self._axis(x) for x in dims]
            if len(set(perm)) != len(perm):
                raise ValueError(f"repeated axis in transpose: {dims}")
        cdef Shape r = Shape.__new__(Shape)
        r._ndim = self._ndim
        r._size = self._size
        r._offset = self._offset
        r._base = self._base
        r._bptr = self._bptr
        for d in range(self._ndim):
            r._sizes[d] = self._sizes[perm[d]]
            r._strides[d] = self._strides[perm[d]]
        r._names = tuple([self._names[p] for p in perm])
        return r

    cpdef int _axis(self, object dim) except -1:
        """Axis number of a dim given by name or (possibly negative) axis."""
        if isinstance(dim, str):
            try:
                return self._names.index(dim)
            except ValueError:
                raise DimensionError(dim, self._names) from None
        if _is_int_like(dim):
            ax = _operator.index(dim)
            if ax < -self._ndim or ax >= self._ndim:
                raise DimensionError(ax, self._names)
            return ax % self._ndim if self._ndim else 0
        raise TypeError(f"a dimension is a name (str) or an axis (int), not {type(dim).__name__}")

    # ------------------------------------------------------------------ identity

    cdef bint _is_dense(self):
        if self._base is not None or self._offset != 0:
            return False
        cdef Py_ssize_t stride = 1
        cdef int d
        for d in range(self._ndim - 1, -1, -1):
            if self._sizes[d] != 1 and self._strides[d] != stride:
                return False
            stride *= self._sizes[d]
        return True

    def __repr__(self):
        dims = ", ".join([f"{self._names[d]}={self._sizes[d]}" for d in range(self._ndim)])
        if self._is_dense():
            extra = ""
        elif self._base is None:
            extra = f"offset={self._offset}, strides={self.strides}" if self._ndim else f"offset={self._offset}"
        else:
            rk = self.ranks()
            shown = ", ".join(map(str, rk[:16].tolist()))
            if rk.shape[0] > 16:
                shown += ", ..."
            extra = f"ranks=[{shown}]"
        if extra and dims:
            return f"Shape{{{dims}; {extra}}}"
        return f"Shape{{{dims or extra}}}"

    def __eq__(self, other):
        if not isinstance(other, Shape):
            return NotImplemented
        cdef Shape o = <Shape>other
        if self is o:
            return True
        if self._ndim != o._ndim or self._names != o._names:
            return False
        cdef int d
        for d in range(self._ndim):
            if self._sizes[d] != o._sizes[d]:
                return False
        if self._size == 0:
            return True
        if self._base is None and o._base is None:
            if self._offset != o._offset:
                return False
            for d in range(self._ndim):
                if self._sizes[d] > 1 and self._strides[d] != o._strides[d]:
                    return False
            return True
        return bool(_np.array_equal(self.ranks(), o.ranks()))

    def __ne__(self, other):
        eq = self.__eq__(other)
        if eq is NotImplemented:
            return eq
        return not eq

    def __hash__(self):
        # Equal Shapes have equal names, sizes and ranks, whatever their layout;
        # hashing the first and last rank keeps this O(ndim) for both layouts.
        if self._hash == 0:
            h = hash((self._names, self.sizes,
                      self.rank(0) if self._size else -1,
                      self.rank(self._size - 1) if self._size else -1))
            self._hash = h if h != 0 else 1
        return self._hash

    def __reduce__(self):
        if self._base is None:
            return (_restore_shape, (self._names, self.sizes, self._offset, self.strides, None))
        return (_restore_shape, (self._names, self.sizes, 0, None, self.ranks()))

    cdef _check_nonnegative(self):
        if self._size == 0:
            return
        cdef Py_ssize_t lo = self._offset
        cdef int d
        for d in range(self._ndim):
            if self._strides[d] < 0:
                lo += self._strides[d] * (self._sizes[d] - 1)
        if lo < 0:
            raise ValueError(f"view reaches negative rank {lo}; global ranks are non-negative")


# ---------------------------------------------------------------------- helpers

def _restore_shape(names, sizes, offset, strides, ranks):
    # unpickling (a staticmethod cannot be pickled by reference)
    if ranks is None:
        return Shape.from_view(names, offset, sizes, strides)
    return Shape.from_ranks(names, sizes, ranks)


cdef tuple _names_tuple(PyObject** buf, int n):
    cdef tuple t = PyTuple_New(n)
    cdef int k
    for k in range(n):
        Py_INCREF(<object>buf[k])
        PyTuple_SET_ITEM(t, k, <object>buf[k])
    return t


cdef _check_names(tuple names, int n):
    if n > MAX_DIMS:
        raise ValueError(f"a mesh has at most {MAX_DIMS} dimensions, got {n}")
    for nm in names:
        if not isinstance(nm, str):
            raise TypeError(f"dimension names must be str, not {type(nm).__name__} {nm!r}")
        if not nm:
            raise ValueError("dimension names must be non-empty")
    if len(set(names)) != n:
        dup = sorted({x for x in names if names.count(x) > 1})
        raise ValueError(f"duplicate dimension names {tuple(dup)} in {names}")


cdef Py_ssize_t _check_size(object size, object name) except -1:
    if not _is_int_like(size):
        raise TypeError(f"size of dimension {name!r} must be an int, not {type(size).__name__}")
    cdef object v = _operator.index(size)
    if v < 0:
        raise ValueError(f"size of dimension {name!r} must be non-negative, got {v}")
    return v


cdef Shape _from_ranks(tuple names, list sizes, object arr, bint owned=False):
    # ``arr``: contiguous int64, len == prod(sizes), non-negative.  Strided
    # when the ranks are, else explicit over a read-only copy.
    cdef int n = len(names), d
    cdef Shape s = Shape.__new__(Shape)
    s._names = names
    s._ndim = n
    for d in range(n):
        s._sizes[d] = sizes[d]
    s._finish()
    cdef Py_ssize_t total = s._size, step = 1
    cdef const int64_t* p = <const int64_t*>cnp.PyArray_DATA(arr)
    # candidate strides from unit steps along each dim
    for d in range(n - 1, -1, -1):
        if total and s._sizes[d] > 1:
            s._strides[d] = p[step] - p[0]
        else:
            s._strides[d] = (s._strides[d + 1] * s._sizes[d + 1]) if d + 1 < n and s._sizes[d + 1] else 1
        step *= s._sizes[d] if s._sizes[d] else 1
    s._offset = p[0] if total else 0
    s._base = None
    s._bptr = NULL
    if total == 0 or _matches(s, p):
        return s
    # explicit: a row-major contiguous view over its own copy
    base = arr if owned else _np.array(arr, dtype=_np.int64, copy=True)
    base.flags.writeable = False
    s._base = base
    s._bptr = <const int64_t*>cnp.PyArray_DATA(base)
    s._offset = 0
    step = 1
    for d in range(n - 1, -1, -1):
        s._strides[d] = step
        step *= s._sizes[d]
    return s


cdef bint _matches(Shape s, const int64_t* p) noexcept:
    cdef Py_ssize_t k = 0, cur = s._offset
    cdef Py_ssize_t idx[MAX_DIMS]
    cdef int n = s._ndim, d
    cdef Py_ssize_t j, inner_n, inner_s
    if n == 0:
        return p[0] == cur
    for d in range(n):
        idx[d] = 0
    inner_n = s._sizes[n - 1]
    inner_s = s._strides[n - 1]
    while True:
        for j in range(inner_n):
            if p[k + j] != cur + j * inner_s:
                return False
        k += inner_n
        d = n - 2
        while d >= 0:
            idx[d] += 1
            cur += s._strides[d]
            if idx[d] < s._sizes[d]:
                break
            cur -= s._strides[d] * s._sizes[d]
            idx[d] = 0
            d -= 1
        if d < 0:
            return True


cdef void _fill(int ndim, const Py_ssize_t* sizes_in, const Py_ssize_t* strides_in,
                Py_ssize_t offset, const int64_t* base, int64_t* out) noexcept nogil:
    # Row-major walk of a (nonempty) strided view; writes ranks (or base[pos]).
    cdef Py_ssize_t sizes[MAX_DIMS]
    cdef Py_ssize_t strides[MAX_DIMS]
    cdef Py_ssize_t idx[MAX_DIMS]
    cdef int n = 0, d
    # coalesce: drop size-1 dims, merge nested neighbours so the inner loop is long
    for d in range(ndim):
        if sizes_in[d] == 1:
            continue
        if n > 0 and strides[n - 1] == strides_in[d] * sizes_in[d]:
            sizes[n - 1] *= sizes_in[d]
            strides[n - 1] = strides_in[d]
            continue
        sizes[n] = sizes_in[d]
        strides[n] = strides_in[d]
        n += 1
    if n == 0:
        out[0] = base[offset] if base != NULL else offset
        return
    cdef Py_ssize_t k = 0, cur = offset, j
    cdef Py_ssize_t inner_n = sizes[n - 1], inner_s = strides[n - 1]
    for d in range(n):
        idx[d] = 0
    while True:
        if base == NULL:
            if inner_s == 1:
                for j in range(inner_n):
                    out[k + j] = cur + j
            else:
                for j in range(inner_n):
                    out[k + j] = cur + j * inner_s
        else:
            for j in range(inner_n):
                out[k + j] = base[cur + j * inner_s]
        k += inner_n
        d = n - 2
        while d >= 0:
            idx[d] += 1
            cur += strides[d]
            if idx[d] < sizes[d]:
                break
            cur -= strides[d] * sizes[d]
            idx[d] = 0
            d -= 1
        if d < 0:
            return


cdef void _fill_gather(int ndim, const Py_ssize_t* sizes, const Py_ssize_t* strides,
                       Py_ssize_t offset, const int64_t* base, int p, const int64_t* pos,
                       int64_t* out) noexcept nogil:
    # Like _fill, but dim ``p`` (size == len(pos)) visits positions ``pos``
    # instead of 0..size-1: the rank list of ``view[..., pos, ...]``.
    cdef Py_ssize_t idx[MAX_DIMS]
    cdef Py_ssize_t cur = offset + pos[0] * strides[p], k = 0, total = 1, j
    cdef int d
    for d in range(ndim):
        idx[d] = 0
        total *= sizes[d]
    for k in range(total):
        out[k] = base[cur] if base != NULL else cur
        d = ndim - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < sizes[d]:
                if d == p:
                    cur += (pos[idx[d]] - pos[idx[d] - 1]) * strides[d]
                else:
                    cur += strides[d]
                break
            if d == p:
                cur -= (pos[sizes[d] - 1] - pos[0]) * strides[d]
            else:
                cur -= strides[d] * (sizes[d] - 1)
            idx[d] = 0
            d -= 1


# ---------------------------------------------------------------------- functions

cdef dict _extent_of(object s):
    if isinstance(s, Shape):
        return (<Shape>s).extent
    if isinstance(s, _Mapping):
        out = {}
        for k, v in s.items():
            if not isinstance(k, str):
                raise TypeError(f"dimension names must be str, not {type(k).__name__} {k!r}")
            out[k] = _check_size(v, k)
        return out
    ms = getattr(s, "_mesh_shape", None)
    if isinstance(ms, Shape):
        return (<Shape>ms).extent
    raise TypeError(f"expected a Shape or a mapping of dimension names to sizes, not {type(s).__name__}")


def broadcast_shapes(*shapes):
    """Broadcast mesh shapes **by name**; returns a dict name -> size.

    Dims are ordered by first appearance; a dim missing from a shape, or of
    size 1, broadcasts; otherwise sizes must be equal.

    Parameters
    ----------
    *shapes : Shape or mapping of str to int

    Raises
    ------
    MeshShapeError
        When two shapes have different sizes (neither 1) for one name.

    Examples
    --------
    >>> broadcast_shapes({"hosts": 2}, Shape(hosts=1, procs=4))
    {'hosts': 2, 'procs': 4}
    """
    result = {}
    first = {}   # name -> the extent that set result[name]
    for s in shapes:
        ext = _extent_of(s)
        for k, v in ext.items():
            cur = result.get(k)
            if cur is None or cur == 1:
                if cur is None or v != 1:
                    result[k] = v
                    first[k] = ext
            elif v != 1 and v != cur:
                a = "{" + ", ".join(f"{n}={z}" for n, z in first[k].items()) + "}"
                b = "{" + ", ".join(f"{n}={z}" for n, z in ext.items()) + "}"
                raise MeshShapeError(
                    f"shapes {a} and {b} do not broadcast: dimension {k!r} has sizes {cur} and {v}")
    return result


def reduction_plan(Shape shape, dims):
    """The groups of ranks that a reduction of ``shape`` over ``dims`` combines.

    Parameters
    ----------
    shape : Shape
    dims : str, int, or tuple of them
        Dimensions to reduce over, by name or axis.

    Returns
    -------
    groups : ndarray of int64, shape (G, M)
        One row per rank of ``result``; members in row-major order of the
        reduced dims (in ``shape``'s dim order).  ``groups[g, 0]`` is the root.
    result : Shape
        ``shape`` without ``dims``; ``result.rank(g) == groups[g, 0]``.

    Examples
    --------
    >>> groups, result = reduction_plan(Shape(hosts=2, procs=3), "procs")
    >>> groups.tolist(), result.names, result.ranks().tolist()
    ([[0, 1, 2], [3, 4, 5]], ('hosts',), [0, 3])
    """
    if isinstance(dims, (tuple, list)):
        axes = [shape._axis(x) for x in dims]
    else:
        axes = [shape._axis(dims)]
    if len(set(axes)) != len(axes):
        raise ValueError(f"duplicate dimension in reduction dims {tuple(dims)}")
    axes = sorted(axes)
    sizes = shape.sizes
    for ax in axes:
        if sizes[ax] == 0:
            raise ValueError(
                f"cannot reduce over dimension {shape.names[ax]!r} of size 0: its groups have no root")
    keep = [d for d in range(shape.ndim) if d not in axes]
    arr = shape.ranks().reshape(sizes)
    moved = _np.transpose(arr, keep + axes)
    cdef Py_ssize_t m = 1
    for ax in axes:
        m *= sizes[ax]
    groups = _np.ascontiguousarray(moved.reshape(-1, m) if m else moved.reshape(-1, 0))
    idx = tuple([0 if d in axes else slice(None) for d in range(shape.ndim)])
    return groups, shape[idx]
