"""Linux cross-memory attach: one copy straight between two processes' address spaces.

``process_vm_readv`` / ``process_vm_writev`` copy between this process and
another of the same user and PID namespace without a shared segment and
without the other process's code running. The process whose memory is read
allows it with :func:`allow_attach` (``PR_SET_PTRACER_ANY``, needed where
Yama restricts ptrace to descendants). ``Buffer`` and the moves of
distributed arrays use it between processes of one host.

:func:`transfer` raises :class:`CmaDenied` where the kernel (or the
platform) refuses, so that callers can fall back to a stream.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from ..errors import ActorDiedError, MeshArrayError

__all__ = ["CmaDenied", "allow_attach", "transfer"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


try:  # (the symbols of the process: no find_library, which runs ldconfig in a subprocess at import)
    _libc = ctypes.CDLL(None, use_errno=True)
except (OSError, TypeError):  # pragma: no cover - a platform without dlopen(NULL)
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_vm_readv = getattr(_libc, "process_vm_readv", None)
_vm_writev = getattr(_libc, "process_vm_writev", None)
for _fn in (_vm_readv, _vm_writev):
    if _fn is not None:
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                        ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_allowed = False


class CmaDenied(Exception):
    """Cross-memory attach is not allowed between these processes: use a stream instead."""


def allow_attach() -> None:
    """Let any process of this user read and write this process's memory (once; a no-op off Linux)."""
    global _allowed
    if _allowed:
        return
    _allowed = True
    try:
        _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        pass


def transfer(write: bool, pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` between address ``local`` here and ``remote`` in process ``pid``.

    ``write`` copies local → remote, else remote → local. Raises
    :class:`CmaDenied` when not allowed, :class:`~mesharray.ActorDiedError`
    when ``pid`` is gone.
    """
    fn = _vm_writev if write else _vm_readv
    if fn is None:
        raise CmaDenied("process_vm_readv is not available on this platform")
    done = 0
    while done < nbytes:
        liov = _IoVec(local + done, nbytes - done)
        riov = _IoVec(remote + done, nbytes - done)
        n = fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                raise CmaDenied(os.strerror(err))
            if err == errno.ESRCH:
                raise ActorDiedError(pid=pid, reason="the process owning the buffer is gone")
            if err == errno.EFAULT:
                raise MeshArrayError(f"buffer memory in process {pid} is no longer mapped (was it dropped?)")
            raise OSError(err, f"process_vm_{'writev' if write else 'readv'}: {os.strerror(err)}")
        if n == 0:
            raise MeshArrayError(f"cross-memory transfer with process {pid} made no progress")
        done += n
