"""``ma.k8s``: a mesh of Kubernetes pods, found (or created) through the Kubernetes API.

Launch from a shell, then attach from the script::

    python -m mesharray k8s manifest --name train --hosts 4 --image IMAGE | kubectl apply -f -

    hosts = ma.k8s.attach("train", namespace="default", hosts=4, timeout=300)
    procs = hosts.spawn_procs()            # {"hosts": 4, "procs": --procs-per-host}

or let the script own the pods: ``hosts = ma.k8s.create("train", hosts=4,
image=IMAGE)`` creates the objects, attaches, and deletes them when the mesh
detaches.

Each pod runs a host agent (``python -m mesharray host``) on its pod IP; see
:mod:`mesharray.bootstrap.k8s.manifests` for the manifest and
:mod:`mesharray.bootstrap.k8s.discovery` for how pods are found.
Importing this module imports nothing of the ``kubernetes`` client; calling
:func:`attach` or :func:`create` without it raises ``ImportError`` naming
``pip install 'mesharray[k8s]'``.

Network: the script's process (the controller) connects to every pod's IP,
and the pods' worker processes connect *back* to the controller. Run the
script where both directions work: in a pod of the same cluster (the
simplest), or on a machine routed to the pod network that the pods can reach
(a VPC-native cluster's VPC, a VPN). ``kubectl port-forward`` carries only
connections *to* pods, so attaching through it is not supported.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from .bootstrap import k8s as _k8s
from .bootstrap.agent import DEFAULT_PORT
from .bootstrap.k8s import dump_yaml, manifest
from .errors import BootstrapError
from .proc import HostMesh
from .proc import attach as _attach

__all__ = ["attach", "create", "manifest", "dump_yaml"]

log = logging.getLogger("mesharray.k8s")


def _attach_found(api: Any, name: str, namespace: str, hosts: int | None, timeout: float,
                  secret: str | bytes | None, transport: str | None, watch: bool) -> HostMesh:
    import os
    import time

    deadline = time.monotonic() + timeout
    found = _k8s.wait_for_hosts(api, name, namespace, hosts, timeout)
    key: str | bytes | None = secret if secret is not None else (os.environ.get("MESHARRAY_SECRET") or None)
    if key is None:
        ref = found[0].secret_ref
        if ref is None:
            raise BootstrapError(f"the pods of mesh {name!r} take no MESHARRAY_SECRET from a Secret; set "
                                 f"MESHARRAY_SECRET or pass secret=")
        key = _k8s.read_secret(api, namespace, ref[0], ref[1])
    left = max(deadline - time.monotonic(), 10.0)
    try:
        mesh = _attach([h.url for h in found], secret=key, timeout=left, transport=transport)
    except BootstrapError as exc:
        raise BootstrapError(f"{exc}. The pods of mesh {name!r} are Ready at {[h.url for h in found]}; attaching "
                             f"needs this process to reach pod IPs (and the pods to reach it back): run the "
                             f"script in the cluster, or on a machine routed to the pod network") from exc
    per = found[0].procs_per_host
    if per:
        mesh.set_default_per_host({"procs": per})
    if watch:
        def lost(index: int, reason: str) -> None:
            dead = mesh.lose_host(index, reason)
            log.warning("%s: ranks %s are dead", reason, dead)

        watcher = _k8s.PodWatcher(api, name, namespace, found, lost)
        mesh.add_detach_callback(watcher.stop)
    return mesh


def attach(name: str, namespace: str = "default", hosts: int | None = None, timeout: float = 300.0, *,
           secret: str | bytes | None = None, transport: str | None = None, kubeconfig: str | None = None,
           context: str | None = None, watch: bool = True) -> HostMesh:
    """Attach to the host agents of a mesh's pods: a :class:`~mesharray.HostMesh` with dims ``{"hosts": N}``.

    Watches the pods labelled ``mesharray/mesh=NAME`` in ``namespace`` until
    one Ready pod serves each index ``0 .. hosts-1`` (a replaced pod's newest
    Ready successor wins), orders them by index and attaches
    (:func:`mesharray.attach`). The agents' secret is ``secret``, else
    ``MESHARRAY_SECRET``, else read from the Secret the pods take it from.
    While attached, a pod that is deleted or fails makes its ranks raise
    :class:`~mesharray.ActorDiedError` naming the pod.

    Parameters
    ----------
    name : str
        The mesh's name (``--name`` of ``python -m mesharray k8s manifest``).
    namespace : str
    hosts : int, optional
        How many hosts to wait for (default: the pods' ``mesharray/hosts`` annotation).
    timeout : float
        Seconds to wait for every pod to be Ready and its agent to answer.
    secret : str or bytes, optional
    transport : {"auto", "shm", "tcp", "ucx"}, optional
        The data plane between hosts (see :func:`mesharray.attach`).
    kubeconfig, context : str, optional
        The client's configuration: in a pod, its service account (in-cluster
        config); elsewhere the kubeconfig (``KUBECONFIG``, ``~/.kube/config``).
    watch : bool
        Watch the pods while attached (needs ``watch`` on pods; False: a lost pod
        is noticed when its connections end).

    Raises
    ------
    BootstrapError
        Not ready after ``timeout`` (the message names each missing index and
        what its pod is doing), the API refused a request, or the agents were
        not reached.
    ImportError
        The ``kubernetes`` client is not installed (``pip install 'mesharray[k8s]'``).

    Examples
    --------
    >>> import mesharray as ma
    >>> hosts = ma.k8s.attach("train", hosts=4)          # doctest: +SKIP
    >>> procs = hosts.spawn_procs(per_host={"procs": 8})  # doctest: +SKIP
    """
    api = _k8s.load_api(kubeconfig, context)
    try:
        mesh = _attach_found(api, name, namespace, hosts, timeout, secret, transport, watch)
    except BaseException:
        _k8s.close_api(api)
        raise
    mesh.add_detach_callback(lambda: _k8s.close_api(api))  # (after the pod watch's stop: added before)
    return mesh


def create(name: str, hosts: int, image: str, *, namespace: str = "default", procs_per_host: int = 8,
           jobset: bool = False, resources: str | Mapping[str, Any] | Sequence[str] | None = None,
           secret_name: str | None = None, port: int = DEFAULT_PORT,
           node_selector: Mapping[str, str] | None = None, service_account: str | None = None,
           python: str = "python", timeout: float = 300.0, transport: str | None = None,
           kubeconfig: str | None = None, context: str | None = None, watch: bool = True) -> HostMesh:
    """Create a mesh's objects (:func:`manifest`), attach to its pods, and delete the objects on detach.

    Parameters are those of :func:`manifest` and :func:`attach`. A fresh
    random secret goes into the Secret it creates (unless ``secret_name``
    names an existing one). When attaching fails, what was created is deleted
    before the error is raised.

    Examples
    --------
    >>> import mesharray as ma
    >>> with ma.k8s.create("train", hosts=2, image="registry/img:tag") as hosts:   # doctest: +SKIP
    ...     procs = hosts.spawn_procs(per_host={"procs": 4})
    """
    import secrets

    key = None if secret_name else secrets.token_hex(32)
    objs = manifest(name, hosts, image, procs_per_host=procs_per_host, namespace=namespace, jobset=jobset,
                    resources=resources, secret_name=secret_name, secret=key, port=port,
                    node_selector=node_selector, service_account=service_account, python=python)
    api = _k8s.load_api(kubeconfig, context)
    try:
        made = _k8s.create_objects(api, objs)
        try:
            mesh = _attach_found(api, name, namespace, hosts, timeout, key, transport, watch)
        except BaseException:
            _k8s.delete_objects(api, made)
            raise
    except BaseException:
        _k8s.close_api(api)
        raise

    def delete() -> None:
        try:
            _k8s.delete_objects(api, made)
        finally:
            _k8s.close_api(api)

    mesh.add_detach_callback(delete)  # (after the pod watch's stop: added before)
    return mesh
