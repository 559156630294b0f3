"""A fake Kubernetes cluster per test module (see fakecluster.py); the client under test is the real one."""

from __future__ import annotations

import pytest

pytest.importorskip("kubernetes", reason="the k8s tests need the official client: pip install 'mesharray[k8s]'")

from fakecluster import FakeCluster  # noqa: E402
from k8s_util import api_connections, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = FakeCluster()
    c.kubeconfig = c.write_kubeconfig(str(tmp_path_factory.mktemp("kube") / "config"))
    yield c
    try:
        # every client closed its connections, none left to the collector (a socket collected open is a
        # ResourceWarning, raised in whichever later test happens to collect it)
        assert wait_until(lambda: not api_connections(c), 5), f"connections left open: {api_connections(c)}"
    finally:
        c.close()


@pytest.fixture
def kubeconfig(cluster, monkeypatch):
    """KUBECONFIG points at the fake cluster; MESHARRAY_SECRET is unset (the Secret is the source)."""
    monkeypatch.setenv("KUBECONFIG", cluster.kubeconfig)
    monkeypatch.delenv("MESHARRAY_SECRET", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return cluster.kubeconfig


@pytest.fixture
def api(kubeconfig):
    """A client of the fake cluster; closed after the test (its pool's connections would stay open until collected)."""
    from mesharray.bootstrap import k8s as K

    a = K.load_api()
    yield a
    K.close_api(a)
