"""The job model shared by every kind: a specification, an allocation that outlives the script, a job file.

A :class:`Job` is a *specification* (its kind and constructor arguments) and,
once applied, an *allocation*: host agents somewhere (local processes, a
SLURM job, Kubernetes objects, agents started by hand) that serve one
controller at a time and outlive the script that made them. The job file
(:data:`DEFAULT_PATH`, plain JSON, mode 0600: it holds the job's secret;
never unpickled) records the kind, the arguments and the allocation, so a
later process re-attaches (``state(cached_path=...)``, :func:`load`), and
``python -m mesharray job status|kill`` finds it.

A kind implements four hooks: ``_create`` (start or submit; sets ``_id`` and
``_alloc``), ``_wait_urls(deadline)`` (the agents' addresses per mesh once
they listen, waiting for a queue), ``_status`` and ``_kill``; a kind whose
hosts are found another way overrides ``_attach_mesh``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from typing import Any, ClassVar, Iterator

from ..bootstrap.agent import parse_url
from ..errors import BootstrapError
from ..proc import HostMesh, attach
from ..runtime.debugger import announce_in

__all__ = ["Job", "JobState", "JobStatus", "load", "kinds", "DEFAULT_PATH", "FORMAT", "check_meshes", "reachable",
           "job_dir"]

log = logging.getLogger("mesharray.job")

#: where a job file goes unless told otherwise (relative to the working directory)
DEFAULT_PATH = os.path.join(".mesharray", "job.json")
#: the job file's format version
FORMAT = 1
#: states of :class:`JobStatus` in which the allocation is alive
ALIVE = ("pending", "starting", "running")

_RESERVED = frozenset({"detach", "detached", "meshes", "job", "names"})

#: job kind (as a job file names it) -> class; each kind's class registers itself
_KINDS: dict[str, type[Job]] = {}


def kinds() -> dict[str, type[Job]]:
    """Job kind (as a job file names it) -> class."""
    return dict(_KINDS)


def check_meshes(meshes: Any, what: str = "int") -> dict[str, Any]:
    """``meshes`` checked: a non-empty dict of mesh names (identifiers, not ``_``-prefixed) to sizes or lists."""
    if not isinstance(meshes, dict) or not meshes:
        raise TypeError(f"meshes must be a non-empty dict of mesh name to {what}, got {meshes!r}")
    out: dict[str, Any] = {}
    for name, v in meshes.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_") or name in _RESERVED:
            raise ValueError(f"mesh name {name!r} must be a Python identifier, not starting with '_' and not "
                             f"one of {sorted(_RESERVED)} (it is an attribute of the job's state)")
        if what == "int":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"mesh {name!r} must have an int >= 1 of hosts, got {v!r}")
            out[name] = v
        else:
            if isinstance(v, str) or not isinstance(v, (list, tuple)) or not v:
                raise ValueError(f"mesh {name!r} must be a non-empty list of agent addresses, got {v!r}")
            for a in v:
                parse_url(a)
            out[name] = list(v)
    return out


class JobState:
    """The hosts of a job: one :class:`~mesharray.HostMesh` attribute per mesh name (``state.workers``).

    ``detach()`` detaches every mesh (the allocation stays; ``job.kill()`` ends it).
    """

    def __init__(self, job: Job, hosts: dict[str, HostMesh]) -> None:
        self.job = job
        self._hosts = dict(hosts)

    @property
    def meshes(self) -> dict[str, HostMesh]:
        """Mesh name -> :class:`~mesharray.HostMesh`."""
        return dict(self._hosts)

    def __getattr__(self, name: str) -> HostMesh:
        hosts = self.__dict__.get("_hosts", {})
        if name in hosts:
            return hosts[name]
        raise AttributeError(f"the job has no mesh {name!r}; its meshes are {sorted(hosts)}")

    def __getitem__(self, name: str) -> HostMesh:
        try:
            return self._hosts[name]
        except KeyError:
            raise KeyError(f"the job has no mesh {name!r}; its meshes are {sorted(self._hosts)}") from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._hosts))

    @property
    def detached(self) -> bool:
        return any(h.detached for h in self._hosts.values())

    def detach(self) -> None:
        """Detach every mesh: their processes stop, the agents serve the next controller."""
        for h in self._hosts.values():
            h.detach()

    def __enter__(self) -> JobState:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._hosts.items())
        return f"<JobState {self.job.kind} {self.job.id}: {inner}>"


class JobStatus:
    """What the scheduler (or the processes) say of a job's allocation.

    Attributes
    ----------
    kind, id : str
    state : str
        ``pending`` (queued), ``starting`` (allocated, agents not all
        listening yet), ``running``, or ``dead``.
    detail : str
        The scheduler's own state and reason, or what died.
    hosts : list of (host id, address)
    """

    __slots__ = ("kind", "id", "state", "detail", "hosts")

    def __init__(self, kind: str, id: str | None, state: str, detail: str = "",
                 hosts: list[tuple[str, str]] | None = None) -> None:
        self.kind = kind
        self.id = id
        self.state = state
        self.detail = detail
        self.hosts = list(hosts or [])

    @property
    def alive(self) -> bool:
        return self.state in ALIVE

    def __repr__(self) -> str:
        return f"JobStatus({self.kind!r}, {self.id!r}, {self.state!r}, {self.detail!r})"


def job_dir(path: str) -> str:
    """The directory of the job file ``path``, made (mode 0700) when missing: the job's files go beside it."""
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)  # (makedirs' mode is masked by the umask)
    return d


