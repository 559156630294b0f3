"""Kubernetes: host agents as the pods of an Indexed Job (or a JobSet), found through the API.

Two halves, both below :mod:`mesharray.proc` (the facade :mod:`mesharray.k8s`
makes ``HostMesh`` objects of what is found here):

- **Manifests** (no dependency): :func:`manifest` builds the objects of one
  mesh — a Secret holding the agents' secret (unless an existing one is
  named), a headless Service, and an Indexed Job with ``parallelism =
  completions = hosts`` (or a JobSet wrapping that Job) whose pods each run
  ``python -m mesharray host`` on a fixed port. The pod's IP (downward API,
  ``status.podIP``) is where the agent listens and what it advertises; its
  completion index (``JOB_COMPLETION_INDEX``) names the host
  (``--host-id NAME-INDEX``). :func:`dump_yaml` prints them for ``kubectl
  apply -f -``; ``python -m mesharray k8s manifest`` is :func:`main`.
- **Discovery** (the official ``kubernetes`` client, imported only here and
  only when called): :func:`wait_for_hosts` lists and watches the pods labelled
  ``mesharray/mesh=NAME`` until one Ready pod serves every index ``0 ..
  hosts-1`` and returns them ordered by index; :func:`create_objects` /
  :func:`delete_objects` create and remove a manifest's objects;
  :class:`PodWatcher` reports pods that fail or go away while attached.

Pods are plain JSON-like dicts everywhere (``raw_object`` of watch events,
lists read without the client's models), so the rules (:func:`pod_index`,
:func:`pod_ready`, :func:`pick_hosts`) are pure functions testable on dicts.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import math
import os
import re
import secrets as _secrets
import sys
import threading
import time
from typing import Any, Callable, Generator, Iterable, Mapping, Sequence

from ..errors import BootstrapError
from .agent import DEFAULT_PORT

__all__ = ["manifest", "dump_yaml", "parse_resources", "load_api", "wait_for_hosts", "pick_hosts", "PodHost",
           "PodWatcher", "create_objects", "delete_objects", "read_secret", "pod_index", "pod_ready", "main",
           "MESH_LABEL", "INDEX_KEY", "INSTALL_HINT", "JOBSET_API"]

log = logging.getLogger("mesharray.k8s")

#: label every object and pod of a mesh carries (its value: the mesh's name)
MESH_LABEL = "mesharray/mesh"
#: annotations of the pods: how many hosts the mesh has, how many processes a host is meant for
HOSTS_ANNOTATION = "mesharray/hosts"
PROCS_ANNOTATION = "mesharray/procs-per-host"
#: the Job controller's annotation (and label, since Kubernetes 1.28) of an Indexed Job's pod
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
SECRET_KEY = "secret"
CONTAINER = "host"
PORT_NAME = "mesharray"
JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
INSTALL_HINT = "pip install 'mesharray[k8s]'"

#: short names of accelerators for --resources (any "vendor.domain/name" is taken as given)
RESOURCE_ALIASES = {
    "gpu": "nvidia.com/gpu", "nvidia": "nvidia.com/gpu", "nvidia-gpu": "nvidia.com/gpu",
    "amd": "amd.com/gpu", "amd-gpu": "amd.com/gpu", "rocm": "amd.com/gpu",
    "tpu": "google.com/tpu",
}
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([eE][0-9]+|[numkKMGTPE]|[KMGTPE]i)?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
#: longest mesh name: pod hostnames are NAME-INDEX (Job) or NAME-hosts-0-INDEX (JobSet), 63 characters at most
MAX_NAME = 40


# --------------------------------------------------------------------------- manifests


def parse_resources(spec: str | Mapping[str, Any] | Sequence[str] | None) -> dict[str, str]:
    """``"gpu=8,memory=64Gi"`` (or a mapping, or several such strings) → resource limits.

    Short names: ``gpu``/``nvidia`` → ``nvidia.com/gpu``, ``amd``/``amd-gpu``/``rocm`` →
    ``amd.com/gpu``, ``tpu`` → ``google.com/tpu``; ``cpu``, ``memory`` and any
    qualified name (``example.com/fpga``) are taken as given.

    Examples
    --------
    >>> parse_resources("gpu=8,memory=64Gi")
    {'nvidia.com/gpu': '8', 'memory': '64Gi'}
    >>> parse_resources(["tpu=4", "cpu=500m"])
    {'google.com/tpu': '4', 'cpu': '500m'}
    >>> parse_resources("gpu=eight")
    Traceback (most recent call last):
    ...
    ValueError: resource 'gpu' has a bad quantity 'eight': expected a Kubernetes quantity such as 8, 500m or 64Gi
    """
    if spec is None:
        return {}
    items: list[tuple[str, Any]] = []
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        parts = [spec] if isinstance(spec, str) else list(spec)
        for part in parts:
            if not isinstance(part, str):
                raise TypeError(f"resources must be 'name=quantity' strings or a mapping, got {type(part).__name__}")
            for item in filter(None, (p.strip() for p in part.split(","))):
                name, eq, value = item.partition("=")
                if not eq:
                    raise ValueError(f"bad resource {item!r}: expected name=quantity, such as gpu=8")
                items.append((name.strip(), value.strip()))
    out: dict[str, str] = {}
    for name, value in items:
        full = RESOURCE_ALIASES.get(name, name)
        if not _QUALIFIED.match(full):
            raise ValueError(f"bad resource name {name!r}")
        text = str(value)
        if isinstance(value, bool) or not _QUANTITY.match(text):
            raise ValueError(f"resource {name!r} has a bad quantity {text!r}: expected a Kubernetes quantity "
                             f"such as 8, 500m or 64Gi")
        out[full] = text
    return out


def _check_name(name: str, hosts: int) -> None:
    if not isinstance(name, str):
        raise TypeError(f"mesh name must be a str, got {type(name).__name__}")
    if not _DNS1035.match(name) or len(name) > MAX_NAME:
        raise ValueError(f"bad mesh name {name!r}: lower-case letters, digits and '-', starting with a letter, "
                         f"at most {MAX_NAME} characters (it names the Job, the Service and the pods' hostnames)")
    if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
        raise ValueError(f"hosts must be an int >= 1, got {hosts!r}")


def manifest(name: str, hosts: int, image: str, *, procs_per_host: int = 8, namespace: str = "default",
             jobset: bool = False, resources: str | Mapping[str, Any] | Sequence[str] | None = None,
             secret_name: str | None = None, secret: str | None = None, port: int = DEFAULT_PORT,
             node_selector: Mapping[str, str] | None = None, service_account: str | None = None,
             python: str = "python", image_pull_policy: str | None = None) -> list[dict]:
    """The Kubernetes objects of a mesh of ``hosts`` pods, each running a host agent.

    Parameters
    ----------
    name : str
        The mesh's name: names the Job (or JobSet), the headless Service, the
        Secret (``NAME-secret``) and labels everything ``mesharray/mesh=NAME``.
    hosts : int
        Pods (hosts of the mesh): ``parallelism = completions = hosts``.
    image : str
        A container image with Python and mesharray installed (``python -m mesharray`` runs in it).
    procs_per_host : int
        Processes a host is meant for (annotation ``mesharray/procs-per-host``; the
        default of ``hosts.spawn_procs()`` after ``ma.k8s.attach``).
    namespace : str
    jobset : bool
        A JobSet (``jobset.x-k8s.io/v1alpha2``; it makes its own headless
        Service) instead of a Job and a Service.
    resources : str or mapping, optional
        Container limits, e.g. ``"gpu=8"`` (see :func:`parse_resources`).
    secret_name : str, optional
        An existing Secret with the agents' secret under the key ``secret``; without
        it the manifest defines ``NAME-secret`` holding ``secret`` (default: 32 random bytes, hex).
    port : int
        The agents' fixed port.
    node_selector : mapping, optional
        ``spec.nodeSelector`` of the pods (e.g. a TPU topology or a GPU product).
    service_account : str, optional
    python : str
        The interpreter in the image.
    image_pull_policy : str, optional

    Returns
    -------
    list of dict
        Secret (unless ``secret_name``), Service (unless ``jobset``), Job or JobSet.

    Examples
    --------
    >>> objs = manifest("train", 2, "python:3.12")
    >>> [o["kind"] for o in objs]
    ['Secret', 'Service', 'Job']
    >>> job = objs[-1]["spec"]
    >>> job["completionMode"], job["completions"], job["parallelism"]
    ('Indexed', 2, 2)
    >>> [o["kind"] for o in manifest("train", 2, "python:3.12", jobset=True, secret_name="s")]
    ['JobSet']
    """
    _check_name(name, hosts)
    if not isinstance(image, str) or not image:
        raise ValueError("image must name a container image with mesharray installed")
    if not isinstance(procs_per_host, int) or isinstance(procs_per_host, bool) or procs_per_host < 1:
        raise ValueError(f"procs_per_host must be an int >= 1, got {procs_per_host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    limits = parse_resources(resources)
    labels = {MESH_LABEL: name}
    meta = {"name": name, "namespace": namespace, "labels": dict(labels)}
    objs: list[dict] = []
    sname = secret_name or f"{name}-secret"
    if secret_name is None:
        value = secret if secret is not None else _secrets.token_hex(32)
        objs.append({"apiVersion": "v1", "kind": "Secret",
                     "metadata": {**meta, "name": sname, "labels": dict(labels)},
                     "type": "Opaque", "stringData": {SECRET_KEY: value}})
    listen = f"tcp://$(POD_IP):{port}"
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": [python, "-m", "mesharray", "host"],
        # $(VAR) is expanded by the kubelet from the container's env
        "args": ["--listen", listen, "--advertise", listen, "--host-id", "$(MESHARRAY_MESH)-$(JOB_COMPLETION_INDEX)"],
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # the Job controller adds it too; named here so the pod spec says where --host-id comes from
            {"name": "JOB_COMPLETION_INDEX",
             "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}},
            {"name": "MESHARRAY_MESH", "value": name},
            {"name": "MESHARRAY_PROCS_PER_HOST", "value": str(procs_per_host)},
            {"name": "MESHARRAY_SECRET", "valueFrom": {"secretKeyRef": {"name": sname, "key": SECRET_KEY}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
    }
    if limits:
        container["resources"] = {"limits": limits}
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    pod_spec: dict[str, Any] = {
        # an agent that exits is a lost host: the Job replaces the pod (a new, empty host)
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 15,
        "containers": [container],
    }
    if not jobset:
        pod_spec["subdomain"] = name  # NAME-INDEX.NAME.NAMESPACE.svc through the headless Service
    if node_selector:
        pod_spec["nodeSelector"] = {str(k): str(v) for k, v in node_selector.items()}
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    template = {"metadata": {"labels": dict(labels),
                             "annotations": {HOSTS_ANNOTATION: str(hosts), PROCS_ANNOTATION: str(procs_per_host)}},
                "spec": pod_spec}
    job_spec = {
        "completionMode": "Indexed",
        "completions": hosts,
        "parallelism": hosts,
        # losing a few pods does not end the others (a mesh keeps working without its dead ranks)
        "backoffLimit": max(6, 2 * hosts),
        "template": template,
    }
    if jobset:
        objs.append({"apiVersion": f"{JOBSET_API[0]}/{JOBSET_API[1]}", "kind": "JobSet", "metadata": meta,
                     "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                              "replicatedJobs": [{"name": "hosts", "replicas": 1,
                                                  "template": {"metadata": {"labels": dict(labels)},
                                                               "spec": job_spec}}]}})
    else:
        objs.append({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                     "spec": {"clusterIP": "None", "selector": dict(labels), "publishNotReadyAddresses": True,
                              "ports": [{"name": PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}]}})
        objs.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec})
    return objs


_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_KEYWORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} in a manifest")
        return repr(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _KEYWORDS:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def _emit(value: Any, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, Mapping):
        for k, v in value.items():
            key = _scalar(str(k))
            if isinstance(v, (Mapping, list, tuple)) and v:
                out.append(f"{pad}{key}:")
                _emit(v, indent + (0 if isinstance(v, (list, tuple)) else 2), out)
            else:
                out.append(f"{pad}{key}: {_inline(v)}")
    else:
        for item in value:
            if isinstance(item, (Mapping, list, tuple)) and item:
                sub: list[str] = []
                _emit(item, indent + 2, sub)
                out.append(f"{pad}- {sub[0][indent + 2:]}")
                out.extend(sub[1:])
            else:
                out.append(f"{pad}- {_inline(item)}")


def _inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _scalar(value)


def dump_yaml(objs: Iterable[Mapping[str, Any]]) -> str:
    """The objects as a multi-document YAML stream (block style; strings quoted where YAML would misread them).

    Examples
    --------
    >>> print(dump_yaml([{"a": "1", "b": [{"c": True, "d": []}], "e": "x y"}]), end="")
    ---
    a: "1"
    b:
    - c: true
      d: []
    e: "x y"
    """
    out: list[str] = []
    for obj in objs:
        out.append("---")
        _emit(obj, 0, out)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the API client


def load_api(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ``ApiClient`` of the official client: in-cluster config inside a pod, else the kubeconfig.

    Never touches the client's global default configuration. Raises ``ImportError``
    naming ``pip install 'mesharray[k8s]'`` when the client is not installed.
    """
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ImportError(f"mesharray's Kubernetes support needs the official client: {INSTALL_HINT}") from exc
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    # KUBECONFIG read now, not when the client was imported (its default is fixed at import)
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    try:
        return config.new_client_from_config(config_file=path, context=context, persist_config=False)
    except config.ConfigException as exc:
        raise BootstrapError(f"no Kubernetes configuration: not in a pod, and no usable kubeconfig "
                             f"({exc}); set KUBECONFIG or pass kubeconfig=") from exc


