"""A Kubernetes cluster small enough to live in a test: an API server, the Job and JobSet controllers, a kubelet.

- **API server**: HTTP on 127.0.0.1 (bearer-token auth, from a kubeconfig the
  test writes), serving what the official ``kubernetes`` client asks of pods,
  services, secrets, jobs (``batch/v1``) and jobsets (``jobset.x-k8s.io/v1alpha2``):
  create, get, list and watch (label selectors: ``=``, ``==``, ``!=``, ``in``,
  ``notin``, exists, ``!``; ``resourceVersion`` and ``timeoutSeconds`` on
  watches), merge-patch, delete (with cascading deletion through owner
  references), Kubernetes ``Status`` errors (404, 409, 401). Secrets turn
  ``stringData`` into base64 ``data`` as the real server does.
- **Controllers**: an Indexed Job makes one pod per index (labels and
  annotation ``batch.kubernetes.io/job-completion-index``, hostname
  ``JOB-INDEX``, ``JOB_COMPLETION_INDEX`` in the env, owner reference) and
  replaces a pod that fails or is deleted (up to ``backoffLimit`` failures); a
  JobSet makes its child Jobs and its headless Service.
- **Kubelet**: runs each pod's container command as a local process with the
  environment Kubernetes would give it — ``value``, ``fieldRef`` (``status.podIP``,
  ``metadata.name``/``namespace``/``uid``, ``metadata.labels['k']``,
  ``metadata.annotations['k']``, ``spec.nodeName``), ``secretKeyRef`` from the
  Secret, ``HOSTNAME`` — after expanding ``$(VAR)`` in command and args as the
  kubelet does. Each pod gets its own loopback IP (127.0.0.20, .21, ...), so
  the agents' fixed port never collides. It patches the pod's status (podIP,
  Running, Ready; Failed/Succeeded with the exit code), and on deletion sends
  SIGTERM to the pod's whole process tree, then SIGKILL after a grace period,
  then removes the pod. The container image is not pulled: every "image" is
  this machine's Python.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

import psutil

TOKEN = "fake-cluster-token"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"

KINDS = {  # plural -> (apiVersion, kind)
    "pods": ("v1", "Pod"), "services": ("v1", "Service"), "secrets": ("v1", "Secret"),
    "jobs": ("batch/v1", "Job"), "jobsets": ("jobset.x-k8s.io/v1alpha2", "JobSet"),
}
_PATH = re.compile(r"^/(?:api/v1|apis/batch/v1|apis/jobset\.x-k8s\.io/v1alpha2)/namespaces/([^/]+)/([a-z]+)"
                   r"(?:/([^/]+))?(?:/(status))?$")


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- label selectors


def parse_selector(text: str) -> list[Callable[[dict], bool]]:
    """Kubernetes label selector syntax → predicates on a labels dict."""
    terms, depth, cur = [], 0, ""
    for ch in text or "":
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    preds: list[Callable[[dict], bool]] = []
    for t in (t.strip() for t in terms):
        if not t:
            continue
        m = re.match(r"^([^\s!=]+)\s+(in|notin)\s+\((.*)\)$", t)
        if m:
            key, op, vals = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                preds.append(lambda lb, k=key, vs=vals: lb.get(k) in vs)
            else:
                preds.append(lambda lb, k=key, vs=vals: lb.get(k) not in vs)
        elif "!=" in t:
            k, v = (s.strip() for s in t.split("!=", 1))
            preds.append(lambda lb, k=k, v=v: lb.get(k) != v)
        elif "=" in t:
            k, v = (s.strip() for s in re.split("==?", t, maxsplit=1))
            preds.append(lambda lb, k=k, v=v: lb.get(k) == v)
        elif t.startswith("!"):
            key = t[1:].strip()
            preds.append(lambda lb, k=key: k not in lb)
        else:
            preds.append(lambda lb, k=t: k in lb)
    return preds


def matches(obj: dict, preds: list[Callable[[dict], bool]]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(p(labels) for p in preds)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "code": self.code}


# --------------------------------------------------------------------------- the cluster


class FakeCluster:
    """The store, the controllers and the kubelet; :attr:`url` is the API server."""

    def __init__(self, first_ip: int = 20, grace_cap: float = 3.0) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object
        self.events: list[tuple[int, str, str, dict]] = []   # (rv, plural, type, object)
        self.rv = 0
        self.cond = threading.Condition()
        self.closing = False
        self._reconciling = self._dirty = False
        #: watches from a resource version at or below this one get "410 Gone" (as after the server's compaction)
        self.compacted = 0
        self.requests: list[tuple[str, str]] = []
        self.kubelet = Kubelet(self, first_ip=first_ip, grace_cap=grace_cap)
        cluster = self

        class Handler(_Handler):
            fake = cluster

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-apiserver", daemon=True)
        self._thread.start()

    # ---- store

    def _event(self, plural: str, kind: str, obj: dict) -> None:
        self.events.append((self.rv, plural, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def _bump(self, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def create(self, plural: str, ns: str, obj: dict) -> dict:
        with self.cond:
            obj = copy.deepcopy(obj)
            api_version, kind = KINDS[plural]
            obj.setdefault("apiVersion", api_version)
            obj.setdefault("kind", kind)
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            name = meta.get("name")
            if not name:
                raise ApiError(422, "Invalid", f"{kind}: metadata.name: Required value")
            if (plural, ns, name) in self.objects:
                raise ApiError(409, "AlreadyExists", f'{plural} "{name}" already exists')
            meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
            if plural == "secrets":
                data = dict(obj.get("data") or {})
                for k, v in (obj.pop("stringData", None) or {}).items():
                    data[k] = base64.b64encode(str(v).encode()).decode()
                obj["data"] = data
            elif plural == "services":
                obj.setdefault("spec", {}).setdefault("clusterIP", "10.96.0.%d" % (len(self.objects) % 250 + 2))
            elif plural == "pods":
                obj.setdefault("status", {"phase": "Pending"})
            elif plural in ("jobs", "jobsets"):
                obj.setdefault("status", {})
            self._bump(obj)
            self.objects[(plural, ns, name)] = obj
            self._event(plural, "ADDED", obj)
            self._reconcile()
            return copy.deepcopy(obj)

    def get(self, plural: str, ns: str, name: str) -> dict:
        with self.cond:
            obj = self.objects.get((plural, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            return copy.deepcopy(obj)

    def list(self, plural: str, ns: str, selector: str = "") -> tuple[list[dict], int]:
        preds = parse_selector(selector)
        with self.cond:
            items = [copy.deepcopy(o) for (p, n, _), o in self.objects.items()
                     if p == plural and n == ns and matches(o, preds)]
            return items, self.rv

    def patch(self, plural: str, ns: str, name: str, patch: dict) -> dict:
        with self.cond:
            obj = self.objects.get((plural, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            new = merge_patch(obj, patch)
            new["metadata"]["uid"] = obj["metadata"]["uid"]
            self._bump(new)
            self.objects[(plural, ns, name)] = new
            self._event(plural, "MODIFIED", new)
            self._reconcile()
            return copy.deepcopy(new)

    def delete(self, plural: str, ns: str, name: str, propagation: str = "Background") -> dict:
        with self.cond:
            obj = self.objects.get((plural, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            self._delete(plural, ns, name, propagation)
            self._reconcile()
            return copy.deepcopy(obj)

    def _delete(self, plural: str, ns: str, name: str, propagation: str) -> None:
        obj = self.objects.get((plural, ns, name))
        if obj is None:
            return
        if plural == "pods" and self.kubelet.running(obj["metadata"]["uid"]):
            # graceful: mark it; the kubelet stops its containers, then removes it
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = now()
                obj["metadata"]["deletionGracePeriodSeconds"] = int(
                    (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
                self._bump(obj)
                self._event(plural, "MODIFIED", obj)
        else:
            self._remove(plural, ns, name)
        if propagation != "Orphan":  # the garbage collector: dependents go too
            uid = obj["metadata"]["uid"]
            for (p, n, nm), o in list(self.objects.items()):
                if n == ns and any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or []):
                    self._delete(p, n, nm, propagation)

    def _remove(self, plural: str, ns: str, name: str) -> None:
        obj = self.objects.pop((plural, ns, name), None)
        if obj is not None:
            self._bump(obj)
            self._event(plural, "DELETED", obj)

    def set_pod_status(self, ns: str, name: str, uid: str, status: dict, remove: bool = False) -> None:
        """The kubelet's status updates (ignored once the pod is gone or was replaced)."""
        with self.cond:
            obj = self.objects.get(("pods", ns, name))
            if obj is None or obj["metadata"]["uid"] != uid:
                return
            if remove:
                self._remove("pods", ns, name)
            else:
                obj["status"] = merge_patch(obj.get("status") or {}, status)
                self._bump(obj)
                self._event("pods", "MODIFIED", obj)
            self._reconcile()

    # ---- controllers (run under the lock after every change)

    def _owned(self, plural: str, ns: str, uid: str) -> list[dict]:
        return [o for (p, n, _), o in self.objects.items() if p == plural and n == ns
                and any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]

    def _reconcile(self) -> None:
        # what the controllers create comes back here through create(): note it, and go round again
        if self._reconciling:
            self._dirty = True
            return
        self._reconciling = True
        try:
            while True:
                self._dirty = False
                for (plural, ns, _), obj in list(self.objects.items()):
                    if plural == "jobsets":
                        self._reconcile_jobset(ns, obj)
                for (plural, ns, name), obj in list(self.objects.items()):
                    if plural == "jobs" and (plural, ns, name) in self.objects:
                        self._reconcile_job(ns, obj)
                if not self._dirty:
                    break
        finally:
            self._reconciling = False

    def _reconcile_jobset(self, ns: str, js: dict) -> None:
        meta, spec = js["metadata"], js.get("spec") or {}
        network = spec.get("network") or {}
        subdomain = network.get("subdomain") or meta["name"]
        owner = [{"apiVersion": js["apiVersion"], "kind": "JobSet", "name": meta["name"], "uid": meta["uid"],
                  "controller": True, "blockOwnerDeletion": True}]
        if ("services", ns, subdomain) not in self.objects:
            self.create("services", ns, {"metadata": {"name": subdomain, "ownerReferences": owner,
                                                      "labels": {"jobset.sigs.k8s.io/jobset-name": meta["name"]}},
                                         "spec": {"clusterIP": "None",
                                                  "selector": {"jobset.sigs.k8s.io/jobset-name": meta["name"]},
                                                  "publishNotReadyAddresses": True}})
        for rj in spec.get("replicatedJobs") or []:
            for i in range(int(rj.get("replicas", 1))):
                jname = f"{meta['name']}-{rj['name']}-{i}"
                if ("jobs", ns, jname) in self.objects:
                    continue
                tmpl = copy.deepcopy(rj.get("template") or {})
                labels = {**((tmpl.get("metadata") or {}).get("labels") or {}),
                          "jobset.sigs.k8s.io/jobset-name": meta["name"],
                          "jobset.sigs.k8s.io/replicatedjob-name": rj["name"], "jobset.sigs.k8s.io/job-index": str(i)}
                jspec = tmpl.get("spec") or {}
                pod_t = jspec.setdefault("template", {})
                pod_t.setdefault("metadata", {}).setdefault("labels", {}).update(
                    {k: v for k, v in labels.items() if k.startswith("jobset.sigs.k8s.io/")})
                if network.get("enableDNSHostnames", True):
                    pod_t.setdefault("spec", {})["subdomain"] = subdomain
                self.create("jobs", ns, {"metadata": {"name": jname, "labels": labels, "ownerReferences": owner},
                                         "spec": jspec})

    def _reconcile_job(self, ns: str, job: dict) -> None:
        meta, spec = job["metadata"], job.get("spec") or {}
        status = job.setdefault("status", {})
        if status.get("failed_job") or spec.get("completionMode") != "Indexed":
            return
        pods = self._owned("pods", ns, meta["uid"])
        failed = sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Failed")
        if failed > int(spec.get("backoffLimit", 6)):
            status["failed_job"] = True  # (the real controller then terminates the remaining pods)
            return
        done = {int(p["metadata"]["annotations"][INDEX_KEY]) for p in pods
                if (p.get("status") or {}).get("phase") == "Succeeded"}
        active = {int(p["metadata"]["annotations"][INDEX_KEY]) for p in pods
                  if (p.get("status") or {}).get("phase") in ("Pending", "Running")
                  and not p["metadata"].get("deletionTimestamp")}
        for i in range(int(spec.get("completions", 1))):
            if i in done or i in active:
                continue
            self._make_pod(ns, job, i)

    def _make_pod(self, ns: str, job: dict, index: int) -> None:
        meta = job["metadata"]
        tmpl = copy.deepcopy(job["spec"]["template"])
        pmeta = tmpl.get("metadata") or {}
        labels = {**(pmeta.get("labels") or {}), "batch.kubernetes.io/controller-uid": meta["uid"],
                  "batch.kubernetes.io/job-name": meta["name"], "controller-uid": meta["uid"],
                  "job-name": meta["name"], INDEX_KEY: str(index)}
        annotations = {**(pmeta.get("annotations") or {}), INDEX_KEY: str(index)}
        spec = tmpl.get("spec") or {}
        spec["hostname"] = f"{meta['name']}-{index}"
        for c in spec.get("containers") or []:
            env = c.setdefault("env", [])
            if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in env):
                env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}})
        self.create("pods", ns, {"metadata": {
            "name": f"{meta['name']}-{index}-{uuid.uuid4().hex[:5]}", "labels": labels, "annotations": annotations,
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"],
                                 "controller": True, "blockOwnerDeletion": True}]}, "spec": spec})

    # ---- test helpers

    def pods(self, ns: str = "default", selector: str = "") -> list[dict]:
        return self.list("pods", ns, selector)[0]

    def write_kubeconfig(self, path: str, namespace: str = "default") -> str:
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
               "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
               "users": [{"name": "tester", "user": {"token": TOKEN}}],
               "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester",
                                                         "namespace": namespace}}]}
        with open(path, "w") as f:
            json.dump(cfg, f)  # JSON is YAML
        return path

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.kubelet.close()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, OSError)):  # a client that hangs up is no error
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeCluster
    # HTTP/1.1: watches are chunked, one event a chunk, as the real server sends them (a client reads a
    # chunk as soon as it comes; an unchunked stream would be read in 64 KiB blocks)
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n)) if n else None

    def _route(self, method: str) -> None:
        fake = self.fake
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        fake.requests.append((method, self.path))
        try:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            m = _PATH.match(url.path)
            if not m or m.group(2) not in KINDS:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
            ns, plural, name, sub = m.groups()
            if method == "GET" and name is None:
                if q.get("watch") in ("true", "True", "1"):
                    return self._watch(plural, ns, q)
                items, rv = fake.list(plural, ns, q.get("labelSelector", ""))
                api_version, kind = KINDS[plural]
                return self._send(200, {"kind": f"{kind}List", "apiVersion": api_version,
                                        "metadata": {"resourceVersion": str(rv)}, "items": items})
            if method == "GET":
                return self._send(200, fake.get(plural, ns, name))
            if method == "POST" and name is None:
                return self._send(201, fake.create(plural, ns, self._body() or {}))
            if method == "PATCH" and name is not None:
                body = self._body() or {}
                return self._send(200, fake.patch(plural, ns, name, {"status": body.get("status")} if sub else body))
            if method == "DELETE" and name is not None:
                body = self._body() or {}
                policy = body.get("propagationPolicy") or q.get("propagationPolicy") or "Background"
                gone = fake.delete(plural, ns, name, policy)
                if plural in ("pods", "services"):  # as the real server: these answer with the object
                    return self._send(200, gone)
                return self._send(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                        "details": {"name": name, "kind": plural}})
            raise ApiError(405, "MethodNotAllowed", f"{method} {url.path} is not supported here")
        except ApiError as exc:
            self._send(exc.code, exc.status())

    def _watch(self, plural: str, ns: str, q: dict) -> None:
        fake = self.fake
        preds = parse_selector(q.get("labelSelector", ""))
        deadline = time.monotonic() + min(float(q.get("timeoutSeconds") or 60), 300)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        start = q.get("resourceVersion") or ""
        with fake.cond:
            if start in ("", "0"):
                # no version: the current objects as ADDED events, then what follows
                pending = [("ADDED", o) for (p, n, _), o in fake.objects.items()
                           if p == plural and n == ns and matches(o, preds)]
                last = fake.rv
            elif int(start) <= fake.compacted:
                pending, last = [("ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                            "reason": "Expired", "code": 410,
                                            "message": f"too old resource version: {start}"})], fake.rv
                deadline = 0.0  # the stream ends after the error, as the real server's does
            else:
                pending, last = [], int(start)
        try:
            while True:
                for kind, obj in pending:
                    line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
                with fake.cond:
                    while True:
                        new = [(rv, k, o) for rv, p, k, o in fake.events
                               if rv > last and p == plural and (o.get("metadata") or {}).get("namespace") == ns
                               and matches(o, preds)]
                        if fake.events and fake.events[-1][0] > last:
                            last = fake.events[-1][0]
                        if new or fake.closing or time.monotonic() >= deadline:
                            break
                        fake.cond.wait(max(0.0, min(0.5, deadline - time.monotonic())))
                    pending = [(k, o) for _, k, o in new]
                    if not pending and (fake.closing or time.monotonic() >= deadline):
                        self.wfile.write(b"0\r\n\r\n")
                        self.close_connection = True
                        return
        except (BrokenPipeError, ConnectionResetError):
            return

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def do_DELETE(self) -> None:
        self._route("DELETE")


