# The signature of an op's arguments: the key of the recipe caches (mesharray.elementwise.signature).
#
# The common cases in C: plain values, MeshArrays over a storage with a layout key, tuples,
# lists and dicts of those. Anything else goes to the Python rule it was given
# (signature_setup), which raises TypeError for what has no signature.

cdef object _sig_stored = None   # the MeshArray base class (mesharray.storage.StoredArray)
cdef object _sig_other = None    # the Python rule for the rest: other(obj, leaves)


def signature_setup(stored, other):
    """Give :func:`signature` the array base class and the Python rule for what it does not know."""
    global _sig_stored, _sig_other
    _sig_stored = stored
    _sig_other = other


def signature(obj, leaves):
    """A hashable signature of an op's argument (``leaves``: None for a ufunc's operands, whose plain
    values count by type only): a MeshArray by its mesh Shape, its storage's layout key and whether
    its blocks require grad (appended to ``leaves``), plain values by type and value, containers
    element by element (:func:`mesharray.elementwise.signature`, which this is)."""
    cdef type t = type(obj)
    if t is float or t is int or t is bool or t is str or obj is None or t is complex:
        return (t, obj) if leaves is not None else (t,)
    if isinstance(obj, _sig_stored):
        st = obj._storage
        lkey = getattr(st, "_lkey", None)  # (kept once known; the property works it out)
        if lkey is None:
            lkey = getattr(st, "lkey", None)
        if lkey is None:
            raise TypeError("no recipe for gathered arrays")
        if leaves is not None:
            leaves.append(obj)
        return (obj._shape, lkey, st.rg)
    if t is tuple or t is list:
        return (t, tuple([signature(x, leaves) for x in obj]))
    if t is dict:
        if not obj:
            return (dict, ())
        return (dict, tuple([(k, signature(v, leaves)) for k, v in (<dict>obj).items()]))
    return _sig_other(obj, leaves)
