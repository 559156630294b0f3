"""Finding a mesh's pods: the rules on plain pod dicts, and the real client against the fake cluster."""

from __future__ import annotations

import sys
import time

import pytest
from k8s_util import wait_until

from mesharray.bootstrap import k8s as K
from mesharray.errors import BootstrapError

pytestmark = pytest.mark.timeout(120)

INDEX = K.INDEX_KEY


def pod(index, name=None, phase="Running", ready=True, ip=None, created="2026-01-01T00:00:00Z", deleting=False,
        hosts=None, label=True):
    meta = {"name": name or f"m-{index}-x", "uid": f"uid-{name or index}", "creationTimestamp": created,
            "labels": {K.MESH_LABEL: "m", **({INDEX: str(index)} if label else {})},
            "annotations": {INDEX: str(index), **({"mesharray/hosts": str(hosts)} if hosts else {})}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if phase == "Running":
        status["podIP"] = ip or f"10.0.0.{10 + index}"
    return {"metadata": meta, "status": status,
            "spec": {"containers": [{"name": "host", "ports": [{"name": "mesharray", "containerPort": 26600}]}]}}


def test_pods_out_of_order_come_back_ordered_by_index():
    found, why = K.pick_hosts([pod(2), pod(0), pod(3), pod(1)], 4)
    assert why == "" and [h.index for h in found] == [0, 1, 2, 3]
    assert [h.url for h in found] == [f"tcp://10.0.0.{10 + i}:26600" for i in range(4)]


def test_a_restarted_pod_is_served_by_its_newest_ready_successor():
    pods = [pod(0), pod(1, "m-1-old", phase="Failed", created="2026-01-01T00:00:00Z"),
            pod(1, "m-1-new", ip="10.0.0.99", created="2026-01-01T00:05:00Z")]
    found, _ = K.pick_hosts(pods, 2)
    assert found[1].name == "m-1-new" and found[1].ip == "10.0.0.99"
    # a pod being deleted never serves, even when it is still Ready
    found, why = K.pick_hosts([pod(0), pod(1, deleting=True)], 2)
    assert found is None and "index 1" in why and "being deleted" in why
    # finished pods neither
    found, why = K.pick_hosts([pod(0), pod(1, phase="Succeeded")], 2)
    assert found is None and "Succeeded" in why


def test_missing_and_pending_indices_are_named():
    pending = pod(2, phase="Pending", ready=False)
    pending["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
    found, why = K.pick_hosts([pod(0), pending], 4)
    assert found is None
    assert why.startswith("1 of 4 hosts ready; not ready: ")
    assert "index 1 (no pod)" in why and "index 3 (no pod)" in why
    assert "index 2 (pod m-2-x Pending, PodScheduled: Unschedulable 0/3 nodes" in why


def test_the_size_comes_from_the_annotation_when_not_given():
    found, _ = K.pick_hosts([pod(1, hosts=2), pod(0, hosts=2)], None)
    assert [h.index for h in found] == [0, 1]
    found, why = K.pick_hosts([pod(0, hosts=3)], None)
    assert found is None and "1 of 3" in why
    assert K.pick_hosts([], None) == (None, "no pod of the mesh yet")


def test_the_index_label_or_annotation():
    assert K.pod_index(pod(5)) == 5
    assert K.pod_index(pod(5, label=False)) == 5
    assert K.pod_index({"metadata": {}}) is None


# --------------------------------------------------------------------------- against the fake cluster


def _pod_manifest(mesh: str, index: int, hosts: int, name: str | None = None) -> dict:
    return {"metadata": {"name": name or f"{mesh}-{index}", "labels": {K.MESH_LABEL: mesh, INDEX: str(index)},
                         "annotations": {INDEX: str(index), "mesharray/hosts": str(hosts)}},
            "spec": {"containers": [{"name": "host", "image": "img",
                                     "command": ["python", "-c", "import time; time.sleep(120)"],
                                     "ports": [{"name": "mesharray", "containerPort": 26600}]}]}}


def test_watching_finds_pods_created_in_any_order(cluster, api):
    try:
        for i in (2, 0):
            cluster.create("pods", "default", _pod_manifest("order", i, 3))
        # the last one comes while the discovery already watches
        import threading

        def later():
            wait_until(lambda: any("watch=true" in p for _, p in cluster.requests), 20)
            cluster.create("pods", "default", _pod_manifest("order", 1, 3))

        t = threading.Thread(target=later)
        t.start()
        found = K.wait_for_hosts(api, "order", "default", None, timeout=30)
        t.join()
        assert [(h.index, h.name) for h in found] == [(0, "order-0"), (1, "order-1"), (2, "order-2")]
        # the requests carried the label selector (the fake serves only what it selects)
        assert any("labelSelector=mesharray/mesh%3Dorder" in p and "watch=true" in p.lower()
                   for _, p in cluster.requests)
    finally:
        for p in cluster.pods(selector=f"{K.MESH_LABEL}=order"):
            cluster.delete("pods", "default", p["metadata"]["name"])
        assert wait_until(lambda: not cluster.pods(selector=f"{K.MESH_LABEL}=order"), 10)


def test_an_expired_watch_lists_again(cluster, api):
    """410 Gone (the server compacted the version the watch asked for): list again, then watch from there."""
    import threading

    cluster.compacted = 10**9  # every watch from a version expires
    try:
        cluster.create("pods", "default", _pod_manifest("gone", 0, 2))

        def later():
            wait_until(lambda: any("watch=true" in p and "gone" in p for _, p in cluster.requests), 20)
            cluster.compacted = 0
            cluster.create("pods", "default", _pod_manifest("gone", 1, 2))

        t = threading.Thread(target=later)
        t.start()
        found = K.wait_for_hosts(api, "gone", "default", 2, timeout=30)
        t.join()
        assert [h.name for h in found] == ["gone-0", "gone-1"]
        lists = [p for m, p in cluster.requests if "gone" in p and "watch" not in p]
        assert len(lists) >= 2  # listed again after the expired watch
    finally:
        cluster.compacted = 0
        for p in cluster.pods(selector=f"{K.MESH_LABEL}=gone"):
            cluster.delete("pods", "default", p["metadata"]["name"])
        assert wait_until(lambda: not cluster.pods(selector=f"{K.MESH_LABEL}=gone"), 10)


def test_a_restarted_pod_is_found_through_the_api(cluster, api):
    try:
        cluster.create("pods", "default", _pod_manifest("restart", 0, 2))
        cluster.create("pods", "default", _pod_manifest("restart", 1, 2, name="restart-1-old"))
        assert wait_until(lambda: len([p for p in cluster.pods(selector=f"{K.MESH_LABEL}=restart")
                                       if p["status"].get("phase") == "Running"]) == 2, 10)
        cluster.kubelet.kill_container("restart-1-old")  # the container dies: the pod fails
        assert wait_until(lambda: cluster.get("pods", "default", "restart-1-old")["status"]["phase"] == "Failed", 10)
        time.sleep(1.1)  # creation timestamps have a resolution of one second, as in Kubernetes
        cluster.create("pods", "default", _pod_manifest("restart", 1, 2, name="restart-1-new"))
        found = K.wait_for_hosts(api, "restart", "default", 2, timeout=30)
        assert [h.name for h in found] == ["restart-0", "restart-1-new"]
    finally:
        for p in cluster.pods(selector=f"{K.MESH_LABEL}=restart"):
            cluster.delete("pods", "default", p["metadata"]["name"])
        assert wait_until(lambda: not cluster.pods(selector=f"{K.MESH_LABEL}=restart"), 10)


def test_a_pod_stuck_pending_times_out_naming_the_missing_indices(cluster, api):
    cluster.kubelet.unschedulable = lambda p: p["metadata"]["name"] == "stuck-1"
    try:
        for i in range(3):
            cluster.create("pods", "default", _pod_manifest("stuck", i, 4))
        t = time.monotonic()
        with pytest.raises(BootstrapError) as ei:
            K.wait_for_hosts(api, "stuck", "default", 4, timeout=2)
        assert 1.5 < time.monotonic() - t < 10
        msg = str(ei.value)
        assert "'stuck'" in msg and "not ready after 2 s" in msg and "2 of 4 hosts ready" in msg
        assert "index 1 (pod stuck-1 Pending, PodScheduled: Unschedulable" in msg
        assert "index 3 (no pod)" in msg
    finally:
        cluster.kubelet.unschedulable = lambda p: False
        for p in cluster.pods(selector=f"{K.MESH_LABEL}=stuck"):
            cluster.delete("pods", "default", p["metadata"]["name"])
        assert wait_until(lambda: not cluster.pods(selector=f"{K.MESH_LABEL}=stuck"), 10)


def test_api_errors_are_bootstrap_errors_naming_the_answer(cluster, tmp_path, monkeypatch):
    bad = cluster.write_kubeconfig(str(tmp_path / "bad"))
    path = tmp_path / "bad"
    path.write_text(path.read_text().replace("fake-cluster-token", "wrong-token"))
    api = K.load_api(kubeconfig=bad)
    try:
        with pytest.raises(BootstrapError, match="401"):
            K.wait_for_hosts(api, "any", "default", 1, timeout=2)
    finally:
        K.close_api(api)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(BootstrapError, match="kubeconfig"):
        K.load_api()


def test_importing_mesharray_imports_no_kubernetes_and_a_missing_client_names_the_extra():
    import subprocess

    code = ("import sys, mesharray as ma; ma.k8s; import mesharray.k8s; assert 'kubernetes' not in sys.modules, "
            "'imported'; sys.modules['kubernetes'] = None\n"
            "try:\n    ma.k8s.attach('x', timeout=1)\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'mesharray[k8s]'" in out.stdout
