"""The parallelism contract, with torch's real DistributedDataParallel over gloo ranks: EP training wrapped in
DDP (experts ignored, expert grads scaled by 1/dp) equals single-process training on the whole batch, step by
step; wrapping without ignoring the experts fails on the first forward, on every rank, saying what to do."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import moonep
from collectives import launch
from moonep.reference import naive_experts

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out

H, F, K, S, LR, STEPS = 8, 4, 2, 6, 0.1, 2


class Net(nn.Module):
    """dense -> MoE -> dense; the MoE holds this rank's experts."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(H, H), moe, nn.Linear(H, 3)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(S, H, generator=torch.Generator().manual_seed(1000 * step + rank))


def _reference(net: Net, w13: torch.Tensor, w2: torch.Tensor, R: int) -> dict:
    """Single-process training on every rank's tokens (loss = mean over all of them): final params by name."""
    inp, out, router = (copy.deepcopy(m) for m in (net.inp, net.out, net.moe.router))
    w13, w2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    dense = {"inp": inp, "out": out, "moe.router": router}
    opt = torch.optim.SGD([p for m in dense.values() for p in m.parameters()] + [w13, w2], lr=LR)
    for step in range(STEPS):
        x = torch.cat([_batch(r, step) for r in range(R)])
        h = inp(x)
        idx, w = router(h)
        opt.zero_grad()
        (out(naive_experts(h, idx, w, w13, w2)) ** 2).sum(-1).mean().backward()
        opt.step()
    got = {f"{m}.{n}": p.detach() for m, mod in dense.items() for n, p in mod.named_parameters()}
    return {**got, "moe.w13": w13.detach(), "moe.w2": w2.detach()}


def _ddp_rank(comm, ignore: bool):
    R, r = comm.world_size, comm.rank
    E = 4 * R
    g = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(E, H, 2 * F, generator=g) / H**0.5, torch.randn(E, F, H, generator=g) / F**0.5
    torch.manual_seed(0)  # the replicated parts start equal on every rank
    net = Net(moonep.MoE.from_weights(comm, w13, w2, K=K, S=S))
    ref = _reference(net, w13, w2, R)
    if ignore:
        assert moonep.ignore_in_ddp(net) == ["moe.w13", "moe.w2"]
    ddp = nn.parallel.DistributedDataParallel(net, process_group=comm.group)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    try:
        for step in range(STEPS):
            opt.zero_grad()
            (ddp(_batch(r, step)) ** 2).sum(-1).mean().backward()
            moonep.scale_expert_grads(net, 1 / R)  # the mean over R ranks' losses
            opt.step()
    except ValueError as e:
        return str(e)
    mine = slice(r * E // R, (r + 1) * E // R)
    diffs = []
    for n, p in net.named_parameters():
        want = ref[n][mine] if n in ("moe.w13", "moe.w2") else ref[n]
        diffs.append(float((p - want).abs().max()) / (float(want.abs().max()) or 1.0))
    assert len(diffs) == len(ref), sorted(ref)
    return max(diffs)


def test_ddp_with_experts_ignored_equals_single_process_training():
    assert launch(_ddp_rank, 2, timeout=30, job_timeout=120, ignore=True) < 1e-5


def test_ddp_replicating_experts_fails_on_every_rank():
    msg = launch(_ddp_rank, 2, timeout=30, job_timeout=120, ignore=False)
    assert "DistributedDataParallel replicates expert parameters" in msg and "ignore_in_ddp" in msg, msg
