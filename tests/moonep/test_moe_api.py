"""The MoE layer as a drop-in, over real gloo ranks: your own routing, existing weights, S growing on demand,
per-rank token counts without total_num_tokens, and clear errors on every rank for a bad router or input width."""

from __future__ import annotations

import pytest
import torch

import moonep
from collectives import launch
from moonep.reference import naive_experts

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out

H, F, K = 8, 4, 2


def _weights(E: int):
    g = torch.Generator().manual_seed(3)
    return torch.randn(E, H, 2 * F, generator=g) / H**0.5, torch.randn(E, F, H, generator=g) / F**0.5


def _own_routing_rank(comm) -> float:
    """from_weights (all E experts given) + bring-your-own routing with per-rank s and S=None: output and x grad
    equal the dense twin on this rank's tokens."""
    R, r = comm.world_size, comm.rank
    E = 4 * R
    w13, w2 = _weights(E)
    layer = moonep.MoE.from_weights(comm, w13, w2, K=K)  # S=None: grows
    errs = []
    for s in (3 + r, 17 + 5 * r):  # the second call exceeds what the first sized: every rank grows
        g = torch.Generator().manual_seed(50 + r + s)
        x = torch.randn(s, H, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)])
        w = torch.rand(s, K, generator=g) + 0.1
        y = layer(x, topk_idx=idx, topk_weights=w)
        y.sum().backward()
        xr = x.detach().clone().requires_grad_()
        want = naive_experts(xr, idx, w, w13, w2)
        want.sum().backward()
        errs += [float((y - want).abs().max()), float((x.grad - xr.grad).abs().max())]
    assert max(17 + 5 * q for q in range(R)) == layer.buffer.S, layer.buffer.S
    return max(errs)


def test_own_routing_existing_weights_growing_capacity_varlen():
    assert launch(_own_routing_rank, 2, timeout=30, job_timeout=120) < 1e-5


def _three(x2):
    return None, None, None


def _wide(x2):
    return torch.zeros(x2.shape[0], K + 1, dtype=torch.long), torch.ones(x2.shape[0], K + 1)


def _bad_rank(comm, case: str) -> str:
    router = {"router_three": _three, "router_shape": _wide}.get(case)
    layer = moonep.MoE(comm, H=H, F=F, E=4 * comm.world_size, K=K, S=8, router=router)
    x = torch.randn(4, H)
    if case == "width" and comm.rank == 1:
        x = torch.randn(4, H // 2)  # only rank 1 is wrong; its peer must not be left in the all-gather
    try:
        layer(x)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError(f"rank {comm.rank}: no error for {case}")
    if case == "width" and comm.rank == 1 and "hidden" not in msg:
        raise AssertionError(f"the wrong rank's message does not name the input: {msg}")
    return msg


def test_bad_router_and_width_fail_on_every_rank_with_the_problem_named():
    for case, words in (
        ("router_three", "router must return (topk_idx [s, K], topk_weights [s, K]); it returned tuple of 3"),
        ("router_shape", "topk_idx must be a tensor [s=4, K=2]"),
        ("width", "rank 1"),  # rank 0's input is fine: it names the rank whose input is not
    ):
        msg = launch(_bad_rank, 2, timeout=30, job_timeout=60, case=case)
        assert words in msg, msg
