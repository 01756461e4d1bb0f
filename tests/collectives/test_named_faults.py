"""Faults named rightly, on real gloo ranks through the launcher: a barrier is validated like the other collectives,
the rank that never arrives is named on timeout, dtype mismatches speak torch dtype names, and a rank that ends
itself mid-job with os._exit is not mistaken for one that failed to start."""

from __future__ import annotations

import os
import time

import pytest
import torch

from collectives import CollectiveError, LaunchError, launch
from tests.collectives.conftest import needs_mpi

pytestmark = pytest.mark.spawns  # every test here starts rank processes: make test-fast leaves them out


def _outcome(fn) -> str:
    try:
        fn()
    except (ValueError, CollectiveError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def barrier_against_all_reduce(comm, out: str):
    """Rank 0 calls barrier while rank 1 calls all_reduce: before validation this was a hang, then a timeout
    that blamed rank 0. Both ranks record what they got."""
    if comm.rank == 0:
        msg = _outcome(lambda: comm.barrier(timeout=10))
    else:
        msg = _outcome(lambda: comm.all_reduce(torch.ones(1), timeout=10))
    with open(os.path.join(out, f"rank{comm.rank}.txt"), "w") as f:
        f.write(msg)
    comm.barrier()  # the header exchange kept the ranks in step: the group is still usable
    return "ok"


def test_barrier_is_validated_on_every_rank(tmp_path):
    t0 = time.monotonic()
    assert launch(barrier_against_all_reduce, 2, timeout=20, job_timeout=60, out=str(tmp_path)) == "ok"
    assert time.monotonic() - t0 < 15, "must fail at the header exchange, not at a timeout"
    for rank in range(2):
        msg = (tmp_path / f"rank{rank}.txt").read_text()
        assert msg.startswith("ValueError: ") and "{0: 'barrier', 1: 'all_reduce'}" in msg, msg


def late_rank_1(comm, op: str):
    """Rank 1 sleeps past rank 0's 1 s timeout before joining; rank 0's error must name rank 1."""
    if comm.rank == 1:
        time.sleep(3.0)
        return _outcome(lambda: comm.all_reduce(torch.ones(1), timeout=1.0))
    if op == "barrier":
        return _outcome(lambda: comm.barrier(timeout=1.0))
    return _outcome(lambda: comm.all_reduce(torch.ones(2), timeout=1.0))


@pytest.mark.parametrize("op", ["barrier", "all_reduce"])
def test_rank_that_never_arrives_is_named(op):
    """Would catch the old message ('no rank reported an error') with nobody named, or rank 0 blamed."""
    t0 = time.monotonic()
    msg = launch(late_rank_1, 2, timeout=20, job_timeout=60, op=op)
    assert time.monotonic() - t0 < 15
    assert msg.startswith(f"CollectiveError: {op} on rank 0: rank(s) [1] never reached it"), msg
    assert "no answer within its 1s timeout" in msg, msg


def test_rank_that_never_arrives_is_named_under_mpi():
    """The MPI backend ends a timed-out job (its collectives cannot be cancelled); its message names the late rank
    from the group's shared arrival counts. Would catch the old 'a peer is dead, stuck, or called a different
    collective' with nobody named."""
    needs_mpi()
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(late_rank_1, 2, backend="mpi", timeout=20, job_timeout=60, op="barrier")
    assert time.monotonic() - t0 < 15
    assert info.value.rank == 0, str(info.value)
    want = "barrier on rank 0 did not complete within its 1s timeout (rank(s) [1] never reached it"
    assert want in info.value.details, info.value.details


def dtype_mismatch(comm):
    t = torch.ones(4, dtype=torch.float32 if comm.rank == 0 else torch.float64)
    msg = _outcome(lambda: comm.all_reduce(t, timeout=10))
    everyone = [None] * comm.world_size
    for r in range(comm.world_size):  # every rank's message, gathered through the (still usable) group
        buf = torch.zeros(400, dtype=torch.uint8)
        raw = msg.encode()[:400]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        comm.broadcast(buf, src=r)
        everyone[r] = bytes(buf.tolist()).rstrip(b"\0").decode()
    return everyone


def test_dtype_mismatch_names_dtypes_on_every_rank():
    """Would catch the internal codes of the header ('[1, 2]') reaching the user."""
    for rank, msg in enumerate(launch(dtype_mismatch, 2, timeout=20, job_timeout=60)):
        assert msg.startswith(f"ValueError: all_reduce on rank {rank}: ranks disagree on dtype"), msg
        assert "rank 0 torch.float32, rank 1 torch.float64" in msg, msg


def exits_mid_job(comm):
    comm.barrier()
    if comm.rank == 1:
        os._exit(3)
    time.sleep(30)  # the launcher must end the job at rank 1's exit, not after this
    return "unreachable"


def test_early_exit_is_not_called_a_start_failure():
    """os._exit(3) inside fn was reported as 'failed while starting ... lacks a __main__ guard'."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(exits_mid_job, 2, timeout=20, job_timeout=60)
    assert time.monotonic() - t0 < 20
    assert info.value.rank == 1
    details = info.value.details
    assert details.startswith("exited with status 3 while running tests.collectives.test_named_faults.exits_mid_job")
    assert "without raising a Python exception" in details and "__main__" not in details
