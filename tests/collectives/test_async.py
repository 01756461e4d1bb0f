"""``all_to_all_single_start``: asynchronous all-to-all on real ranks (gloo and MPI), two in flight at once.

Two exchanges with different uneven splits are started back to back, then waited in order; each must equal
what the blocking all_to_all_single gives. Bad splits are refused locally, before anything is posted."""

from __future__ import annotations

import pytest
import torch

from collectives import Pending, launch
from tests.collectives.conftest import needs_mpi

pytestmark = pytest.mark.spawns  # every test here starts rank processes: make test-fast leaves them out


def _splits(R: int, rank: int, salt: int) -> tuple[list[int], list[int]]:
    """(in_splits of this rank, out_splits of this rank) for a deterministic uneven pattern."""
    n = [[(3 * q + 5 * d + salt) % 4 for d in range(R)] for q in range(R)]  # rows rank q sends to rank d
    return n[rank], [n[q][rank] for q in range(R)]


def _async_rank(comm) -> list[str]:
    R, r, bad = comm.world_size, comm.rank, []
    started = []
    for salt, width, dtype in ((1, 3, torch.float32), (2, 5, torch.int64)):
        ins, outs = _splits(R, r, salt)
        inp = (torch.arange(sum(ins) * width).reshape(-1, width) + 1000 * r + 100 * salt).to(dtype)
        out = torch.full((sum(outs), width), -1, dtype=dtype)
        want = torch.empty_like(out)
        comm.all_to_all_single(want, inp, outs, ins)
        started.append((comm.all_to_all_single_start(out, inp, outs, ins), out, want))
    for i, (pending, out, want) in enumerate(started):
        assert isinstance(pending, Pending)
        pending.wait()
        pending.wait()  # a second wait does nothing
        if not torch.equal(out, want):
            bad.append(f"exchange {i} differs from the blocking one on rank {r}")
    try:
        comm.all_to_all_single_start(torch.empty(2, 1), torch.empty(3, 1), [1] * R, [1] * R)
        bad.append("bad splits were accepted")
    except ValueError as e:
        if "in_splits" not in str(e) and "out_splits" not in str(e):
            bad.append(f"unclear error: {e}")
    return bad


@pytest.mark.parametrize("backend,world_size", [("torch", 2), ("torch", 3), ("mpi", 2), ("mpi", 3)])
def test_two_exchanges_in_flight_equal_the_blocking_ones(backend: str, world_size: int):
    if backend == "mpi":
        needs_mpi()
    assert launch(_async_rank, world_size, backend=backend, timeout=30, job_timeout=120) == []
