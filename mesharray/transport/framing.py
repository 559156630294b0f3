"""Frames and payloads of the wire protocol.

A frame is a 24-byte header packed and parsed by ``mesharray._core``
(``_frame.pxi``: magic, kind, flags, payload length, msg_id, target, view)
followed by ``length`` payload bytes. The length is checked against
:data:`max_frame_size` before anything is allocated for the payload.

The envelope (who, what, which call) lives in the header and in a few
hand-packed bytes; only user values (arguments, results) are pickled, with
pickle protocol 5 and out-of-band buffers. A *pickled payload* is::

    u32 pickle_len | u16 nbufs | u16 0 | nbufs * 36-byte buffer descriptors
    | pickle bytes | inline buffer bytes

A descriptor says where a buffer is: inline (offset into the inline region)
or in a shared-memory segment of the sender (:mod:`.shm`). Buffers below
:data:`SHM_THRESHOLD` bytes, or going to another host, travel inline.

``cloudpickle`` is used only when plain pickle cannot do the job: when it fails,
or when the pickle refers to ``__main__`` (classes and functions defined in the
user's script do not exist under that name in a worker).

CPU ``torch.Tensor`` values travel like NumPy arrays: their bytes are one
out-of-band buffer (so a large tensor goes through shared memory, zero-copy on
the receiving side), rebuilt with ``torch.frombuffer``. Dtype (``bfloat16``
included) and shape are kept; a non-contiguous tensor is sent as a contiguous
copy (the receiver gets contiguous strides). Autograd history is not sent: the
receiver gets a leaf tensor whose ``requires_grad`` is the sender's flag. Other
tensors (GPU, sparse, quantized, subclasses such as ``nn.Parameter``) use
torch's own pickling. torch is never imported for this: the reducer is only
installed when ``torch`` is already in ``sys.modules`` (a process that never
saw a tensor cannot be sending one), and only the receiving process of a
tensor imports it, to rebuild it.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import struct
import sys

from .._core import FRAME_HEADER_SIZE, buffer_address, pack_header, unpack_header
from ..errors import SerializationError
from . import shm

__all__ = [
    "FRAME_HEADER_SIZE",
    "pack_header",
    "unpack_header",
    "max_frame_size",
    "dumps",
    "Payload",
    "encode",
    "decode",
    "SHM_THRESHOLD",
    "encode_one",
    "write_shm",
    "too_large",
]

#: bound on one frame's payload (env ``MESHARRAY_MAX_FRAME``, default 2 GiB): a receiver
#: drops a connection that announces a longer frame, before allocating anything, and a
#: sender refuses to send one (:class:`SerializationError`). Not lower by default: what
#: pickles in band (``bytes``, ``str``, lists...) and every buffer to another host travel
#: inside the frame; the receiver allocates as the bytes arrive, not up front.
max_frame_size = int(os.environ.get("MESHARRAY_MAX_FRAME", 1 << 31))
#: buffers at least this large go through shared memory between same-host processes
SHM_THRESHOLD = 1 << 16

_PREFIX = struct.Struct("<IHH")  # (_core._sv_args reads it too, for a payload without buffers)
_DESC = struct.Struct("<BxHIIQQQ")  # kind, slot, pid, fd, serial, offset, length
_INLINE, _SHM = 0, 1
_EMPTY_PREFIX_CACHE: dict[int, bytes] = {}


class Payload:
    """A value pickled once, ready to be encoded for one or many receivers."""

    __slots__ = ("pickled", "buffers", "big")

    def __init__(self, pickled: bytes, buffers: list) -> None:
        self.pickled = pickled
        self.buffers = buffers
        self.big = sum(memoryview(b).nbytes for b in buffers) >= SHM_THRESHOLD if buffers else False


def _rebuild_tensor(buf, dtype: str, shape: tuple, requires_grad: bool):
    """Receiving side of :func:`_reduce_tensor`: a tensor viewing ``buf`` (no copy when aligned)."""
    import torch

    dt = getattr(torch, dtype)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        itemsize = torch.empty((), dtype=dt).element_size()
        if mv.readonly or _address(mv) % itemsize:
            mv = memoryview(bytearray(mv))  # frombuffer wants writable, aligned memory
        t = torch.frombuffer(mv, dtype=torch.uint8).view(dt).view(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _address(mv: memoryview) -> int:
    return buffer_address(mv)[0]  # (compiled: ndarray.ctypes.data runs Python code)


def _reduce_tensor(t):
    import torch

    if (type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout != torch.strided
            or t.is_quantized or t.is_conj() or t.is_neg()):
        return t.__reduce_ex__(5)
    rg = t.requires_grad
    d = t.detach()
    if not d.is_contiguous():
        d = d.contiguous()
    flat = d.reshape(-1).view(torch.uint8) if d.numel() else torch.empty(0, dtype=torch.uint8)
    dtype = str(d.dtype).rpartition(".")[2]
    return _rebuild_tensor, (pickle.PickleBuffer(flat.numpy()),  # type: ignore[arg-type]  # a buffer (3.12+ stub)
                             dtype, tuple(d.shape), rg)


_tables: dict = {}


def _torch_table():
    """The dispatch table with the tensor reducer, or ``None`` while torch is not loaded."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return None  # not imported (or still importing): there can be no tensor to send
    n = len(copyreg.dispatch_table)
    entry = _tables.get("torch")
    if entry is None or entry[0] != n:  # (re)built after a copyreg.pickle() registration
        t = copyreg.dispatch_table.copy()
        t[torch.Tensor] = _reduce_tensor
        entry = _tables["torch"] = (n, t)
    return entry[1]


