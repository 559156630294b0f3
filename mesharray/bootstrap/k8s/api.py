"""The Kubernetes API client: load and close it, create and delete a manifest's objects, read a Secret.

The official ``kubernetes`` client is imported only inside these functions,
and only when they are called: importing mesharray (or printing a manifest)
works without it, and :func:`load_api` raises ``ImportError`` naming
``pip install 'mesharray[k8s]'`` when it is missing. Answers are read raw
(``_preload_content=False``), never into the client's models: nothing here
needs them, and a model stricter than a server's answer would fail a request
that succeeded. Every raw answer is read to its end (:func:`body_of`), so its
connection goes back to the pool.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from typing import Any, Mapping, Sequence

from ...errors import BootstrapError
from .manifests import JOBSET_API, SECRET_KEY

__all__ = ["load_api", "close_api", "create_objects", "delete_objects", "read_secret", "body_of", "api_error",
           "INSTALL_HINT"]

log = logging.getLogger("mesharray.k8s")

INSTALL_HINT = "pip install 'mesharray[k8s]'"


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


def body_of(raw: Any) -> bytes:
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


def api_error(exc: BaseException) -> str:
    """An ``ApiException`` as ``"STATUS message"``: the server's own message, else the reason."""
    body = getattr(exc, "body", None)
    try:
        msg = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        msg = None
    status = getattr(exc, "status", None)
    return f"{status} {msg or getattr(exc, 'reason', '') or exc}".strip()


#: the client's API class of each kind a manifest holds (a JobSet is a custom object of JOBSET_API)
_API_CLASS = {"Secret": "CoreV1Api", "Service": "CoreV1Api", "Job": "BatchV1Api", "JobSet": "CustomObjectsApi"}


def _request(api: Any, verb: str, kind: str, namespace: str, target: Any, **kwargs: Any) -> None:
    """``verb`` (``"create"`` or ``"delete"``) one object of ``kind``; ``target`` is the object to create or the name to delete.

    The client names its calls ``{verb}_namespaced_{kind}`` (``(namespace, body)`` to
    create, ``(name, namespace)`` to delete) and ``{verb}_namespaced_custom_object``
    (group, version, namespace, plural, then the body or the name) for a JobSet.
    """
    from kubernetes import client

    cls = _API_CLASS.get(kind)
    if cls is None:
        raise ValueError(f"cannot {verb} a {kind}")
    # Any: plain dicts go in (the client accepts them), raw answers come out
    group: Any = getattr(client, cls)(api)
    if kind == "JobSet":
        call = getattr(group, f"{verb}_namespaced_custom_object")
        args: tuple = (JOBSET_API[0], JOBSET_API[1], namespace, JOBSET_API[2], target)
    else:
        call = getattr(group, f"{verb}_namespaced_{kind.lower()}")
        args = (namespace, target) if verb == "create" else (target, namespace)
    body_of(call(*args, _preload_content=False, **kwargs))


def create_objects(api: Any, objs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """Create ``objs`` (Secret, Service, Job, JobSet) in order; returns ``(kind, namespace, name)`` of each.

    All or nothing: when one fails, those already created are deleted and a
    :class:`BootstrapError` names the object and the API's answer.
    """
    from kubernetes import client

    made: list[tuple[str, str, str]] = []
    for obj in objs:
        kind, ns, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        try:
            _request(api, "create", kind, ns, obj)
        except client.ApiException as exc:
            delete_objects(api, made)
            raise BootstrapError(f"could not create {kind} {ns}/{name}: {api_error(exc)}") from exc
        made.append((kind, ns, name))
    return made


def delete_objects(api: Any, made: Sequence[tuple[str, str, str]]) -> None:
    """Delete what :func:`create_objects` made, the Job (or JobSet) first; its pods go with it (background GC)."""
    from kubernetes import client

    for kind, ns, name in reversed(list(made)):
        # a Job's pods are its dependents: the garbage collector takes them after it
        extra = {"body": {"propagationPolicy": "Background"}} if kind in ("Job", "JobSet") else {}
        try:
            _request(api, "delete", kind, ns, name, **extra)
        except client.ApiException as exc:
            if exc.status != 404:
                log.warning("could not delete %s %s/%s: %s", kind, ns, name, api_error(exc))


def read_secret(api: Any, namespace: str, name: str, key: str = SECRET_KEY) -> bytes:
    """The value under ``key`` of the Secret ``namespace/name``."""
    from kubernetes import client

    try:
        core: Any = client.CoreV1Api(api)
        raw = core.read_namespaced_secret(name, namespace, _preload_content=False)
    except client.ApiException as exc:
        raise BootstrapError(f"could not read the agents' secret from Secret {namespace}/{name}: "
                             f"{api_error(exc)} (or set MESHARRAY_SECRET)") from exc
    data = json.loads(body_of(raw)).get("data") or {}
    if key not in data:
        raise BootstrapError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(data[key])

