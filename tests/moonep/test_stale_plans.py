"""Plans know the dispatch that made them, and the settings that shape an exchange agree across ranks (issue 28),
on real gloo ranks: a stale plan (the previous step's) handed to ``combine`` or ``redispatch`` is the same error on
every rank, also when only one rank passes it; Buffers at different dispatch counts are refused by the next
dispatch; an expert FFN width F or a weight dtype that differs across ranks, and a bad E on one rank, are one
clear error on every rank before any row moves (not 1e19 outputs, not "connection reset")."""

from __future__ import annotations

import pytest
import torch

import moonep
from collectives import launch

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out


def _routing(comm, seed: int, s: int = 6, K: int = 2):
    g = torch.Generator().manual_seed(seed * 10 + comm.rank)
    E = 2 * comm.world_size
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)])
    return torch.randn(s, 4, generator=g), idx


def _error(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    raise AssertionError("accepted")


def _stale_plan_rank(comm) -> dict:
    buf = moonep.Buffer(comm, S=6, H=4, K=2, E=2 * comm.world_size)
    x1, idx1 = _routing(comm, 1)
    recv1, _, _, plan1 = buf.dispatch(x1, topk_idx=idx1)
    out1, _ = buf.combine(plan1, recv1)  # the latest plan: fine
    torch.testing.assert_close(out1, 2 * x1)  # each token's two copies, summed unweighted
    x2, idx2 = _routing(comm, 2)
    recv2, _, _, plan2 = buf.dispatch(x2, topk_idx=idx2)
    seen = {"both": _error(lambda: buf.combine(plan1, recv2))}
    seen["redispatch"] = _error(lambda: buf.redispatch(plan1, x2))
    # one rank alone passes the stale plan: its sizes match, so only the generation can tell
    seen["one"] = _error(lambda: buf.combine(plan1 if comm.rank == 1 else plan2, recv2))
    out2, _ = buf.combine(plan2, recv2)  # the group is still usable: nothing moved
    torch.testing.assert_close(out2, 2 * x2)
    # a backward after later dispatches says so
    out_old, _ = buf.combine(plan1, recv1, any_step=True)
    torch.testing.assert_close(out_old, 2 * x1)
    return seen


def test_a_stale_plan_is_refused_on_every_rank():
    seen = launch(_stale_plan_rank, 2, timeout=20, job_timeout=90)
    for case in ("both", "redispatch"):
        assert "rank 0: plan comes from dispatch #1 of this Buffer but its latest is #2" in seen[case], seen
    assert "moonep.combine: rank 1" in seen["one"] and "earlier dispatch" in seen["one"], seen


def _generation_rank(comm) -> str:
    a = moonep.Buffer(comm, S=6, H=4, K=2, E=2 * comm.world_size)
    b = moonep.Buffer(comm, S=6, H=4, K=2, E=2 * comm.world_size)
    x, idx = _routing(comm, 3)
    (a if comm.rank == 0 else b).dispatch(x, topk_idx=idx)  # rank 1 dispatches on another Buffer
    msg = _error(lambda: a.dispatch(x, topk_idx=idx))
    assert "different dispatch counts [2, 1]" in msg, msg
    return msg


def test_buffers_at_different_dispatch_counts_are_refused():
    assert "skipped or repeated a dispatch" in launch(_generation_rank, 2, timeout=20, job_timeout=60)


def _layer_error(comm, case: str) -> str:
    kw = {"H": 4, "F": 16, "E": 2 * comm.world_size, "K": 2, "S": 6}
    if case == "F" and comm.rank == 1:
        kw["F"] = 32
    if case == "E" and comm.rank == 1:
        kw["E"] = 3  # not a multiple of R: only this rank can tell
    if case == "dtype":  # the weights pushed to replicas, in another dtype on rank 1
        dtype = torch.float64 if comm.rank == 1 else torch.float32
        w13, w2 = torch.randn(kw["E"], 4, 32, dtype=dtype), torch.randn(kw["E"], 16, 4, dtype=dtype)
        return _error(lambda: moonep.MoE.from_weights(comm, w13, w2, K=2, S=6))
    if case == "weights":  # malformed weights on rank 1 only: its check runs after the ranks meet
        w13 = torch.randn(kw["E"], 4, 32 if comm.rank == 0 else 30)
        return _error(lambda: moonep.MoE.from_weights(comm, w13, torch.randn(kw["E"], 16, 4), K=2, S=6))
    return _error(lambda: moonep.MoE(comm, **kw))


def _layer_rank(comm, case: str, every: list[str], rank1: list[str]) -> str:
    msg = _layer_error(comm, case)
    assert all(w in msg for w in every + (rank1 if comm.rank == 1 else [])), f"rank {comm.rank}: {msg}"
    return msg


@pytest.mark.parametrize(
    "case, every, rank1",
    [
        ("F", ["ranks build different MoEs (F differ", "F: ['16', '32']"], []),
        ("dtype", ["dtype differ", "torch.float32', 'torch.float64"], []),
        ("E", ["moonep.MoE: rank 1: E=3"], ["multiple of the EP group size R=2"]),
        ("weights", ["moonep.MoE: rank 1:"], ["w13 [E or epn, H, 2F]"]),
    ],
)
def test_layer_settings_agree_before_any_rank_leaves(case: str, every: list[str], rank1: list[str]):
    launch(_layer_rank, 2, timeout=20, job_timeout=60, case=case, every=every, rank1=rank1)


def _bad_buffer_rank(comm) -> str:
    E = 3 if comm.rank == 1 else 2 * comm.world_size
    msg = _error(lambda: moonep.Buffer(comm, S=6, H=4, K=2, E=E))
    assert msg.startswith("moonep.Buffer: rank 1: E=3"), msg
    return msg


def test_a_bad_size_on_one_rank_is_named_on_every_rank():
    assert "rank 1" in launch(_bad_buffer_rank, 2, timeout=20, job_timeout=60)
