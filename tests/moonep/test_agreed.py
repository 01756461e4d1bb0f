"""Shapes agreed on every rank (issue 17): a Buffer built differently on one rank, an impossible
total_num_tokens on one rank, and a plan handed to another Buffer all fail with a clear error, on every rank,
within the timeout (real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import moonep
import planner
from collectives import launch

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out


def _buffer_rank(comm, case: str) -> str:
    kw = {"S": 8, "H": 4, "K": 2, "E": 2 * comm.world_size}
    if comm.rank == 1:
        if case == "K":
            kw["K"] = 1
        elif case == "dtype":
            kw["dtype"] = torch.bfloat16
        elif case == "cost":
            kw["cost"] = planner.CostModel(row_seconds=1.0, copy_seconds=2.0)
    try:
        moonep.Buffer(comm, **kw)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"rank {comm.rank}: a Buffer differing in {case} was accepted")


@pytest.mark.parametrize("case", ["K", "dtype", "cost"])
def test_buffers_that_differ_across_ranks_are_refused_on_every_rank(case: str):
    msg = launch(_buffer_rank, 2, timeout=20, job_timeout=60, case=case)  # rank 0: its rank was right
    assert "ranks build different Buffers" in msg and case in msg, msg


def _total_rank(comm) -> str:
    buf = moonep.Buffer(comm, S=4, H=4, K=1, E=comm.world_size)
    x, idx = torch.zeros(4, 4), torch.zeros(4, 1, dtype=torch.long)
    total = 2**64 if comm.rank == 1 else 4 * comm.world_size
    try:
        buf.dispatch(x, topk_idx=idx, total_num_tokens=total)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"rank {comm.rank}: total_num_tokens=2**64 was accepted")


def test_impossible_total_fails_on_every_rank():
    msg = launch(_total_rank, 2, timeout=20, job_timeout=60)
    assert "rank 1" in msg and "total_num_tokens" in msg, msg


def _foreign_plan_rank(comm) -> str:
    a = moonep.Buffer(comm, S=4, H=4, K=1, E=comm.world_size)
    b = moonep.Buffer(comm, S=4, H=4, K=1, E=comm.world_size)
    x, idx = torch.zeros(4, 4), torch.zeros(4, 1, dtype=torch.long)
    _, _, _, plan = a.dispatch(x, topk_idx=idx)
    w = torch.zeros(1, 3)
    for call in (lambda: b.prefetch_weight(plan, w, torch.zeros(1, 3)), lambda: b.reduce_grad(plan, w, w.clone())):
        try:
            call()
        except ValueError as e:
            assert "plan must be the CommPlan this Buffer's dispatch returned" in str(e), e
        else:
            raise AssertionError("another Buffer's plan was accepted")
    return "ok"


def test_a_plan_is_refused_by_another_buffer():
    assert launch(_foreign_plan_rank, 2, timeout=20, job_timeout=60) == "ok"
