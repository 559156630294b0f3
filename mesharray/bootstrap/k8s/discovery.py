"""Finding a mesh's pods: the pure rules that choose them, the watch that waits for them, the watch that loses them.

Pods are plain JSON-like dicts everywhere (``raw_object`` of watch events,
lists read without the client's models), so the rules (:func:`pod_index`,
:func:`pod_ready`, :func:`pick_hosts`) are pure functions testable on dicts.
:func:`wait_for_hosts` lists and watches the pods labelled
``mesharray/mesh=NAME`` until one Ready pod serves every index ``0 ..
hosts-1`` and returns them ordered by index; :class:`PodWatcher` reports
pods that fail or go away while attached. The ``kubernetes`` client is
imported only inside those two, when they run.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, Mapping, Sequence

from ...errors import BootstrapError
from ..agent import DEFAULT_PORT
from .api import api_error, body_of
from .manifests import CONTAINER, HOSTS_ANNOTATION, INDEX_KEY, MESH_LABEL, PORT_NAME, PROCS_ANNOTATION, SECRET_KEY

__all__ = ["PodHost", "pod_index", "pod_ready", "pick_hosts", "wait_for_hosts", "PodWatcher"]

log = logging.getLogger("mesharray.k8s")


@dataclass(slots=True)
class PodHost:
    """One Ready pod serving one index of a mesh.

    ``hosts`` and ``procs_per_host`` are the pod's annotations (None when
    absent); ``secret_ref`` is the ``(Secret, key)`` its ``MESHARRAY_SECRET``
    comes from, if it comes from a Secret.
    """

    index: int
    name: str
    uid: str
    ip: str
    port: int
    hosts: int | None
    procs_per_host: int | None
    secret_ref: tuple[str, str] | None

    @property
    def url(self) -> str:
        return f"tcp://[{self.ip}]:{self.port}" if ":" in self.ip else f"tcp://{self.ip}:{self.port}"

    def __repr__(self) -> str:
        return f"PodHost({self.index}, {self.name!r}, {self.url})"


def pod_index(pod: Mapping[str, Any]) -> int | None:
    """The completion index of a Job's pod (label, else annotation), or None.

    >>> pod_index({"metadata": {"annotations": {INDEX_KEY: "3"}}})
    3
    """
    meta = pod.get("metadata") or {}
    for where in ("labels", "annotations"):
        value = (meta.get(where) or {}).get(INDEX_KEY)
        if value is not None and str(value).isdigit():
            return int(value)
    return None


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Running, condition Ready, an IP, and not being deleted."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return next((c for c in containers if c.get("name") == CONTAINER), containers[0])


def _host_of(pod: Mapping[str, Any], index: int) -> PodHost:
    meta, status, c = pod.get("metadata") or {}, pod.get("status") or {}, _container(pod)
    port = next((p.get("containerPort") for p in c.get("ports") or [] if p.get("name") == PORT_NAME), None)
    ref = None
    for e in c.get("env") or []:
        skr = (e.get("valueFrom") or {}).get("secretKeyRef")
        if e.get("name") == "MESHARRAY_SECRET" and skr:
            ref = (str(skr.get("name")), str(skr.get("key") or SECRET_KEY))
    ann = meta.get("annotations") or {}
    return PodHost(index, str(meta.get("name")), str(meta.get("uid", "")), str(status["podIP"]),
                   int(port or DEFAULT_PORT), _int(ann.get(HOSTS_ANNOTATION)), _int(ann.get(PROCS_ANNOTATION)), ref)


def _created(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("creationTimestamp") or "")


def _why_not_ready(pod: Mapping[str, Any]) -> str:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    bits = [f"pod {meta.get('name')} {phase}"]
    if meta.get("deletionTimestamp"):
        bits.append("being deleted")
    for c in status.get("conditions") or []:
        if c.get("status") != "True" and (c.get("reason") or c.get("message")):
            bits.append(f"{c.get('type')}: {c.get('reason') or ''} {c.get('message') or ''}".strip())
    for cs in status.get("containerStatuses") or []:
        for state in ("waiting", "terminated"):
            st = (cs.get("state") or {}).get(state)
            if st:
                bits.append(f"container {state}: {st.get('reason') or ''} {st.get('message') or ''}".strip())
    return ", ".join(bits)


def pick_hosts(pods: Iterable[Mapping[str, Any]], hosts: int | None) -> tuple[list[PodHost] | None, str]:
    """Choose one Ready pod for each index ``0 .. hosts-1``: ``(hosts ordered by index, "")``, or ``(None, why)``.

    Pods may come in any order; a replaced pod (a restart: the Job made a new
    one for its index) loses to the newest Ready pod of that index; pods being
    deleted, failed or finished never serve. ``hosts=None`` takes the mesh's
    size from the pods' ``mesharray/hosts`` annotation. ``why`` names every
    index without a Ready pod and what its pods are doing.
    """
    pods = list(pods)
    if hosts is None:
        sizes = {_int(((p.get("metadata") or {}).get("annotations") or {}).get(HOSTS_ANNOTATION)) for p in pods}
        sizes.discard(None)
        if not sizes:
            return None, "no pod of the mesh yet" if not pods else "its pods carry no mesharray/hosts annotation"
        hosts = max(s for s in sizes if s is not None)
    by_index: dict[int, list[Mapping[str, Any]]] = {}
    for p in pods:
        i = pod_index(p)
        if i is not None:
            by_index.setdefault(i, []).append(p)
    chosen: list[PodHost] = []
    missing: list[str] = []
    for i in range(hosts):
        candidates = sorted(by_index.get(i, []), key=_created)
        ready = [p for p in candidates if pod_ready(p)]
        if ready:
            chosen.append(_host_of(ready[-1], i))
        elif candidates:
            missing.append(f"index {i} ({_why_not_ready(candidates[-1])})")
        else:
            missing.append(f"index {i} (no pod)")
    if missing:
        return None, f"{hosts - len(missing)} of {hosts} hosts ready; not ready: " + "; ".join(missing)
    return chosen, ""


def _list_pods(core: Any, namespace: str, selector: str, timeout: float) -> tuple[list[dict], str]:
    raw = core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False,
                                   _request_timeout=max(timeout, 1.0))
    data = json.loads(body_of(raw))
    return list(data.get("items") or []), str((data.get("metadata") or {}).get("resourceVersion") or "")


def _watch_pods(w: Any, core: Any, namespace: str, selector: str, rv: str, timeout: int,
                request_timeout: float) -> Generator[dict, None, None]:
    """Watch events as plain dicts (``type``, ``object``): no model of the client stands between a server and us.

    Closing this generator (callers do, in a ``finally``) closes the watch's
    answer and its connection at once, not whenever the generator is collected.
    """
    kw = dict(label_selector=selector, resource_version=rv, timeout_seconds=timeout,
              _request_timeout=request_timeout)
    stream = w.stream(core.list_namespaced_pod, namespace, deserialize=False, **kw)
    try:
        try:
            first = next(stream, None)
        except TypeError:  # a client older than Watch.stream(deserialize=)
            stream = w.stream(core.list_namespaced_pod, namespace, **kw)
            first = next(stream, None)
        if first is None:
            return
        for ev in itertools.chain([first], stream):
            yield {"type": ev.get("type"), "object": ev.get("raw_object") or ev.get("object") or {}}
    finally:
        stream.close()  # (the client's generator closes its answer in its own finally)


def wait_for_hosts(api: Any, name: str, namespace: str = "default", hosts: int | None = None,
                   timeout: float = 300.0) -> list[PodHost]:
    """Watch the pods labelled ``mesharray/mesh=NAME`` until every index has a Ready pod; ordered by index.

    A list, then a watch from its resource version (re-listing when the watch
    ends or expires), so no event between the two is missed. Raises
    :class:`BootstrapError` after ``timeout`` naming the indices still missing and why.
    """
    from kubernetes import client, watch

    core = client.CoreV1Api(api)
    selector = f"{MESH_LABEL}={name}"
    deadline = time.monotonic() + timeout
    why = "no pod of the mesh yet"
    while True:
        left = deadline - time.monotonic()
        try:
            items, rv = _list_pods(core, namespace, selector, min(left, 30.0))
        except client.ApiException as exc:
            raise BootstrapError(f"could not list the pods of mesh {name!r} in namespace {namespace!r}: "
                                 f"{api_error(exc)}") from exc
        pods = {p["metadata"]["uid"]: p for p in items}
        found, why = pick_hosts(pods.values(), hosts)
        if found is not None:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            break
        w = watch.Watch()
        events = _watch_pods(w, core, namespace, selector, rv, max(1, min(int(math.ceil(left)), 30)),
                             min(left, 30.0) + 5.0)
        try:
            for ev in events:
                obj = ev["object"]
                uid = (obj.get("metadata") or {}).get("uid")
                if ev.get("type") == "DELETED":
                    pods.pop(uid, None)
                elif uid:
                    pods[uid] = obj
                found, why = pick_hosts(pods.values(), hosts)
                if found is not None:
                    w.stop()
                    return found
                if time.monotonic() >= deadline:
                    break
        except client.ApiException as exc:
            if exc.status != 410:  # 410 Gone: the resource version expired; list again
                raise BootstrapError(f"could not watch the pods of mesh {name!r}: {api_error(exc)}") from exc
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))
        except Exception as exc:  # a dropped watch connection (or an expired one, as some clients report it)
            log.debug("watch of mesh %s ended: %s", name, exc)
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))
        finally:
            w.stop()
            events.close()
        if time.monotonic() >= deadline:
            break
    raise BootstrapError(f"Kubernetes mesh {name!r} in namespace {namespace!r} not ready after {timeout:g} s: {why}")


class PodWatcher:
    """Reports attached pods that fail, finish or go away (watching the mesh's pods until :meth:`stop`).

    ``on_lost(index, reason)`` is called once per index whose pod (by uid) is
    deleted, being deleted, Failed or Succeeded.
    """

    def __init__(self, api: Any, name: str, namespace: str, hosts: Sequence[PodHost],
                 on_lost: Callable[[int, str], None]) -> None:
        self.api = api
        self.name = name
        self.namespace = namespace
        self.uids = {h.uid: h for h in hosts}
        self.on_lost = on_lost
        self.lost: set[int] = set()
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name=f"mesharray-k8s-{name}", daemon=True)
        self._thread.start()

    def _check(self, kind: str, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        h = self.uids.get(str(meta.get("uid")))
        if h is None or h.index in self.lost:
            return
        phase = (pod.get("status") or {}).get("phase")
        if kind == "DELETED" or meta.get("deletionTimestamp"):
            reason = f"pod {h.name} (host {h.index} of mesh {self.name!r}) was deleted"
        elif phase in ("Failed", "Succeeded"):
            reason = f"pod {h.name} (host {h.index} of mesh {self.name!r}) {phase.lower()}: {_why_not_ready(pod)}"
        else:
            return
        self.lost.add(h.index)
        try:
            self.on_lost(h.index, reason)
        except Exception:  # pragma: no cover
            log.exception("pod-lost callback failed")

    def _run(self) -> None:
        from kubernetes import client, watch

        core = client.CoreV1Api(self.api)
        selector = f"{MESH_LABEL}={self.name}"
        while not self._stop.is_set():
            try:
                items, rv = _list_pods(core, self.namespace, selector, 10.0)
                present = {p["metadata"]["uid"] for p in items}
                for uid in list(self.uids):
                    if uid not in present:
                        self._check("DELETED", {"metadata": {"uid": uid}})
                for p in items:
                    self._check("MODIFIED", p)
                self._watch = w = watch.Watch()
                events = _watch_pods(w, core, self.namespace, selector, rv, 5, 15.0)
                try:
                    for ev in events:
                        self._check(str(ev["type"]), ev["object"])
                        if self._stop.is_set():
                            break
                finally:
                    events.close()
            except Exception as exc:
                if not self._stop.is_set():
                    log.debug("pod watch of mesh %s: %s; watching again", self.name, exc)
                    self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()
        self._thread.join(10.0)

