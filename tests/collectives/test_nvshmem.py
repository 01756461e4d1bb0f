"""NVSHMEM backend: importable everywhere, a clear error without a GPU, real checks on one."""
import pytest
import torch

from collectives import launch
from collectives.nvshmem_backend import NVSHMEMCommunicator, nvshmem_available
from tests.collectives import battery

AVAILABLE, REASON = nvshmem_available()


@pytest.mark.skipif(AVAILABLE, reason="this machine has a GPU and nvshmem4py")
def test_construction_without_gpu_raises_clear_error():
    with pytest.raises(RuntimeError, match="NVSHMEM backend unavailable"):
        NVSHMEMCommunicator(bootstrap=None)


def gpu_all_to_all(comm):
    """All-to-all with uneven splits between GPUs (several PEs may share one GPU)."""
    w, r = comm.world_size, comm.rank
    ins = [battery.split(r, j, w, 0) for j in range(w)]
    outs = [battery.split(i, r, w, 0) for i in range(w)]
    inp = torch.cat([battery._rows_for(r, j, ins[j], 3, torch.bfloat16) for j in range(w)]).cuda()
    out = torch.zeros(sum(outs), 3, dtype=torch.bfloat16, device="cuda")
    comm.all_to_all_single(out, inp, outs, ins)
    want = torch.cat([battery._rows_for(i, r, outs[i], 3, torch.bfloat16) for i in range(w)])
    gathered = torch.empty(2 * w, 5, dtype=torch.float32, device="cuda")
    comm.all_gather(gathered, battery._rows_for(r, r, 2, 5, torch.float32).cuda())
    ok_gather = torch.equal(gathered.cpu(), torch.cat([battery._rows_for(i, i, 2, 5, torch.float32)
                                                       for i in range(w)]))
    comm.barrier()
    result = torch.equal(out.cpu(), want) and ok_gather
    comm.close()
    return result


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON or "NVSHMEM unavailable")
@pytest.mark.parametrize("world_size", [1, 2])
def test_nvshmem_all_to_all_on_gpu(world_size):
    assert launch(gpu_all_to_all, world_size, backend="nvshmem", timeout=60, job_timeout=300)