def close_api(api: Any) -> None:
    """Close an ``ApiClient``'s connections to the API server.

    Its pool keeps idle connections open until the client is collected, and a
    client kept alive by a traceback (an error raised through it) keeps them
    open as long as that; whoever made the client closes it.
    """
    # each pool closes its idle connections, and those still out close when they come back; the pool
    # manager's clear() (all that the client's own close does to them) only forgets the pools, whose
    # connections then stay open as long as anything holds a pool: an answer in a traceback does
    pools = getattr(getattr(getattr(api, "rest_client", None), "pool_manager", None), "pools", None)
    try:
        if pools is not None:
            for key in list(pools.keys()):
                pool = pools.get(key)
                if pool is not None:
                    pool.close()
    finally:
        api.close()


def _body(raw: Any) -> bytes:
    """The body of a raw answer (``_preload_content=False``), read to its end; its connection goes back to the pool.

    An answer nobody reads holds its connection, open, until it is collected:
    in a reference cycle (a traceback), perhaps after the socket's own
    finalizer, which then warns of an unclosed socket.
    """
    data = raw.data
    release = getattr(raw, "release_conn", None)
    if release is not None:
        release()
    return data


def _api_error(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    try:
        msg = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        msg = None
    status = getattr(exc, "status", None)
    return f"{status} {msg or getattr(exc, 'reason', '') or exc}".strip()


def create_objects(api: Any, objs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """Create ``objs`` (Secret, Service, Job, JobSet) in order; returns ``(kind, namespace, name)`` of each.

    All or nothing: when one fails, those already created are deleted and a
    :class:`BootstrapError` names the object and the API's answer.
    """
    from kubernetes import client

    # answers are not read into the client's models (_preload_content=False): nothing here needs them,
    # and a model stricter than a server's answer would fail a request that succeeded
    # Any: plain dicts go in (the client accepts them), raw answers come out
    core: Any = client.CoreV1Api(api)
    batch: Any = client.BatchV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    made: list[tuple[str, str, str]] = []
    for obj in objs:
        kind, ns, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        try:
            if kind == "Secret":
                _body(core.create_namespaced_secret(ns, obj, _preload_content=False))
            elif kind == "Service":
                _body(core.create_namespaced_service(ns, obj, _preload_content=False))
            elif kind == "Job":
                _body(batch.create_namespaced_job(ns, obj, _preload_content=False))
            elif kind == "JobSet":
                _body(custom.create_namespaced_custom_object(JOBSET_API[0], JOBSET_API[1], ns, JOBSET_API[2],
                                                                obj, _preload_content=False))
            else:
                raise ValueError(f"cannot create a {kind}")
        except client.ApiException as exc:
            delete_objects(api, made)
            raise BootstrapError(f"could not create {kind} {ns}/{name}: {_api_error(exc)}") from exc
        made.append((kind, ns, name))
    return made


def delete_objects(api: Any, made: Sequence[tuple[str, str, str]]) -> None:
    """Delete what :func:`create_objects` made, the Job (or JobSet) first; its pods go with it (background GC)."""
    from kubernetes import client

    # Any: plain dicts go in (the client accepts them), raw answers come out
    core: Any = client.CoreV1Api(api)
    batch: Any = client.BatchV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    body = {"propagationPolicy": "Background"}
    for kind, ns, name in reversed(list(made)):
        try:
            if kind == "Secret":
                _body(core.delete_namespaced_secret(name, ns, _preload_content=False))
            elif kind == "Service":
                _body(core.delete_namespaced_service(name, ns, _preload_content=False))
            elif kind == "Job":
                _body(batch.delete_namespaced_job(name, ns, body=body, _preload_content=False))
            elif kind == "JobSet":
                _body(custom.delete_namespaced_custom_object(JOBSET_API[0], JOBSET_API[1], ns, JOBSET_API[2],
                                                                name, body=body, _preload_content=False))
        except client.ApiException as exc:
            if exc.status != 404:
                log.warning("could not delete %s %s/%s: %s", kind, ns, name, _api_error(exc))


def read_secret(api: Any, namespace: str, name: str, key: str = SECRET_KEY) -> bytes:
    """The value under ``key`` of the Secret ``namespace/name``."""
    from kubernetes import client

    try:
        core: Any = client.CoreV1Api(api)
        raw = core.read_namespaced_secret(name, namespace, _preload_content=False)
    except client.ApiException as exc:
        raise BootstrapError(f"could not read the agents' secret from Secret {namespace}/{name}: "
                             f"{_api_error(exc)} (or set MESHARRAY_SECRET)") from exc
    data = json.loads(_body(raw)).get("data") or {}
    if key not in data:
        raise BootstrapError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(data[key])


# --------------------------------------------------------------------------- discovery


class PodHost:
    """One Ready pod serving one index of a mesh."""

    __slots__ = ("index", "name", "uid", "ip", "port", "hosts", "procs_per_host", "secret_ref")

    def __init__(self, index: int, name: str, uid: str, ip: str, port: int, hosts: int | None,
                 procs_per_host: int | None, secret_ref: tuple[str, str] | None) -> None:
        self.index = index
        self.name = name
        self.uid = uid
        self.ip = ip
        self.port = port
        self.hosts = hosts
        self.procs_per_host = procs_per_host
        self.secret_ref = secret_ref

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
    data = json.loads(_body(raw))
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
                                 f"{_api_error(exc)}") from exc
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
                raise BootstrapError(f"could not watch the pods of mesh {name!r}: {_api_error(exc)}") from exc
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


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str]) -> int:
    """``python -m mesharray k8s manifest --name NAME --hosts N --image IMAGE [...]``: print the YAML."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mesharray k8s",
                                 description="Kubernetes: print the manifest of a mesh of host agents "
                                             "(`... | kubectl apply -f -` launches it).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="print the YAML of a mesh: Secret, headless Service and Indexed Job "
                                        "(or a JobSet)")
    m.add_argument("--name", required=True, help="the mesh's name (Job, Service, label mesharray/mesh=NAME)")
    m.add_argument("--hosts", required=True, type=int, help="pods, one host agent each")
    m.add_argument("--image", required=True, help="container image with Python and mesharray installed")
    m.add_argument("--procs-per-host", type=int, default=8, help="processes per host (default 8)")
    m.add_argument("--namespace", default="default")
    m.add_argument("--jobset", action="store_true", help="a JobSet (jobset.x-k8s.io/v1alpha2) instead of a Job")
    m.add_argument("--resources", action="append", default=None, metavar="NAME=QTY[,...]",
                   help="container limits: gpu=8 (nvidia.com/gpu), amd=8 (amd.com/gpu), tpu=4 (google.com/tpu), "
                        "cpu=, memory=, or any vendor.com/name=")
    m.add_argument("--secret-name", default=None,
                   help="an existing Secret with the agents' secret under the key 'secret' (default: the "
                        "manifest defines NAME-secret with a random one)")
    m.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the agents' port (default {DEFAULT_PORT})")
    m.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
    m.add_argument("--service-account", default=None)
    m.add_argument("--python", default="python", help="the interpreter in the image (default python)")
    args = ap.parse_args(list(argv))
    selector = {}
    for item in args.node_selector:
        k, eq, v = item.partition("=")
        if not eq:
            ap.error(f"--node-selector {item!r}: expected KEY=VALUE")
        selector[k] = v
    try:
        objs = manifest(args.name, args.hosts, args.image, procs_per_host=args.procs_per_host,
                        namespace=args.namespace, jobset=args.jobset, resources=args.resources,
                        secret_name=args.secret_name, port=args.port, node_selector=selector,
                        service_account=args.service_account, python=args.python)
    except (ValueError, TypeError) as exc:
        print(f"mesharray k8s manifest: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_yaml(objs))
    return 0
