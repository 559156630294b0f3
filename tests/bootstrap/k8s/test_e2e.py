"""End to end against the fake cluster: create → attach → actors and reductions → a pod deleted → detach."""

from __future__ import annotations

import time

import numpy as np
import pytest
from k8s_util import api_connections, free_port, wait_until

import mesharray as ma
from tests.support.actors import Where

pytestmark = pytest.mark.timeout(180)


def test_create_attach_compute_lose_a_pod_and_delete(cluster, api):
    port = free_port()
    hosts = ma.k8s.create("e2e", hosts=3, image="local/python", procs_per_host=2, port=port, timeout=60)
    try:
        assert hosts.sizes == {"hosts": 3}
        assert hosts.host_ids == ["e2e-0", "e2e-1", "e2e-2"]
        assert hosts.addresses == [f"tcp://127.0.0.{ip}:{port}" for ip in
                                   sorted(int(p["status"]["podIP"].rsplit(".", 1)[1])
                                          for p in cluster.pods(selector="mesharray/mesh=e2e"))]
        procs = hosts.spawn_procs()   # --procs-per-host 2 is the default
        assert procs.sizes == {"hosts": 3, "procs": 2}
        w = procs.spawn("where", Where)
        got = np.asarray(w.where.call().get(timeout=60))
        assert [[got[h, p][0] for p in range(2)] for h in range(3)] == [[f"e2e-{h}"] * 2 for h in range(3)]
        x = procs.ones((8,)) * procs.rank_array()
        assert float(np.asarray(x.sum().fetch())) == 8 * sum(range(6))
        np.testing.assert_array_equal(np.asarray(x.sum(axis="hosts").fetch())[:, 0], [6, 9])

        # delete the pod of index 1: its ranks (2, 3) die, the others keep working
        pod = next(p for p in cluster.pods(selector="mesharray/mesh=e2e")
                   if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "1")
        from kubernetes import client

        core = client.CoreV1Api(api)
        t = time.monotonic()
        core.delete_namespaced_pod(pod["metadata"]["name"], "default")
        with pytest.raises(ma.ActorDiedError) as ei:
            while time.monotonic() - t < 10:
                w[1, 0].where.call_one().get(timeout=10)
                time.sleep(0.02)
        assert time.monotonic() - t < 5
        assert 2 in ei.value.ranks
        # the pod watch usually tells first (naming the pod); else the connection's end does
        assert pod["metadata"]["name"] in str(ei.value) or "connection" in str(ei.value)
        assert np.asarray(w[0].where.call().get(timeout=30)).shape == (2,)
        assert np.asarray(w[2].where.call().get(timeout=30)).shape == (2,)
        # the Job replaces the pod, as Kubernetes does
        assert wait_until(lambda: len([p for p in cluster.pods(selector="mesharray/mesh=e2e")
                                       if p["status"].get("phase") == "Running"]) == 3, 15)
        procs.stop()
    finally:
        hosts.detach()
    # detaching deleted the Job (its pods with it), the Service and the Secret
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=e2e"), 15)
    for plural in ("jobs", "services", "secrets"):
        assert cluster.list(plural, "default", "mesharray/mesh=e2e")[0] == []
    assert not cluster.kubelet.procs


def test_two_command_launch_manifest_apply_then_attach_from_a_script(cluster, api, tmp_path):
    """`python -m mesharray k8s manifest ... | kubectl apply -f -`, then a script calling ma.k8s.attach."""
    import subprocess
    import sys

    from kubernetes import utils

    port = free_port()
    out = subprocess.run([sys.executable, "-m", "mesharray", "k8s", "manifest", "--name", "two", "--hosts", "2",
                          "--image", "local/python", "--procs-per-host", "3", "--port", str(port)],
                         capture_output=True, text=True, timeout=60, check=True)
    path = tmp_path / "two.yaml"
    path.write_text(out.stdout)
    # what `kubectl apply -f -` does with it: create each object through the API
    utils.create_from_yaml(api, str(path))
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np, mesharray as ma\n"
        "hosts = ma.k8s.attach('two', namespace='default', timeout=60)\n"   # hosts from the pods' annotation
        "procs = hosts.spawn_procs()\n"                                      # --procs-per-host 3
        "x = procs.ones((4,)) * procs.rank_array()\n"
        "print(hosts.sizes, procs.sizes, hosts.host_ids, float(np.asarray(x.sum().fetch())))\n"
        "procs.stop(); hosts.detach()\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MESHARRAY_SECRET"}
    try:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.split("\n")[0] == ("{'hosts': 2} {'hosts': 2, 'procs': 3} ['two-0', 'two-1'] "
                                             f"{4.0 * sum(range(6))}")
        # the agents serve the next controller: attach again from this process
        hosts = ma.k8s.attach("two", hosts=2, timeout=30)
        assert hosts.host_ids == ["two-0", "two-1"]
        hosts.detach()
    finally:
        # what `kubectl delete job,service,secret -l mesharray/mesh=two` does
        cluster.delete("jobs", "default", "two")
        cluster.delete("services", "default", "two")
        cluster.delete("secrets", "default", "two-secret")
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=two"), 15)


