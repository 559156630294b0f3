"""``KubernetesJob``: the pods of one Indexed Job (or JobSet) per mesh, over ``ma.k8s``.

``apply()`` creates each mesh's objects (:func:`mesharray.k8s.manifest`:
a Secret holding the job's secret, a headless Service, an Indexed Job) named
``NAME-MESH``; ``state()`` waits until every index of every mesh has a Ready
pod (printing what the pods are doing meanwhile; ``timeout=`` bounds it),
then attaches to each with :func:`mesharray.k8s.attach` (pods watched while
attached: a pod lost is an ``ActorDiedError`` naming it).
Unlike ``ma.k8s.create``, detaching leaves the objects (the next script
re-attaches); ``kill()`` deletes them. The job file keeps the kubeconfig and
context it was made with, so ``job status|kill`` reach the same cluster.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from typing import Any, Mapping

from ..bootstrap import k8s as _k8s
from ..bootstrap.agent import DEFAULT_PORT
from ..errors import BootstrapError
from ..k8s import attach as k8s_attach
from ..k8s import manifest
from ..proc import HostMesh
from .base import Job, JobStatus, check_meshes

__all__ = ["KubernetesJob"]


def _raw(answer: Any) -> dict:
    data = answer.data
    release = getattr(answer, "release_conn", None)
    if release is not None:
        release()
    return dict(json.loads(data))


class KubernetesJob(Job):
    """Kubernetes pods running host agents: ``KubernetesJob(meshes={"workers": 4}, image=IMAGE)``.

    Parameters
    ----------
    meshes : dict of str to int
        Mesh name -> number of pods (hosts).
    image : str
        A container image with Python and mesharray installed.
    namespace : str
    name : str, optional
        Prefix of the objects' names (``NAME-MESH``; default ``mesharray-`` and
        a random suffix, chosen when applied).
    procs_per_host, resources, port, python, jobset, node_selector, service_account
        As :func:`mesharray.k8s.manifest` takes them (the same for every mesh).
    kubeconfig, context : str, optional
        The client's configuration (default: in-cluster, else ``KUBECONFIG``).

    Examples
    --------
    >>> job = ma.job.KubernetesJob(meshes={"workers": 4}, image="registry/train:1", namespace="default")
    >>> hosts = job.state(cached_path=".mesharray/job.json").workers   # doctest: +SKIP
    """

    kind = "kubernetes"

    def __init__(self, meshes: dict[str, int], image: str, namespace: str = "default", *, name: str | None = None,
                 procs_per_host: int = 8, resources: str | Mapping[str, Any] | None = None,
                 port: int = DEFAULT_PORT, python: str = "python", jobset: bool = False,
                 node_selector: Mapping[str, str] | None = None, service_account: str | None = None,
                 kubeconfig: str | None = None, context: str | None = None) -> None:
        super().__init__(check_meshes(meshes))
        if not isinstance(image, str) or not image:
            raise ValueError("image must name a container image with mesharray installed")
        self.image = image
        self.namespace = namespace
        self.name = name
        self.procs_per_host = procs_per_host
        self.resources = resources
        self.port = port
        self.python = python
        self.jobset = jobset
        self.node_selector = dict(node_selector) if node_selector else None
        self.service_account = service_account
        self.kubeconfig = kubeconfig
        self.context = context
        for mesh, n in self._meshes.items():  # a bad name or resource fails here, not half-way through apply
            manifest(self._object_name(name or "mesharray-x", mesh), n, image, namespace=namespace,
                     procs_per_host=procs_per_host, resources=resources, port=port, python=python, jobset=jobset,
                     node_selector=node_selector, service_account=service_account, secret="-")

    def _args(self) -> dict[str, Any]:
        res = self.resources if self.resources is None or isinstance(self.resources, str) else dict(self.resources)
        return {"meshes": self._meshes, "image": self.image, "namespace": self.namespace, "name": self.name,
                "procs_per_host": self.procs_per_host, "resources": res, "port": self.port, "python": self.python,
                "jobset": self.jobset, "node_selector": self.node_selector, "service_account": self.service_account}

    @staticmethod
    def _object_name(prefix: str, mesh: str) -> str:
        return f"{prefix}-{mesh.replace('_', '-').lower()}"

    def _config(self) -> tuple[str | None, str | None]:
        return (self.kubeconfig or self._alloc.get("kubeconfig"), self.context or self._alloc.get("context"))

    def _api(self) -> Any:
        return _k8s.load_api(*self._config())

    def _create(self) -> None:
        prefix = self.name or f"mesharray-{secrets.token_hex(3)}"
        key = secrets.token_hex(32)
        kubeconfig, context = self.kubeconfig, self.context
        if kubeconfig is None and context is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubeconfig = os.environ.get("KUBECONFIG") or None  # what load_api reads: kept for job status|kill
        api = _k8s.load_api(kubeconfig, context)
        made: list[tuple[str, str, str]] = []
        try:
            for mesh, n in self._meshes.items():
                objs = manifest(self._object_name(prefix, mesh), n, self.image, namespace=self.namespace,
                                procs_per_host=self.procs_per_host, resources=self.resources, port=self.port,
                                python=self.python, jobset=self.jobset, node_selector=self.node_selector,
                                service_account=self.service_account, secret=key)
                made += _k8s.create_objects(api, objs)
        except BaseException:
            _k8s.delete_objects(api, made)
            raise
        finally:
            _k8s.close_api(api)
        self._id = prefix
        self._secret = key
        self._alloc = {"made": [list(m) for m in made], "kubeconfig": kubeconfig, "context": context}

    def _wait_urls(self, deadline: float | None) -> dict[str, list[str]]:
        """Wait until every mesh has a Ready pod per index (the pods' states on stderr meanwhile)."""
        t0 = time.monotonic()
        shown, next_note = "", t0
        while True:
            st = self._status()
            now = time.monotonic()
            if st.state == "running":
                if shown:
                    print(f"mesharray: Kubernetes job {self._id}: {st.detail} ({now - t0:.0f} s)", file=sys.stderr,
                          flush=True)
                return {mesh: [] for mesh in self._meshes}  # the pods are found (again) by ma.k8s.attach
            if st.state == "dead":
                raise BootstrapError(f"Kubernetes job {self._id} is gone: {st.detail}")
            if now - t0 >= 1.0 and (st.detail != shown or now >= next_note):
                print(f"mesharray: Kubernetes job {self._id} pending: {st.detail} ({now - t0:.0f} s)",
                      file=sys.stderr, flush=True)
                shown, next_note = st.detail, now + 30.0
            if deadline is not None and now >= deadline:
                raise BootstrapError(f"Kubernetes job {self._id} is not ready after the timeout: {st.detail}; its "
                                     f"objects stay (re-attach later with the same state(cached_path=...), or end "
                                     f"it with `python -m mesharray job kill {self.path}`)")
            time.sleep(0.5)

    def _attach_mesh(self, name: str, urls: list[str], timeout: float) -> HostMesh:
        kubeconfig, context = self._config()
        return k8s_attach(self._object_name(str(self._id), name), self.namespace, hosts=self._meshes[name],
                          timeout=max(timeout, 60.0), secret=self._secret, kubeconfig=kubeconfig, context=context)

    def _status(self) -> JobStatus:
        from kubernetes import client

        api = self._api()
        try:
            batch: Any = client.BatchV1Api(api)
            custom: Any = client.CustomObjectsApi(api)
            core: Any = client.CoreV1Api(api)
            hosts: list[tuple[str, str]] = []
            waiting: list[str] = []
            for mesh, n in self._meshes.items():
                obj = self._object_name(str(self._id), mesh)
                try:
                    if self.jobset:
                        g = _k8s.JOBSET_API
                        _raw(custom.get_namespaced_custom_object(g[0], g[1], self.namespace, g[2], obj,
                                                                 _preload_content=False))
                    else:
                        _raw(batch.read_namespaced_job(obj, self.namespace, _preload_content=False))
                except client.ApiException as exc:
                    if exc.status == 404:
                        return JobStatus(self.kind, self._id, "dead", f"{'JobSet' if self.jobset else 'Job'} "
                                         f"{self.namespace}/{obj} is gone", hosts)
                    raise BootstrapError(f"could not read {self.namespace}/{obj}: {exc.status} {exc.reason}") from exc
                pods = _raw(core.list_namespaced_pod(self.namespace, label_selector=f"{_k8s.MESH_LABEL}={obj}",
                                                     _preload_content=False)).get("items") or []
                found, why = _k8s.pick_hosts(pods, n)
                if found is None:
                    waiting.append(f"{mesh}: {why}")
                else:
                    hosts += [(f"{obj}-{h.index}", h.url) for h in found]
        finally:
            _k8s.close_api(api)
        if waiting:
            return JobStatus(self.kind, self._id, "pending", "; ".join(waiting), hosts)
        return JobStatus(self.kind, self._id, "running", f"{len(hosts)} pods Ready", hosts)

    def _kill(self) -> None:
        api = self._api()
        try:
            _k8s.delete_objects(api, [(m[0], m[1], m[2]) for m in self._alloc.get("made", [])])
        finally:
            _k8s.close_api(api)