# --------------------------------------------------------------------------- the kubelet


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion (``$$`` escapes; an unknown variable stays as written)."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class _PodProc:
    def __init__(self, uid: str, ns: str, name: str, proc: subprocess.Popen, log_path: str) -> None:
        self.uid, self.ns, self.name, self.proc, self.log_path = uid, ns, name, proc, log_path
        self.deleting = False


class Kubelet:
    """Runs the pods of the fake cluster as local processes (one node, ``fake-node``)."""

    def __init__(self, cluster: FakeCluster, first_ip: int = 20, grace_cap: float = 3.0) -> None:
        self.cluster = cluster
        self.next_ip = first_ip
        self.grace_cap = grace_cap
        self.procs: dict[str, _PodProc] = {}
        self.unschedulable: Callable[[dict], bool] = lambda pod: False
        self.log_dir = os.path.join("/tmp", f"fake-kubelet-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        os.makedirs(self.log_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._seen = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._thread.start()

    def running(self, uid: str) -> bool:
        return uid in self.procs

    def log(self, pod_name: str) -> str:
        for p in list(self.procs.values()):
            if p.name == pod_name:
                with open(p.log_path, errors="replace") as f:
                    return f.read()
        path = os.path.join(self.log_dir, pod_name + ".log")
        if not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def _loop(self) -> None:
        c = self.cluster
        while not self._stop:
            with c.cond:
                c.cond.wait_for(lambda: self._stop or (c.events and c.events[-1][0] > self._seen), timeout=0.5)
                todo = [(k, o) for rv, p, k, o in c.events if rv > self._seen and p == "pods"]
                if c.events:
                    self._seen = c.events[-1][0]
                pods = {o["metadata"]["uid"]: o for (p, _, _), o in c.objects.items() if p == "pods"}
            for kind, obj in todo:
                uid = obj["metadata"]["uid"]
                try:
                    if kind == "ADDED" and uid in pods and uid not in self.procs:
                        self._start(pods[uid])
                    elif obj["metadata"].get("deletionTimestamp") and uid in self.procs:
                        p = self.procs[uid]
                        if not p.deleting:
                            p.deleting = True
                            grace = min(float(obj["metadata"].get("deletionGracePeriodSeconds", 30)),
                                        self.grace_cap)
                            threading.Thread(target=self._terminate, args=(p, grace, True), daemon=True).start()
                except Exception as exc:  # a pod that cannot start is a failed pod, not a dead kubelet
                    meta = obj["metadata"]
                    c.set_pod_status(meta["namespace"], meta["name"], uid, {"phase": "Failed", "message": str(exc)})

    def _env(self, pod: dict, container: dict, ip: str) -> dict[str, str]:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/local/bin:/usr/bin:/bin",
               "HOME": "/tmp", "LANG": "C.UTF-8", "HOSTNAME": spec.get("hostname") or meta["name"]}
        field = {"status.podIP": ip, "status.hostIP": "127.0.0.1", "metadata.name": meta["name"],
                 "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"], "spec.nodeName": "fake-node",
                 "spec.serviceAccountName": spec.get("serviceAccountName", "default")}
        for e in container.get("env") or []:
            name = e["name"]
            if "value" in e:
                env[name] = expand(str(e["value"]), env)
                continue
            src = e.get("valueFrom") or {}
            if "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                m = re.match(r"^metadata\.(labels|annotations)\['(.+)'\]$", path)
                if m:
                    value = (meta.get(m.group(1)) or {}).get(m.group(2))
                else:
                    value = field.get(path)
                if value is None:
                    raise RuntimeError(f"env {name}: unsupported or empty fieldRef {path!r}")
                env[name] = str(value)
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                secret = self.cluster.get("secrets", meta["namespace"], ref["name"])
                env[name] = base64.b64decode(secret["data"][ref["key"]]).decode()
            else:
                raise RuntimeError(f"env {name}: unsupported valueFrom {sorted(src)}")
        return env

    def _start(self, pod: dict) -> None:
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        if self.unschedulable(pod):
            self.cluster.set_pod_status(ns, name, uid, {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}]})
            return
        with self._lock:
            ip = f"127.0.0.{self.next_ip}"
            self.next_ip += 1
        container = pod["spec"]["containers"][0]
        env = self._env(pod, container, ip)
        argv = [expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
        log_path = os.path.join(self.log_dir, name + ".log")
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd="/tmp", start_new_session=True)
        self.procs[uid] = pp = _PodProc(uid, ns, name, proc, log_path)
        t = now()
        self.cluster.set_pod_status(ns, name, uid, {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": t,
            "conditions": [{"type": t_, "status": "True", "lastTransitionTime": t}
                           for t_ in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": container["name"], "image": container.get("image", ""),
                                   "imageID": "fake://" + container.get("image", ""), "ready": True,
                                   "started": True, "restartCount": 0, "state": {"running": {"startedAt": t}}}]})
        threading.Thread(target=self._wait, args=(pp, container["name"]), daemon=True).start()

    def _wait(self, pp: _PodProc, cname: str) -> None:
        code = pp.proc.wait()
        if pp.deleting or self._stop:
            return
        self._kill_tree(pp, 0.0)  # what the container left behind dies with it
        phase = "Succeeded" if code == 0 else "Failed"
        self.cluster.set_pod_status(pp.ns, pp.name, pp.uid, {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted" if code == 0 else "PodFailed"},
                           {"type": "ContainersReady", "status": "False"}],
            "containerStatuses": [{"name": cname, "image": "", "imageID": "", "ready": False, "started": False,
                                   "restartCount": 0,
                                   "state": {"terminated": {"exitCode": code if code >= 0 else 128 - code,
                                                            "reason": "Completed" if code == 0 else "Error"}}}]})
        self.procs.pop(pp.uid, None)

    def _tree(self, pp: _PodProc) -> list[psutil.Process]:
        """Every process of the pod (its container's cgroup, here): the session the kubelet started it in
        (a process whose parent died is still in it), and the descendants of its main process."""
        found: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(pp.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                found[p.pid] = p
        except psutil.Error:
            pass
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in found:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == pp.proc.pid:  # the session id
                    found[int(entry)] = psutil.Process(int(entry))
            except (OSError, ValueError, IndexError, psutil.Error):
                continue
        return list(found.values())

    def _kill_tree(self, pp: _PodProc, grace: float) -> None:
        """SIGTERM to every process of the pod, SIGKILL after ``grace`` seconds (a container's stop)."""
        tree = self._tree(pp)
        if grace > 0:
            for p in tree:
                try:
                    p.send_signal(signal.SIGTERM)
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(tree, timeout=grace)
            tree = alive + [p for p in self._tree(pp) if p not in alive]
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(tree, timeout=5)
        try:
            pp.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def _terminate(self, pp: _PodProc, grace: float, remove: bool) -> None:
        self._kill_tree(pp, grace)
        self.procs.pop(pp.uid, None)
        if remove:
            self.cluster.set_pod_status(pp.ns, pp.name, pp.uid, {}, remove=True)

    def kill_container(self, pod_name: str, sig: int = signal.SIGKILL) -> None:
        """The container's main process dies (an OOM kill, a crash): the pod fails."""
        for p in list(self.procs.values()):
            if p.name == pod_name:
                os.kill(p.proc.pid, sig)

    def close(self) -> None:
        self._stop = True
        for p in list(self.procs.values()):
            p.deleting = True
            self._kill_tree(p, 0.0)
        self.procs.clear()
        self._thread.join(5)
        shutil.rmtree(self.log_dir, ignore_errors=True)
