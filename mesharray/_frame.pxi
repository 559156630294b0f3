# _frame: see _core.pyx
#
# The fixed header of every frame of the wire protocol (transport/framing.py).
#
# 24 bytes, little-endian, no padding:
#
#   offset size field
#   0      2    magic   0x4D41 ("MA")
#   2      1    kind    message kind (runtime/protocol.py); 0 is invalid
#   3      1    flags   per-kind bits
#   4      4    length  number of payload bytes that follow the header
#   8      8    msg_id  call id / correlation id
#   16     4    target  actor id (calls) or status (replies)
#   20     4    view    id of the mesh view a call was sent to (0: none)
#
# The codec is pure: it packs and parses, and checks the magic and the length
# against a caller-given limit *before* the caller allocates anything for the
# payload. Policy (what a kind means, what to do on a bad frame) is Python's.

from libc.string cimport memcpy
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

FRAME_HEADER_SIZE = 24
FRAME_MAGIC = 0x4D41

cdef packed struct _FrameHeader:
    uint16_t magic
    uint8_t kind
    uint8_t flags
    uint32_t length
    uint64_t msg_id
    uint32_t target
    uint32_t view


def pack_header(unsigned int kind, unsigned int flags, unsigned long long length,
                unsigned long long msg_id=0, unsigned long long target=0,
                unsigned long long view=0):
    """Pack a frame header into 24 bytes.

    >>> from mesharray._core import pack_header, unpack_header
    >>> unpack_header(pack_header(1, 0, 5, 7, 2, 3), 1 << 20)
    (1, 0, 5, 7, 2, 3)
    """
    cdef _FrameHeader h
    if kind == 0 or kind > 255:
        raise ValueError(f"frame kind must be in 1..255, got {kind}")
    if flags > 255:
        raise ValueError(f"frame flags must be in 0..255, got {flags}")
    if length > 0xFFFFFFFF:
        raise ValueError(f"frame length must be below 4 GiB, got {length}")
    if target > 0xFFFFFFFF or view > 0xFFFFFFFF:
        raise ValueError(f"frame target/view must fit in 32 bits, got {target}/{view}")
    h.magic = FRAME_MAGIC
    h.kind = <uint8_t>kind
    h.flags = <uint8_t>flags
    h.length = <uint32_t>length
    h.msg_id = <uint64_t>msg_id
    h.target = <uint32_t>target
    h.view = <uint32_t>view
    return (<char*>&h)[:24]


def unpack_header(const unsigned char[::1] data not None, unsigned long long limit,
                  Py_ssize_t offset=0):
    """Parse the 24-byte header at ``data[offset:]``.

    Returns ``(kind, flags, length, msg_id, target, view)``. Raises ``ValueError``
    when fewer than 24 bytes are given, the magic is wrong, the kind is 0, or the
    length exceeds ``limit`` (checked before anyone allocates the payload).
    """
    cdef _FrameHeader h
    if offset < 0 or data.shape[0] - offset < 24:
        raise ValueError(f"frame header needs 24 bytes, got {max(0, data.shape[0] - offset)}")
    memcpy(&h, &data[offset], 24)
    if h.magic != FRAME_MAGIC:
        raise ValueError(f"bad frame magic 0x{h.magic:04x}; expected 0x{FRAME_MAGIC:04x}")
    if h.kind == 0:
        raise ValueError("bad frame kind 0")
    if h.length > limit:
        raise ValueError(f"frame length {h.length} exceeds the limit of {limit} bytes")
    return (h.kind, h.flags, h.length, h.msg_id, h.target, h.view)
