# A rank's common instructions (mesharray.darray.worker.DataActor.run), compiled.
#
# The instructions of a training step that every rank runs most: a recipe's ``call`` turned back
# into the ``apply`` of its function (``expand_calls``), an ``apply`` or an ``ew`` whose operands
# are at hand (``fast_op``), and the frees of torch blocks (``free_blocks``). Each does exactly what
# the Python path of DataActor does, and hands back to it what it does not know (None / False).


def expand_calls(list program, dict calls, dict plans, missing):
    """``DataActor._expand`` for a program without captured steps (no ``def``, ``undef``, ``replay``:
    None then, with nothing done): each ``call`` the ``apply`` of the function its key names
    (``missing(key)`` where none), ``defcall``/``uncall``/``defplan`` kept in ``calls`` and ``plans``."""
    cdef list out = []
    cdef tuple raw
    for item in program:
        code = (<tuple>item)[0]
        if code == "def" or code == "undef" or code == "replay":
            return None
    for item in program:
        raw = <tuple>item
        code = raw[0]
        if code == "call":
            fn = calls.get(raw[2])
            out.append(("apply", raw[1], missing(raw[2]) if fn is None else fn, raw[3]))
        elif code == "defcall":
            calls[raw[1]] = raw[2]
        elif code == "uncall":
            calls.clear()
        elif code == "defplan":
            plans[raw[1]] = raw[2]
        else:
            out.append(raw)
    return out


cdef object _fast_operands(list ops, dict blocks):
    # the operands' values where all are blocks of this rank (made, not failed) or plain values
    cdef list vals = []
    cdef tuple o
    for item in ops:
        o = <tuple>item
        tag = o[0]
        if tag == "b":
            v = blocks.get(o[1], _MISSING_BLOCK)
            if v is _MISSING_BLOCK:
                return None
            vals.append(v)
        elif tag == "v":
            vals.append(o[1])
        else:
            return None
    return vals


cdef object _MISSING_BLOCK = object()


def fast_op(tuple raw, dict blocks, dict engines, dict failed):
    """``("apply", out, fn, operands)`` or ``("ew", out, name, operands, kwargs)`` run where its operands
    are at hand, as ``darray.worker._fast_apply`` / ``_fast_elementwise`` run it. Returns None when
    it is not such a case (nothing done), True when its block is stored, the exception it raised
    (nothing stored: the caller keeps it as the block's failure), or ``(out, value, engine)`` for an
    apply whose value is not a block (the caller converts it)."""
    code = raw[0]
    out = raw[1]
    ops = raw[3]
    if type(ops) is not list or not ops:
        return None
    if code == "apply":
        if (<tuple>ops[0])[0] != "b":
            return None
        vals = _fast_operands(ops, blocks)
        if vals is None:
            return None
        eng = engines.get((<tuple>ops[0])[1])
        if eng is None:
            return None
        try:
            r = raw[2](*vals)
            if not eng.is_block(r):
                return (out, r, eng)
        except BaseException as exc:
            return exc
    elif code == "ew":
        if raw[4]:
            return None
        if (<tuple>ops[0])[0] == "b":
            first = (<tuple>ops[0])[1]
        elif len(ops) >= 2 and (<tuple>ops[1])[0] == "b":
            first = (<tuple>ops[1])[1]
        else:
            return None
        vals = _fast_operands(ops, blocks)
        if vals is None:
            return None
        eng = engines.get(first)
        name = raw[2]
        if eng is None or eng.name == "numpy" or name == "matmul":
            return None
        try:
            r = eng.elementwise(name, *vals)
        except BaseException as exc:
            return exc
    else:
        return None
    blocks[out] = r
    engines[out] = eng
    if failed:
        failed.pop(out, None)
    return True


def free_blocks(store, list bids):
    """``BlockStore.free(bids)`` where no block is a NumPy array (whose memory the store may keep for
    reuse) and none failed; False, with nothing done, otherwise."""
    cdef dict blocks = store.blocks, engines = store.engines, failed = store.failed
    for b in bids:
        if isinstance(blocks.get(b), _np.ndarray) or b in failed:
            return False
    lazy = store.lazy
    for b in bids:
        if lazy:
            lazy.pop(b, None)
        blocks.pop(b, None)
        engines.pop(b, None)
    return True
