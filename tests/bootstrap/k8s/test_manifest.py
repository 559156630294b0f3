"""``python -m mesharray k8s manifest``: every variant validates against the Kubernetes schemas, offline.

Jobs, Services and Secrets: ``kubernetes-validate --strict`` (the OpenAPI schemas it bundles; strict
rejects unknown fields). The JobSet: a schema of its spec written for these tests from the JobSet API
reference (schemas/jobset-v1alpha2.json: the fields and types of jobset.x-k8s.io/v1alpha2, not the upstream
CRD file), made strict the same way, and the Job template inside it validated as a batch/v1 Job.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from mesharray.bootstrap import k8s as K

kv = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

HERE = pathlib.Path(__file__).resolve().parent
K8S_VERSION = "1.37.0"

VARIANTS = [
    dict(),
    dict(procs_per_host=1, namespace="ml", resources="gpu=8"),
    dict(resources=["amd=4", "memory=64Gi,cpu=16"], secret_name="shared-secret"),
    dict(resources={"tpu": 4}, node_selector={"cloud.google.com/gke-tpu-topology": "2x2"}, service_account="trainer"),
    dict(port=30000, python="/opt/venv/bin/python"),
]


def _validate_k8s(obj: dict) -> None:
    kv.validate(obj, K8S_VERSION, strict=True)


def _strict(schema):
    """additionalProperties: false wherever a schema lists properties (what a server's pruning would drop)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _jobset_schema() -> dict:
    data = json.loads((HERE / "schemas" / "jobset-v1alpha2.json").read_text())
    return _strict(data["openAPIV3Schema"])


def _validate_jobset(obj: dict) -> None:
    assert obj["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and obj["kind"] == "JobSet"
    jsonschema.Draft7Validator(_jobset_schema()).validate(obj)
    for rj in obj["spec"]["replicatedJobs"]:  # the Job inside, against the Kubernetes schema of a Job
        _validate_k8s({"apiVersion": "batch/v1", "kind": "Job",
                       "metadata": {"name": f"{obj['metadata']['name']}-{rj['name']}-0", **rj["template"]["metadata"]},
                       "spec": rj["template"]["spec"]})


@pytest.mark.parametrize("kw", VARIANTS)
def test_job_manifests_validate_strictly(kw):
    objs = K.manifest("train", 4, "registry.example/mesharray:1.0", **kw)
    kinds = [o["kind"] for o in objs]
    assert kinds == (["Service", "Job"] if kw.get("secret_name") else ["Secret", "Service", "Job"])
    for o in objs:
        _validate_k8s(o)
    # what kubectl reads is what was meant: the YAML parses back to the same objects
    assert list(yaml.safe_load_all(K.dump_yaml(objs))) == objs


@pytest.mark.parametrize("kw", VARIANTS)
def test_jobset_manifests_validate_against_the_crd(kw):
    objs = K.manifest("train", 4, "registry.example/mesharray:1.0", jobset=True, **kw)
    assert [o["kind"] for o in objs] == (["JobSet"] if kw.get("secret_name") else ["Secret", "JobSet"])
    for o in objs:
        (_validate_jobset if o["kind"] == "JobSet" else _validate_k8s)(o)
    assert list(yaml.safe_load_all(K.dump_yaml(objs))) == objs


def test_the_crd_check_rejects_what_a_server_would():
    (js,) = [o for o in K.manifest("t", 2, "img", jobset=True) if o["kind"] == "JobSet"]
    bad = copy.deepcopy(js)
    bad["spec"]["replicatedJobs"][0]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        _validate_jobset(bad)
    bad = copy.deepcopy(js)
    bad["spec"]["replicatedJob"] = bad["spec"].pop("replicatedJobs")  # a typo: strict catches it
    with pytest.raises(jsonschema.ValidationError):
        _validate_jobset(bad)
    bad = copy.deepcopy(js)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["imagePull"] = "x"
    with pytest.raises((jsonschema.ValidationError, kv.ValidationError)):
        _validate_jobset(bad)


def test_the_pods_run_an_agent_on_the_pod_ip_named_by_index():
    objs = K.manifest("train", 4, "img", procs_per_host=8, resources="gpu=8", port=26601)
    secret, service, job = objs
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    pod = spec["template"]
    assert pod["metadata"]["labels"] == {"mesharray/mesh": "train"}
    assert pod["metadata"]["annotations"] == {"mesharray/hosts": "4", "mesharray/procs-per-host": "8"}
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "mesharray", "host"]
    assert c["args"] == ["--listen", "tcp://$(POD_IP):26601", "--advertise", "tcp://$(POD_IP):26601",
                         "--host-id", "$(MESHARRAY_MESH)-$(JOB_COMPLETION_INDEX)"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["MESHARRAY_SECRET"]["valueFrom"] == {"secretKeyRef": {"name": "train-secret", "key": "secret"}}
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert c["ports"] == [{"name": "mesharray", "containerPort": 26601, "protocol": "TCP"}]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] == "train"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"mesharray/mesh": "train"}
    assert secret["metadata"]["name"] == "train-secret" and len(secret["stringData"]["secret"]) == 64
    # a fresh secret each time
    assert K.manifest("train", 4, "img")[0]["stringData"] != K.manifest("train", 4, "img")[0]["stringData"]


