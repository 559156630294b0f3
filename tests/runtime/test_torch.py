"""CPU torch tensors as endpoint arguments and results: out-of-band, through the data plane."""

from __future__ import annotations

import pytest

import mesharray as ma
from mesharray.runtime.router import get_router
from tests.support.actors import TorchProbe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(90)

MIB16 = 4 << 20  # float32 elements


@pytest.fixture(scope="module")
def tp():
    with ma.proc_mesh(hosts=1, procs=1, forward_logs=False) as procs:
        yield procs.spawn("tp", TorchProbe).slice(procs=0)


def _conn(mesh):
    return get_router().channels[mesh._addresses[mesh._shape.rank(0)]].conn


def test_a_worker_that_never_saw_a_tensor_has_not_imported_torch():
    with ma.proc_mesh(hosts=1, procs=1, forward_logs=False) as procs:
        t = procs.spawn("t", TorchProbe).slice(procs=0)
        assert t.echo.call_one([1, 2]).get(timeout=10) == [1, 2]
        assert t.has_module.call_one("torch").get(timeout=10) is False
        t.describe.call_one(torch.ones(2)).get(timeout=10)
        assert t.has_module.call_one("torch").get(timeout=10) is True


def test_16mib_tensor_round_trip_goes_through_shared_memory(tp):
    x = torch.arange(MIB16, dtype=torch.float32)
    conn = _conn(tp)
    tp.echo.call_one(torch.zeros(1)).get(timeout=10)
    out0, in0 = conn.bytes_out, conn.bytes_in
    y = tp.echo.call_one(x).get(timeout=30)
    sent, received = conn.bytes_out - out0, conn.bytes_in - in0
    assert type(y) is torch.Tensor and y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y, x)
    # 16 MiB each way, but only descriptors and a small pickle on the socket
    assert sent < 4096, sent
    assert received < 4096, received
    z = tp.plus1.call_one(x).get(timeout=30)  # a new tensor made by the actor comes back the same way
    assert torch.equal(z, x + 1)
    assert conn.bytes_in - in0 - received < 4096


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "complex64"])
def test_dtype_and_shape_are_kept(tp, dtype):
    dt = getattr(torch, dtype)
    x = (torch.arange(24) % 7).to(dt).reshape(2, 3, 4)
    y = tp.echo.call_one(x).get(timeout=10)
    assert y.dtype == dt and y.shape == (2, 3, 4) and y.stride() == (12, 4, 1)
    assert torch.equal(y, x)
    assert tp.describe.call_one(x).get(timeout=10) == ("Tensor", f"torch.{dtype}", (2, 3, 4), (12, 4, 1),
                                                      False, True)


def test_non_contiguous_tensor_arrives_as_a_contiguous_copy(tp):
    base = torch.arange(200_000, dtype=torch.float64).reshape(400, 500)
    x = base.t()[:, ::3]
    assert not x.is_contiguous()
    name, dtype, shape, stride, rg, contig = tp.describe.call_one(x).get(timeout=10)
    assert shape == tuple(x.shape) and contig and stride == (x.shape[1], 1)
    assert torch.equal(tp.echo.call_one(x).get(timeout=10), x)


def test_requires_grad_flag_is_kept_history_is_not(tp):
    w = torch.ones(3, requires_grad=True)
    x = w * 2  # non-leaf
    name, dtype, shape, stride, rg, contig = tp.describe.call_one(x).get(timeout=10)
    assert rg is True
    y = tp.echo.call_one(x).get(timeout=10)
    assert y.requires_grad and y.is_leaf and y.grad_fn is None
    assert torch.equal(y.detach(), x.detach())


def test_zero_dim_and_empty_tensors(tp):
    assert torch.equal(tp.echo.call_one(torch.tensor(2.5)).get(timeout=10), torch.tensor(2.5))
    e = tp.echo.call_one(torch.empty(0, 5, dtype=torch.int32)).get(timeout=10)
    assert e.shape == (0, 5) and e.dtype == torch.int32


def test_parameter_and_tensors_inside_containers(tp):
    p = torch.nn.Parameter(torch.ones(4))
    out = tp.echo.call_one({"p": p, "ts": [torch.zeros(2), torch.ones(1 << 16)]}).get(timeout=10)
    assert isinstance(out["p"], torch.nn.Parameter) and torch.equal(out["p"].detach(), p.detach())
    assert torch.equal(out["ts"][1], torch.ones(1 << 16))
