"""A fake Kubernetes cluster per test module (see fakecluster.py); the client under test is the real one."""

from __future__ import annotations

import pytest

pytest.importorskip("kubernetes", reason="the k8s tests need the official client: pip install 'mesharray[k8s]'")

from fakecluster import FakeCluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = FakeCluster()
    c.kubeconfig = c.write_kubeconfig(str(tmp_path_factory.mktemp("kube") / "config"))
    yield c
    c.close()


@pytest.fixture
def kubeconfig(cluster, monkeypatch):
    """KUBECONFIG points at the fake cluster; MESHARRAY_SECRET is unset (the Secret is the source)."""
    monkeypatch.setenv("KUBECONFIG", cluster.kubeconfig)
    monkeypatch.delenv("MESHARRAY_SECRET", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return cluster.kubeconfig