def _pickle5(obj, buffers: list) -> bytes:
    table = _torch_table()
    if table is None:
        return pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=5, buffer_callback=buffers.append)
    p.dispatch_table = table
    p.dump(obj)
    return f.getvalue()


def too_large(n: int, limit: int) -> str:
    """The message of a frame over the limit (the sender's :class:`SerializationError`)."""
    return (f"message of {n} bytes is over the frame limit of {limit} bytes (MESHARRAY_MAX_FRAME); "
            f"nothing was sent. Send large data as NumPy arrays, CPU tensors or pickle.PickleBuffer: "
            f"their bytes travel out of band (through shared memory to a peer on this host), not in the frame")


def dumps(obj) -> Payload:
    """Pickle ``obj`` (protocol 5, out-of-band buffers); :class:`SerializationError` if impossible.

    Also when the pickle alone (without its out-of-band buffers) is over
    :data:`max_frame_size`: it could never be sent.
    """
    buffers: list = []
    try:
        first: bytes | None = _pickle5(obj, buffers)
    except Exception:
        first = None
    # (find, not "in": bytes.__contains__ first tries its argument as an int and formats that error)
    if first is not None and first.find(b"__main__") < 0:
        if len(first) > max_frame_size:
            raise SerializationError(too_large(len(first), max_frame_size))
        return Payload(first, buffers)
    buffers = []
    try:
        import cloudpickle

        f = io.BytesIO()
        cp = cloudpickle.CloudPickler(f, protocol=5, buffer_callback=buffers.append)
        if _torch_table() is not None:
            import collections

            cp.dispatch_table = collections.ChainMap({sys.modules["torch"].Tensor: _reduce_tensor},
                                                     cp.dispatch_table)
        cp.dump(obj)
        data = f.getvalue()
    except Exception as exc:
        raise SerializationError(f"cannot pickle {type(obj).__name__} for sending: {exc}") from exc
    if len(data) > max_frame_size:
        raise SerializationError(too_large(len(data), max_frame_size))
    return Payload(data, buffers)