def _write_json(path: str, data: dict) -> None:
    job_dir(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def reachable(url: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at an agent's address (no bytes are sent)."""
    host, port = parse_url(url)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class Job:
    """A job: ``apply()`` starts (or submits) it, ``state()`` attaches to it, ``kill()`` ends it.

    See :mod:`mesharray.job` for the kinds and the job file.
    """

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.kind:
            _KINDS[cls.kind] = cls

    def __init__(self, meshes: dict[str, Any]) -> None:
        self._meshes = meshes
        self._id: str | None = None
        self._secret: str | None = None
        self._alloc: dict[str, Any] = {}
        self._created: float | None = None
        self._state: JobState | None = None
        #: the job file (where ``apply`` wrote it, or ``load`` read it)
        self.path: str | None = None

    # ------------------------------------------------------------------ what a kind implements
    def _args(self) -> dict[str, Any]:
        """The constructor's arguments, as JSON (what ``state(cached_path=...)`` compares)."""
        raise NotImplementedError

    def _create(self) -> None:
        raise NotImplementedError

    def _wait_urls(self, deadline: float | None) -> dict[str, list[str]]:
        raise NotImplementedError

    def _status(self) -> JobStatus:
        raise NotImplementedError

    def _kill(self) -> None:
        raise NotImplementedError

    def _attach_mesh(self, name: str, urls: list[str], timeout: float) -> HostMesh:
        return attach(urls, secret=self._secret, timeout=timeout)

    # ------------------------------------------------------------------ public
    @property
    def id(self) -> str | None:
        """The allocation's id (a SLURM job id, ...); None until applied."""
        return self._id

    @property
    def meshes(self) -> dict[str, Any]:
        """Mesh name -> size (or agent addresses), as given."""
        return dict(self._meshes)

    @property
    def applied(self) -> bool:
        return self._id is not None

    def apply(self) -> None:
        """Start or submit the allocation and write the job file; nothing when this job is applied already.

        The job file is :attr:`path` (``state(cached_path=P)`` sets it; else
        :data:`DEFAULT_PATH`). A file there that names another job still
        alive is never overwritten: :class:`BootstrapError` says how to reuse
        or end it.
        """
        if self._id is not None:
            return
        path = self.path or DEFAULT_PATH
        other = _peek(path)
        if other is not None:
            st = other.status()
            if st.alive:
                raise BootstrapError(
                    f"job file {path} holds the {st.state} {other.kind} job {other.id}; re-attach to it with "
                    f"state(cached_path={path!r}) (same kind and arguments), end it with "
                    f"`python -m mesharray job kill {path}`, or write this job's file elsewhere")
        self.path = path
        self._created = time.time()
        self._create()
        self._save()

    def state(self, cached_path: str | os.PathLike[str] | None = None, timeout: float | None = None) -> JobState:
        """The job's hosts, attached: one :class:`~mesharray.HostMesh` attribute per mesh.

        Parameters
        ----------
        cached_path : path, optional
            A job file. When it holds a job of the same kind and arguments
            whose allocation is alive, re-attach to it (no new allocation).
            Otherwise apply this job and write its file there; a dead cached
            job is reported (one line: what died, when) and replaced, one of
            other arguments is ended first. Without it, the job is applied
            (once) and its file written at :data:`DEFAULT_PATH`.
        timeout : float, optional
            Seconds to wait for a queued allocation and its agents (default:
            as long as the scheduler keeps it queued); past it, a
            :class:`BootstrapError` names the job (which stays queued).

        Raises
        ------
        BootstrapError
            The allocation is gone (a loaded job), not ready in ``timeout``,
            or its agents serve another controller.

        Examples
        --------
        >>> job = ma.job.LocalJob(meshes={"workers": 2})        # doctest: +SKIP
        >>> hosts = job.state(cached_path=".mesharray/job.json").workers   # doctest: +SKIP
        >>> hosts.sizes                                          # doctest: +SKIP
        {'hosts': 2}
        """
        if self._state is not None and not self._state.detached:
            return self._state
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._id is None and cached_path is not None:
            path = os.fspath(cached_path)
            # one process at a time decides whether the file's job serves, and applies a new one:
            # two scripts started together share one allocation
            with _locked(path):
                adopted = self._adopt_cached(path)
                if not adopted:
                    self.path = path
                    self.apply()
            if adopted:
                cached = _snapshot(self)
                try:
                    return self._attach(deadline, reattach=True)
                except _Gone as exc:
                    _report_dead(path, cached, JobStatus(cached.kind, cached.id, "dead", str(exc)))
                    _end_remains(cached)
                    self._id, self._secret, self._alloc = None, None, {}
                    with _locked(path):
                        self.apply()
            return self._attach(deadline)
        if self._id is None:
            self.apply()
        else:
            st = self.status()
            if not st.alive:
                raise BootstrapError(f"the {self.kind} job {self._id} ({self.path}) is {st.state}: {st.detail}; "
                                     f"start a new one with state(cached_path=...) on a new job object")
        return self._attach(deadline)

    def kill(self) -> None:
        """End the allocation (``scancel``, Kubernetes objects deleted, local agents stopped) and remove its job file.

        Detaches first when attached. Killing a job not applied (or already
        killed) does nothing.
        """
        if self._state is not None:
            self._state.detach()
            self._state = None
        if self._id is None:
            return
        self._kill()
        if self.path is not None:
            other = _peek(self.path)
            if other is not None and other.kind == self.kind and other.id == self._id:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
        self._id = None

    def status(self) -> JobStatus:
        """The allocation's state as its scheduler (or its processes) say: see :class:`JobStatus`."""
        if self._id is None:
            return JobStatus(self.kind, None, "dead", "not applied")
        return self._status()

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write the job file to ``path`` (JSON, mode 0600); :func:`load` reads it back."""
        if self._id is None:
            raise ValueError("only an applied job has a job file: call apply() or state() first")
        _write_json(os.fspath(path), self._record())

    # ------------------------------------------------------------------ internals
    def _record(self) -> dict[str, Any]:
        return {"mesharray_job": FORMAT, "kind": self.kind, "args": self._args(), "id": self._id,
                "secret": self._secret, "created": self._created, "allocation": self._alloc}

    def _save(self) -> None:
        if self.path is not None and self._id is not None:
            _write_json(self.path, self._record())

    def _same_spec(self, other: Job) -> bool:
        return other.kind == self.kind and _norm(other._args()) == _norm(self._args())

    def _adopt(self, other: Job) -> None:
        self._id, self._secret, self._alloc = other._id, other._secret, other._alloc
        self._created, self.path = other._created, other.path

    def _adopt_cached(self, path: str) -> bool:
        """Take the allocation of the job at ``path`` when it can serve this spec (True); else clear the way."""
        cached = _peek(path, report=True)
        if cached is None:
            return False
        st = cached.status()
        if not self._same_spec(cached):
            if st.alive:
                log.warning("mesharray: job file %s held the %s %s job %s of other arguments; ending it",
                            path, st.state, cached.kind, cached.id)
                cached.kill()
            return False
        if not st.alive:
            _report_dead(path, cached, st)
            _end_remains(cached)
            return False
        self._adopt(cached)
        return True

    def _attach(self, deadline: float | None, reattach: bool = False) -> JobState:
        urls = self._wait_urls(deadline)
        if reattach:  # agents that do not answer at all: no need to wait for them (an attach retries)
            gone = [u for us in urls.values() for u in us if not reachable(u)]
            if gone:
                raise _Gone(f"its agents at {gone} do not answer")
        left = 30.0 if deadline is None else max(deadline - time.monotonic(), 5.0)
        hosts: dict[str, HostMesh] = {}
        try:
            for name in self._meshes:
                try:
                    hosts[name] = self._attach_mesh(name, urls.get(name, []), min(left, 10.0) if reattach else left)
                except BootstrapError as exc:
                    gone = [u for u in urls.get(name, []) if not reachable(u)]
                    if reattach and gone:
                        raise _Gone(f"its agents at {gone} do not answer") from exc
                    raise
        except BaseException:
            for h in hosts.values():
                h.detach()
            raise
        self._state = JobState(self, hosts)
        if self.path is not None:  # python -m mesharray debug JOBFILE finds this controller's debugger
            announce_in(job_dir(self.path))
        return self._state

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._args().items())
        tail = f" id={self._id}" if self._id else ""
        return f"<{type(self).__name__}({args}){tail}>"


class _Gone(BootstrapError):
    """A cached allocation whose agents no longer answer."""


def _norm(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True))


def _report_dead(path: str, job: Job, st: JobStatus) -> None:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job._created)) if job._created else "?"
    log.warning("mesharray: the %s job %s of %s (started %s) is dead: %s; starting a new one",
                job.kind, job.id, path, when, st.detail or st.state)


def _snapshot(job: Job) -> Job:
    """A copy of ``job``'s allocation as it is now (to report and end it after ``job`` moved on)."""
    other = type(job).__new__(type(job))
    other.__dict__.update(job.__dict__)
    other._alloc = json.loads(json.dumps(job._alloc))
    other._state = None
    return other


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path + ".lock"`` (``flock``; nothing where there is no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    job_dir(path)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def _end_remains(job: Job) -> None:
    """End what is left of a dead job (agents still running, objects still there) before it is replaced."""
    try:
        job._kill()
    except Exception as exc:
        log.warning("mesharray: could not end what is left of the %s job %s: %s", job.kind, job.id, exc)


def _peek(path: str, report: bool = False) -> Job | None:
    """The job at ``path``, or None when there is none (or it is unreadable: then said once when ``report``)."""
    if not os.path.exists(path):
        return None
    try:
        return load(path)
    except (OSError, ValueError) as exc:
        if report:
            log.warning("mesharray: ignoring job file %s: %s", path, exc)
        return None


def load(path: str | os.PathLike[str] = DEFAULT_PATH) -> Job:
    """The job saved at ``path`` (a job file: JSON, never unpickled); ``load(path).state()`` re-attaches.

    Raises
    ------
    FileNotFoundError
        No job file there.
    ValueError
        Not a job file of this version of mesharray (the message says what is wrong).

    Examples
    --------
    >>> job = ma.job.load(".mesharray/job.json")   # doctest: +SKIP
    >>> hosts = job.state().workers                # doctest: +SKIP
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            rec = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path} is not a job file: {exc}") from None
    if not isinstance(rec, dict) or rec.get("mesharray_job") != FORMAT:
        raise ValueError(f"{path} is not a mesharray job file of format {FORMAT}")
    kind = rec.get("kind")
    cls = kinds().get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"{path}: unknown job kind {kind!r}; known kinds are {sorted(kinds())}")
    args = rec.get("args")
    if not isinstance(args, dict):
        raise ValueError(f"{path}: the job's arguments are not a mapping")
    try:
        job = cls(**args)
    except TypeError as exc:
        raise ValueError(f"{path}: arguments of a {kind} job that this version does not take: {exc}") from None
    job._id = None if rec.get("id") is None else str(rec["id"])
    job._secret = rec.get("secret")
    job._alloc = dict(rec.get("allocation") or {})
    job._created = rec.get("created")
    job.path = path
    return job
