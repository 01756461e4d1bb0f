"""Wait mode of the torch backend: bounded host waits for CPU (gloo) tensors, stream-ordered waits for CUDA.

Runs without a GPU: a FakeTensor carries CUDA device metadata without memory, and a stub stands in for the
``Work`` object, so the test sees exactly how ``wait`` was called.
"""

from datetime import timedelta

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from collectives.base import CollectiveError
from collectives.torch_backend import TorchCommunicator, _blocks_host


def _cuda_tensor() -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(4, device="cuda")


class StubWork:
    """Records the arguments of ``wait``; raises ``error`` when given one (a watchdog timeout, an abort)."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = [], error

    def wait(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return True


def _bare_comm(timeout: float = 60.0) -> TorchCommunicator:
    """A TorchCommunicator without a process group: enough state for ``_wait`` and ``_failure``."""
    comm = object.__new__(TorchCommunicator)
    comm.store, comm.global_rank, comm.timeout = None, 0, timeout
    return comm


def test_blocks_host_depends_on_the_device():
    assert _blocks_host(torch.zeros(2))  # gloo: bounded host wait
    assert _blocks_host(torch.empty(0, device="meta"))  # not CUDA, so not NCCL
    assert _cuda_tensor().device.type == "cuda" and not _blocks_host(_cuda_tensor())


def test_cpu_wait_is_bounded_cuda_wait_has_no_timeout():
    """Catches: a host sync on every NCCL exchange (a timed wait polls the GPU work from the host)."""
    comm = _bare_comm()
    cpu, cuda = StubWork(), StubWork()
    comm._wait(cpu, "all_reduce", 2.5, torch.zeros(1))
    comm._wait(cuda, "all_reduce", 2.5, _cuda_tensor())
    assert cpu.calls == [((), {"timeout": timedelta(seconds=2.5)})]
    assert cuda.calls == [((), {})]


@pytest.mark.parametrize("make", [torch.zeros, lambda n: _cuda_tensor()], ids=["cpu", "cuda"])
def test_failed_wait_names_the_op(make):
    """A watchdog timeout (CUDA) or a gloo timeout (CPU) becomes a CollectiveError naming the op and its limit."""
    comm = _bare_comm(timeout=45.0)
    work = StubWork(RuntimeError("Wait timed out after 3000 ms\nmore detail"))
    with pytest.raises(CollectiveError, match=r"all_to_all_single on rank 0 failed") as info:
        comm._wait(work, "all_to_all_single", 3.0, make(1))
    limit = "3s" if make is torch.zeros else "45s"  # NCCL is bounded by the group's timeout, gloo by the call's
    assert f"within its {limit} timeout" in str(info.value) and info.value.op == "all_to_all_single"
