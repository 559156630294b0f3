"""What differs between operating systems, in one place (below every layer).

The runtime has two sets of code paths for what only Linux offers:

============================  ==========================  ===============================
                              Linux (native)              elsewhere (portable)
============================  ==========================  ===============================
readiness polling             ``epoll`` (one-shot)        :mod:`selectors` (kqueue, poll)
same-host listener            abstract unix socket        socket file in a 0700 directory
shared-memory segments        ``memfd``, opened by the    ``shm_open`` + unlink, the fd
                              receiver through            passed over a unix socket
                              ``/proc/<pid>/fd``          (``SCM_RIGHTS``)
process state, start time     ``/proc/<pid>/stat``        :mod:`psutil`
collective segments           files in ``/dev/shm``       ``shm_open`` names
worker scheduling class       ``SCHED_BATCH``             the system's default
============================  ==========================  ===============================

``MESHARRAY_PORTABLE=1`` (read once, at import) takes the portable paths on
Linux too, so that the paths macOS needs run in every CI run here
(``make test`` runs the runtime, array and collectives tests a second time
with it). Worker processes inherit it with the environment, so a whole job
uses one set of paths.
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["PORTABLE", "LINUX_NATIVE", "abstract_sockets", "memfd_via_proc", "shm_open", "shm_unlink",
           "anonymous_shm", "runtime_dir", "socket_file", "sweep_socket_files", "worker_sched", "worker_spin",
           "caller_spin", "WORKER_SPIN_DEFAULT_US", "CALLER_SPIN_DEFAULT_US", "sched_batch", "usable_cpus", "cpu_quota"]

#: ``MESHARRAY_PORTABLE`` set (to anything but ``0`` or nothing): the non-Linux paths everywhere
PORTABLE = os.environ.get("MESHARRAY_PORTABLE", "").strip() not in ("", "0")
#: Linux, and the native paths not switched off
LINUX_NATIVE = sys.platform.startswith("linux") and not PORTABLE


def abstract_sockets() -> bool:
    """Whether listeners bind abstract unix sockets (Linux, not portable)."""
    return LINUX_NATIVE


def memfd_via_proc() -> bool:
    """Whether shared memory is a ``memfd`` that peers open through ``/proc/<pid>/fd``."""
    return LINUX_NATIVE and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def worker_sched() -> str:
    """The scheduling class worker processes ask for: ``$MESHARRAY_WORKER_SCHED``, checked.

    ``"batch"`` (the default): ``SCHED_BATCH`` where the system has it (see
    :func:`sched_batch`); ``"normal"``: the system's default class. Anything
    else raises ``ValueError`` naming the value.
    """
    raw = os.environ.get("MESHARRAY_WORKER_SCHED", "")
    value = raw.strip().lower() or "batch"
    if value not in ("batch", "normal"):
        raise ValueError(f"MESHARRAY_WORKER_SCHED must be 'batch' or 'normal', got {raw!r}")
    return value


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity on Linux; all of them elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no sched_getaffinity on macOS)
        return os.cpu_count() or 1


def cpu_quota(proc: str = "/proc/self", cgroup_fs: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time this process's cgroup may use (``cpu.max``, or ``cpu.cfs_quota_us``
    over ``cpu.cfs_period_us`` in cgroup v1; the smallest over its ancestors), ``None`` if unlimited.

    A container's CPU limit (Kubernetes ``resources.limits.cpu``) is such a quota. Linux only;
    anything unreadable or malformed counts as no quota (this never raises). ``proc`` and
    ``cgroup_fs`` name other roots (tests).
    """
    try:
        with open(os.path.join(proc, "cgroup"), errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return None
    found: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, rel = fields
        if not controllers:  # cgroup v2: one hierarchy, cpu.max
            bases = [cgroup_fs]
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            bases = [os.path.join(cgroup_fs, n) for n in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
        else:
            continue
        parts = [p for p in rel.split("/") if p]
        for base in bases:
            # the process's own directory; where the mount shows only a subtree (a container's
            # cgroup namespace, or none but a mount of its own cgroup), the longest tail of the
            # path that exists there, else the mount itself
            d = next((os.path.join(base, *parts[i:]) for i in range(len(parts))
                      if os.path.isdir(os.path.join(base, *parts[i:]))), base)
            while True:
                q = _quota_in(d, not controllers)
                if q is not None:
                    found.append(q)
                if len(d) <= len(base):
                    break
                d = os.path.dirname(d)
    return min(found) if found else None


def _quota_in(d: str, v2: bool) -> float | None:
    try:
        if v2:
            with open(os.path.join(d, "cpu.max")) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
            return None if quota == "max" else int(quota) / int(period)
        with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
            us = int(f.read())
        with open(os.path.join(d, "cpu.cfs_period_us")) as f:
            per = int(f.read())
        return None if us < 0 else us / per
    except (OSError, ValueError, ZeroDivisionError):  # (UnicodeDecodeError is a ValueError)
        return None


#: a worker's read spin when ``MESHARRAY_WORKER_SPIN_US`` is not set (microseconds)
WORKER_SPIN_DEFAULT_US = 100
#: a caller's reply spin when ``MESHARRAY_CALLER_SPIN_US`` is not set (microseconds)
CALLER_SPIN_DEFAULT_US = 50


def worker_spin(raw: str | None = None) -> float:
    """How long a worker's reader polls its socket before blocking (seconds): ``$MESHARRAY_WORKER_SPIN_US``.

    Microseconds, default :data:`WORKER_SPIN_DEFAULT_US`; ``0`` blocks at once. Anything but a finite
    number >= 0 raises ``ValueError`` naming the value. A process that may run on one CPU
    only gets 0 whatever the setting: a message can only come once it gives that CPU up.
    Under a CPU quota (:func:`cpu_quota`: a container's CPU limit) the default is 0: the
    quota counts the polling, and a cgroup that runs out of it stops for the rest of its
    period (100 ms by default); set the variable to poll anyway. ``raw``: a value to check
    instead of the variable's (``""``: the default).
    """
    return _spin_setting("MESHARRAY_WORKER_SPIN_US", WORKER_SPIN_DEFAULT_US, raw)


def caller_spin(raw: str | None = None) -> float:
    """How long a caller waiting for its replies polls for them before blocking (seconds):
    ``$MESHARRAY_CALLER_SPIN_US``, default :data:`CALLER_SPIN_DEFAULT_US`.

    The same rules as :func:`worker_spin` (0 on one CPU, 0 by default under a CPU quota,
    ``ValueError`` for a bad value). Set in the controller by ``proc_mesh``/``attach``
    (:func:`~mesharray.transport.spin.set_reply_spin`).
    """
    return _spin_setting("MESHARRAY_CALLER_SPIN_US", CALLER_SPIN_DEFAULT_US, raw)


def _spin_setting(var: str, default: float, raw: str | None) -> float:
    if raw is None:
        raw = os.environ.get(var, "")
    try:
        value = float(raw) if raw.strip() else float(default)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{var} must be a number of microseconds >= 0, got {raw!r}")
    if usable_cpus() < 2 or (not raw.strip() and cpu_quota() is not None):
        return 0.0
    return value * 1e-6


def sched_batch() -> bool:
    """Put the calling thread, and every thread it starts from now on, in Linux's ``SCHED_BATCH``.

    A thread of that class that wakes up does not preempt the one running
    (no wake-up preemption; its share of the CPU is unchanged): a process
    sending to many workers that share its cores goes on sending instead of
    being switched out at each message. Processes it starts inherit the class
    (Linux's reset-on-fork flag resets only real-time classes). Returns
    whether it was done (not on other systems, nor with
    ``MESHARRAY_PORTABLE``, nor where the system refuses).
    """
    if not LINUX_NATIVE or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    return True


def _posix_name(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"shared-memory name must be a non-empty str without '/', got {name!r}")
    return "/" + name


def shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    """``shm_open(3)``: a file descriptor of the POSIX shared-memory object ``name``.

    ``flags`` are ``os.O_*`` flags. On Linux (native) this is the file
    ``/dev/shm/<name>``, which is what glibc's ``shm_open`` opens too.
    """
    if LINUX_NATIVE and os.path.isdir("/dev/shm"):
        return os.open(f"/dev/shm/{_posix_name(name)[1:]}", flags, mode)
    import _posixshmem  # CPython's own binding (multiprocessing.shared_memory uses it)

    return _posixshmem.shm_open(_posix_name(name), flags, mode)


def shm_unlink(name: str) -> None:
    """``shm_unlink(3)``: remove the name (mappings and open descriptors stay valid)."""
    if LINUX_NATIVE and os.path.isdir("/dev/shm"):
        os.unlink(f"/dev/shm/{_posix_name(name)[1:]}")
        return
    import _posixshmem

    _posixshmem.shm_unlink(_posix_name(name))


def anonymous_shm(tag: str) -> int:
    """A descriptor of fresh shared memory with no name left behind (close-on-exec).

    A ``memfd`` where one exists (even in portable mode: the fd is what is
    passed around, however it was made), else a POSIX object whose name is
    unlinked at once. ``tag`` only names it for debugging (``/proc/<pid>/fd``).
    """
    if hasattr(os, "memfd_create") and not PORTABLE:
        return os.memfd_create(tag, os.MFD_CLOEXEC)
    # macOS limits the name to 31 bytes: keep it short and unique
    name = f"ma{os.getpid() % 100000}-{os.urandom(6).hex()}"
    fd = shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        shm_unlink(name)
    except OSError:
        os.close(fd)
        raise
    os.set_inheritable(fd, False)
    return fd


def runtime_dir() -> str:
    """This user's private directory for socket files (created mode 0700; checked if it exists).

    ``$MESHARRAY_RUNTIME_DIR`` if set, else ``<tempdir>/mesharray-<uid>``.
    Raises ``PermissionError`` if the directory belongs to another user or
    others may enter it: a socket file there must be reachable by this user
    only.
    """
    path = os.environ.get("MESHARRAY_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(), f"mesharray-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"runtime directory {path!r} must be a directory owned by uid {os.getuid()} with "
                              f"mode 0700 (it has uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); remove it or "
                              f"set MESHARRAY_RUNTIME_DIR")
    return path


_swept: int | None = None  # the pid that swept the runtime directory (once per process)


def sweep_socket_files(directory: str) -> int:
    """Remove the socket files (``<kind>-<pid>[-...]``) of processes that no longer exist; how many.

    A killed process cannot remove its socket files (abstract sockets, which
    need no removal, exist on Linux only): the next process to make one
    cleans up after it.
    """
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if len(parts) < 2 or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
        except (PermissionError, OverflowError):
            pass
    return removed


def socket_file(kind: str) -> str:
    """A fresh path for a unix socket of this process in :func:`runtime_dir`: ``<kind>-<pid>-<random>``.

    The first call in a process sweeps the files of dead processes
    (:func:`sweep_socket_files`).
    """
    global _swept
    directory = runtime_dir()
    if _swept != os.getpid():
        _swept = os.getpid()
        sweep_socket_files(directory)
    return os.path.join(directory, f"{kind}-{os.getpid()}-{os.urandom(4).hex()}")
