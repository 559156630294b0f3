"""End to end against the fake cluster: create → attach → actors and reductions → a pod deleted → detach."""

from __future__ import annotations

import time

import numpy as np
import pytest
from actors import Where
from conftest import free_port, wait_until

import mesharray as ma

pytestmark = pytest.mark.timeout(180)


def test_create_attach_compute_lose_a_pod_and_delete(cluster, kubeconfig):
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
        from kubernetes import client, config

        core = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        t = time.monotonic()
        core.delete_namespaced_pod(pod["metadata"]["name"], "default")
        with pytest.raises(ma.ActorDiedError) as ei:
            while time.monotonic() - t < 10:
                w[1, 0].where.call_one().get(timeout=10)
                time.sleep(0.02)
        assert time.monotonic() - t < 5
        assert 2 in ei.value.ranks
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
