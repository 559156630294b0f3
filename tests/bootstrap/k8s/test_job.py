"""``ma.job.KubernetesJob`` against the fake cluster: detach leaves the objects, the next process re-attaches to
the same pods, ``job status`` reads them, ``kill`` deletes them (``ma.k8s.create``'s detach still deletes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from k8s_util import free_port, wait_until

import mesharray as ma
from tests.support.actors import Where

pytestmark = pytest.mark.timeout(180)

ROOT = str(Path(__file__).resolve().parents[3])


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "mesharray", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=90)


def test_kubernetes_job_outlives_a_detach_and_kill_deletes_it(cluster, kubeconfig, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = ma.job.KubernetesJob(meshes={"workers": 2}, image="local/python", namespace="default", name="kj",
                               procs_per_host=1, port=free_port())
    try:
        hosts = job.state(cached_path="job.json", timeout=60).workers
        assert job.id == "kj" and hosts.host_ids == ["kj-workers-0", "kj-workers-1"]
        procs = hosts.spawn_procs(env={"K8S_JOB_VAR": "x"})   # --procs-per-host 1
        w = procs.spawn("where", Where)
        got = np.asarray(w.where.call().get(timeout=60))
        assert [got[h, 0][0] for h in range(2)] == ["kj-workers-0", "kj-workers-1"]
        x = procs.ones((4,)) * procs.rank_array()
        assert float(np.asarray(x.sum().fetch())) == 4.0
        procs.stop()
        uids = sorted(p["metadata"]["uid"] for p in cluster.pods(selector="mesharray/mesh=kj-workers"))
        hosts.detach()
        # the objects stay; the saved job re-attaches to the same pods
        assert cluster.list("jobs", "default", "mesharray/mesh=kj-workers")[0] != []
        again = ma.job.load("job.json").state().workers
        assert again.host_ids == ["kj-workers-0", "kj-workers-1"]
        assert sorted(p["metadata"]["uid"] for p in cluster.pods(selector="mesharray/mesh=kj-workers")) == uids
        again.detach()
        st = _cli("job", "status", "job.json", cwd=tmp_path)
        assert st.returncode == 0 and "kind:  kubernetes" in st.stdout and "state: running" in st.stdout, st
        assert "kj-workers-0 tcp://127.0.0." in st.stdout
        killed = _cli("job", "kill", "job.json", cwd=tmp_path)
        assert killed.returncode == 0, killed.stderr
    finally:
        job.kill()
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=kj-workers"), 15)
    for plural in ("jobs", "services", "secrets"):
        assert cluster.list(plural, "default", "mesharray/mesh=kj-workers")[0] == []
    st = _cli("job", "status", "job.json", cwd=tmp_path)
    assert st.returncode == 1


def test_kubernetes_job_checks_its_names_before_creating_anything():
    with pytest.raises(ValueError, match="bad mesh name"):
        ma.job.KubernetesJob(meshes={"workers": 1}, image="img", name="Not_DNS")
    with pytest.raises(ValueError, match="image must name"):
        ma.job.KubernetesJob(meshes={"workers": 1}, image="")


def test_a_job_whose_pods_wait_shows_why_and_honours_the_timeout(cluster, kubeconfig, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    cluster.kubelet.unschedulable = lambda p: True
    job = ma.job.KubernetesJob(meshes={"workers": 1}, image="local/python", name="kwait", resources="gpu=8",
                               port=free_port())
    try:
        with pytest.raises(ma.BootstrapError, match=r"Kubernetes job kwait is not ready after the timeout: "
                                                    r"workers: 0 of 1 hosts ready; not ready: index 0 \(pod "
                                                    r"kwait-workers-0-\w+ Pending, PodScheduled: Unschedulable"):
            job.state(cached_path="job.json", timeout=2)
        assert "mesharray: Kubernetes job kwait pending: workers: 0 of 1 hosts ready" in capfd.readouterr().err
        assert _cli("job", "status", "job.json", cwd=tmp_path).returncode == 0  # pending is alive
    finally:
        cluster.kubelet.unschedulable = lambda p: False
        job.kill()
    assert wait_until(lambda: not cluster.pods(selector="mesharray/mesh=kwait-workers"), 15)