def test_jobset_create_attach_and_delete(cluster, kubeconfig):
    hosts = ma.k8s.create("js", hosts=2, image="local/python", procs_per_host=1, jobset=True, port=free_port(),
                          timeout=60)
    try:
        assert hosts.host_ids == ["js-0", "js-1"]
        assert [j["metadata"]["name"] for j in cluster.list("jobs", "default")[0]
                if j["metadata"]["name"].startswith("js-")] == ["js-hosts-0"]
        procs = hosts.spawn_procs()
        w = procs.spawn("where", Where)
        assert [v[0] for v in np.asarray(w.where.call().get(timeout=30)).ravel()] == ["js-0", "js-1"]
        procs.stop()
    finally:
        hosts.detach()
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=js"), 15)
    assert cluster.list("jobsets", "default")[0] == [] and cluster.list("jobs", "default", "mesharray/mesh=js")[0] == []
    assert cluster.list("secrets", "default", "mesharray/mesh=js")[0] == []


def test_a_pod_that_fails_while_its_processes_still_answer_is_declared_dead(cluster, kubeconfig):
    """A node lost to a partition: no connection ends, but Kubernetes says the pod failed."""
    hosts = ma.k8s.create("part", hosts=2, image="local/python", procs_per_host=1, port=free_port(), timeout=60)
    try:
        procs = hosts.spawn_procs()
        w = procs.spawn("where", Where)
        assert np.asarray(w.where.call().get(timeout=30)).shape == (2, 1)
        pod = next(p for p in cluster.pods(selector="mesharray/mesh=part")
                   if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "1")
        name = pod["metadata"]["name"]
        t = time.monotonic()
        cluster.patch("pods", "default", name, {"status": {"phase": "Failed", "reason": "NodeLost",
                                                           "message": "node fake-node is unreachable"}})
        with pytest.raises(ma.ActorDiedError) as ei:
            while time.monotonic() - t < 10:
                w[1, 0].where.call_one().get(timeout=10)
                time.sleep(0.02)
        assert time.monotonic() - t < 5
        assert ei.value.ranks == (1,) and f"pod {name} (host 1 of mesh 'part') failed" in str(ei.value)
        assert w[0, 0].where.call_one().get(timeout=10)[0] == "part-0"
        procs.stop()
    finally:
        hosts.detach()
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=part"), 15)


def test_create_cleans_up_when_it_cannot_finish(cluster, kubeconfig):
    # an object in the way: nothing is left of what was created before it
    cluster.create("services", "default", {"metadata": {"name": "dup"}, "spec": {"clusterIP": "None"}})
    try:
        with pytest.raises(ma.BootstrapError, match="could not create Service default/dup: 409"):
            ma.k8s.create("dup", hosts=1, image="local/python", timeout=5)
        assert cluster.list("secrets", "default", "mesharray/mesh=dup")[0] == []
        assert cluster.list("jobs", "default", "mesharray/mesh=dup")[0] == []
    finally:
        cluster.delete("services", "default", "dup")
    # pods that never get Ready: the timeout names them, and the objects are deleted
    cluster.kubelet.unschedulable = lambda p: True
    try:
        with pytest.raises(ma.BootstrapError, match=r"index 0 \(pod nogpu-0-\w+ Pending, PodScheduled: Unschedulable"):
            ma.k8s.create("nogpu", hosts=1, image="local/python", resources="gpu=8", timeout=2)
    finally:
        cluster.kubelet.unschedulable = lambda p: False
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=nogpu"), 10)
    for plural in ("jobs", "services", "secrets"):
        assert cluster.list(plural, "default", "mesharray/mesh=nogpu")[0] == []


def test_no_connection_to_the_api_server_outlives_a_detach_or_a_failure(cluster, kubeconfig):
    """``ma.k8s`` closes the client it made when the mesh detaches and when create or attach fail.

    A failure's traceback (kept here by ``pytest.raises``, as by any caller that
    keeps the error) holds the client: its connections would stay open until a
    collection, and a socket collected unclosed is a ResourceWarning.
    """
    hosts = ma.k8s.create("conns", hosts=1, image="local/python", procs_per_host=1, port=free_port(), timeout=60)
    try:
        assert wait_until(lambda: len(api_connections(cluster)) >= 1, 5)  # the pod watch
    finally:
        hosts.detach()
    assert api_connections(cluster) == []
    cluster.create("services", "default", {"metadata": {"name": "taken"}, "spec": {"clusterIP": "None"}})
    try:
        with pytest.raises(ma.BootstrapError, match="409") as failed_create:
            ma.k8s.create("taken", hosts=1, image="local/python", timeout=5)
    finally:
        cluster.delete("services", "default", "taken")
    with pytest.raises(ma.BootstrapError, match="not ready after 1 s") as failed_attach:
        ma.k8s.attach("nothing", hosts=1, timeout=1)
    assert api_connections(cluster) == []
    assert failed_create.value.__cause__ is not None and failed_attach.value is not None  # (both still alive)
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=conns"), 15)
