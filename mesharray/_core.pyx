# cython: language_level=3
# cython: boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, embedsignature=True, binding=False
"""mesharray._core — the compiled core.

Pure, synchronous, allocation-light algebra and kernels: no I/O, no event loop,
no policy. Everything with I/O is Python. Each part lives in its own include
file so that the parts can be read (and owned) separately:

- ``_shape.pxi``   : ``Shape`` (named, strided views over global ranks), NumPy
                     indexing, ``broadcast_shapes``, ``reduction_plan``.
- ``_frame.pxi``   : the fixed frame header of the wire protocol.
- ``_kernels.pxi`` : nogil reduction kernels over contiguous numeric buffers.
"""

include "_shape.pxi"
include "_frame.pxi"
include "_kernels.pxi"