def encode(p: Payload, use_shm: bool = False, seg=None, placed=None, slot: int = 0) -> list:
    """Payload bytes (a list of buffer-like parts) for one receiver.

    ``seg``/``placed``: the buffers already written to a shared-memory segment
    (by the caller, once for all receivers of a message); ``slot`` is this
    receiver's busy byte in it.
    """
    if not p.buffers:
        return [_PREFIX.pack(len(p.pickled), 0, 0), p.pickled]
    descs = []
    if seg is not None:
        pid = shm.pool().pid
        for off, n in placed:
            descs.append(_DESC.pack(_SHM, slot, pid, seg.fd, seg.serial, off, n))
        return [_PREFIX.pack(len(p.pickled), len(descs), 0), *descs, p.pickled]
    inline = []
    off = 0
    for b in p.buffers:
        raw = memoryview(b)
        n = raw.nbytes
        descs.append(_DESC.pack(_INLINE, 0, 0, 0, 0, off, n))
        inline.append(raw.cast("B") if raw.ndim != 1 or raw.format != "B" else raw)
        off += n
    return [_PREFIX.pack(len(p.pickled), len(descs), 0), *descs, p.pickled, *inline]


def encode_one(p: Payload, same_host: bool, dest_pid: int | None = None) -> list:
    """Payload bytes for one receiver: large buffers via shared memory when it is on this host.

    A buffer that lives in a segment ``dest_pid`` sent us goes back as a
    reference to it (no copy); the others are copied into our own segment.
    """
    if not (p.big and same_host and shm.available()):
        return encode(p)
    descs: list = [None] * len(p.buffers)
    copy = []
    for i, b in enumerate(p.buffers):
        ref = shm.back_reference(b, dest_pid) if dest_pid is not None else None
        if ref is None:
            copy.append(i)
        else:
            fd, serial, slot, off, n = ref
            descs[i] = _DESC.pack(_SHM, slot, dest_pid, fd, serial, off, n)
    if copy:
        pool = shm.pool()
        seg, placed = pool.write([p.buffers[i] for i in copy], 1, (dest_pid,))
        for i, (off, n) in zip(copy, placed):
            descs[i] = _DESC.pack(_SHM, 0, pool.pid, seg.fd, seg.serial, off, n)
    return [_PREFIX.pack(len(p.pickled), len(descs), 0), *descs, p.pickled]


def write_shm(p: Payload, nreceivers: int, receivers: tuple = ()):
    """Copy a payload's buffers into shared memory once for ``nreceivers`` (named by ``receivers``)."""
    return shm.pool().write(p.buffers, nreceivers, receivers)


def decode(payload):
    """Unpickle a payload received in a frame (bytes, bytearray or memoryview)."""
    plen, nbufs, _ = _PREFIX.unpack_from(payload, 0)
    if nbufs == 0:
        return pickle.loads(memoryview(payload)[8:8 + plen])
    mv = memoryview(payload)
    base = 8 + nbufs * _DESC.size
    inline_base = base + plen
    bufs = []
    shm_groups: dict = {}
    for i in range(nbufs):
        kind, slot, pid, fd, serial, off, n = _DESC.unpack_from(payload, 8 + i * _DESC.size)
        if kind == _INLINE:
            if inline_base + off + n > len(mv):
                raise ValueError("inline buffer extends past the end of the frame")
            bufs.append(mv[inline_base + off:inline_base + off + n])
        elif kind == _SHM:
            shm_groups.setdefault((pid, fd, serial, slot), []).append((i, off, n))
            bufs.append(None)  # type: ignore[arg-type]  # filled in below, from the segment
        else:
            raise ValueError(f"bad buffer descriptor kind {kind}")
    for (pid, fd, serial, slot), items in shm_groups.items():
        views = shm.attach(pid, fd, serial, slot, [(o, n) for _, o, n in items])
        for (i, _, _), v in zip(items, views):
            bufs[i] = v
    return pickle.loads(mv[base:base + plen], buffers=bufs)
