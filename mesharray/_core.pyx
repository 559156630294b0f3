# cython: language_level=3
# cython: boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, embedsignature=True, binding=False
"""mesharray._core — the compiled core.

Pure, synchronous, allocation-light algebra and kernels, and the per-message
dispatch of the runtime's hot paths: no I/O, no event loop, no policy.
Everything with I/O is Python or the transport's own extension (``_serve.pxi``
writes a reply through the function the worker hands it, ``Connection.write_frame``).
Each part lives in its own include file so that the parts can be read (and owned)
separately:

- ``_shape.pxi``   : ``Shape`` (named, strided views over global ranks), NumPy
                     indexing, ``broadcast_shapes``, ``reduction_plan``.
- ``_frame.pxi``   : the fixed frame header of the wire protocol, and the
                     frame loop of a read (each frame to the caller's handler).
- ``_kernels.pxi`` : nogil reduction kernels over contiguous numeric buffers.
- ``_rounds.pxi``  : ``HostRounds``, a shared-memory group's host rounds with their
                     state in C fields (the base of ``collectives.shm.ShmCollective``).
- ``_dispatch.pxi``: the signature of an op's arguments (the recipe caches' keys), and an op's
                     tail at the controller (its instruction queued, its result made).
- ``_worker.pxi``  : a rank's common instructions of a distributed-array program.
- ``_rows.pxi``    : ``CallRows``, a process's telemetry rows of calls in C (the recorder's).
- ``_serve.pxi``   : a worker's call path: each frame of its connections routed, a
                     call to a synchronous actor run and answered.
"""

include "_shape.pxi"
include "_frame.pxi"
include "_kernels.pxi"
include "_rounds.pxi"
include "_dispatch.pxi"
include "_worker.pxi"
include "_rows.pxi"
include "_serve.pxi"


# --- public names -------------------------------------------------------------
# Shape, broadcast_shapes and reduction_plan are public as mesharray.<name>: say so
# in their __module__ (repr, help, docs). Pickling is unchanged: a Shape travels
# through _restore_shape (which stays here), the class and the functions by
# reference through mesharray's attributes. A static type's module is read from
# its tp_name, so that is what is renamed (before any Shape is made).
cdef extern from "Python.h":
    ctypedef struct _TypeObject "PyTypeObject":
        const char* tp_name
    void PyType_Modified(_TypeObject*)

(<_TypeObject*>Shape).tp_name = b"mesharray.Shape"
PyType_Modified(<_TypeObject*>Shape)
broadcast_shapes.__module__ = "mesharray"
reduction_plan.__module__ = "mesharray"
