"""The Kubernetes objects of a mesh: a Secret, a headless Service and an Indexed Job (or a JobSet).

:func:`manifest` builds them as plain dicts (no dependency): a Secret holding
the agents' secret (unless an existing one is named), a headless Service, and
an Indexed Job with ``parallelism = completions = hosts`` (or a JobSet
wrapping that Job) whose pods each run ``python -m mesharray host`` on a fixed
port. The pod's IP (downward API, ``status.podIP``) is where the agent listens
and what it advertises; its completion index (``JOB_COMPLETION_INDEX``) names
the host (``--host-id NAME-INDEX``). The labels, annotations and names defined
here are also what :mod:`.discovery` reads back from the pods.
"""

from __future__ import annotations

import re
import secrets as _secrets
from typing import Any, Mapping, Sequence

from ..agent import DEFAULT_PORT

__all__ = ["manifest", "parse_resources", "MESH_LABEL", "HOSTS_ANNOTATION", "PROCS_ANNOTATION", "INDEX_KEY",
           "SECRET_KEY", "CONTAINER", "PORT_NAME", "JOBSET_API", "RESOURCE_ALIASES", "MAX_NAME"]

#: label every object and pod of a mesh carries (its value: the mesh's name)
MESH_LABEL = "mesharray/mesh"
#: annotations of the pods: how many hosts the mesh has, how many processes a host is meant for
HOSTS_ANNOTATION = "mesharray/hosts"
PROCS_ANNOTATION = "mesharray/procs-per-host"
#: the Job controller's annotation (and label, since Kubernetes 1.28) of an Indexed Job's pod
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
#: the key of the agents' secret in its Secret; the container's name; the name of its port
SECRET_KEY = "secret"
CONTAINER = "host"
PORT_NAME = "mesharray"
#: group, version and plural of the JobSet custom resource
JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")

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