def test_resources_by_flag():
    assert K.parse_resources("gpu=8") == {"nvidia.com/gpu": "8"}
    assert K.parse_resources("amd-gpu=2,rocm=1") == {"amd.com/gpu": "1"}
    assert K.parse_resources("tpu=4") == {"google.com/tpu": "4"}
    assert K.parse_resources(["example.com/fpga=1", "memory=1.5Gi"]) == {"example.com/fpga": "1", "memory": "1.5Gi"}
    for bad in ("gpu", "gpu=-1", "gpu=8x", "Bad Name=1"):
        with pytest.raises(ValueError):
            K.parse_resources(bad)
    with pytest.raises(ValueError, match="bad mesh name"):
        K.manifest("Train_1", 2, "img")
    with pytest.raises(ValueError, match="hosts"):
        K.manifest("train", 0, "img")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mesharray", "k8s", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(HERE.parents[2])})


def test_cli_prints_what_kubernetes_validate_accepts(tmp_path):
    out = _cli("manifest", "--name", "train", "--hosts", "4", "--image", "img:1", "--procs-per-host", "8",
               "--namespace", "ml", "--resources", "gpu=8", "--node-selector", "pool=a100")
    assert out.returncode == 0, out.stderr
    objs = list(yaml.safe_load_all(out.stdout))
    assert [o["kind"] for o in objs] == ["Secret", "Service", "Job"]
    assert {o["metadata"]["namespace"] for o in objs} == {"ml"}
    path = tmp_path / "mesh.yaml"
    path.write_text(out.stdout)
    exe = pathlib.Path(sys.executable).with_name("kubernetes-validate")
    check = subprocess.run([str(exe), "--strict", "-k", K8S_VERSION, str(path)], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    out = _cli("manifest", "--name", "train", "--hosts", "2", "--image", "img:1", "--jobset", "--secret-name", "s")
    assert out.returncode == 0, out.stderr
    (js,) = list(yaml.safe_load_all(out.stdout))
    _validate_jobset(js)


def test_cli_rejects_bad_arguments():
    out = _cli("manifest", "--name", "train", "--hosts", "2", "--image", "i", "--resources", "gpu=lots")
    assert out.returncode == 2 and "bad quantity" in out.stderr
    out = _cli("manifest", "--hosts", "2", "--image", "i")
    assert out.returncode == 2 and "--name" in out.stderr
    out = _cli()
    assert out.returncode == 2


@pytest.mark.parametrize("module", ["mesharray.bootstrap.k8s.manifests", "mesharray.bootstrap.k8s.yaml",
                                    "mesharray.bootstrap.k8s.discovery", "mesharray.k8s"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
