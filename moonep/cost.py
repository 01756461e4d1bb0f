"""``measure_cost_model``: the planner's ``CostModel`` measured on an EP group, for cost-aware balancing.

A routed row costs the grouped gated MLP's GEMMs (forward and backward); an expert copy costs the exchanges a
replica adds to a step: its weights pushed forward (``Buffer.prefetch_weight``, one all-to-all per projection)
and its fp32 gradients reduced back (``Buffer.reduce_grad``). Both are timed here on the group's own devices and
transport, with the layer's shapes, and agreed across ranks (the slowest rank's times), so every rank builds the
same model and hence the same plans.

Axes: ``H`` hidden, ``F`` expert FFN size; projections ``w13 [H, 2F]`` and ``w2 [F, H]`` of one expert.
"""

from __future__ import annotations

import statistics
import time

import torch

import planner


def _median_seconds(fn, reps: int, device: torch.device) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls (after one warm-up), synchronised on CUDA."""
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row_seconds(H: int, F: int, dtype: torch.dtype, device: torch.device, rows: int, reps: int) -> float:
    """Seconds per routed row of a gated MLP forward and backward: the forward GEMMs timed, times 3 (the
    backward computes two GEMMs for each forward one)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, H, generator=g).to(device, dtype)
    w13 = torch.randn(H, 2 * F, generator=g).to(device, dtype)
    w2 = torch.randn(F, H, generator=g).to(device, dtype)
    h = torch.empty(rows, 2 * F, dtype=dtype, device=device)
    y = torch.empty(rows, H, dtype=dtype, device=device)

    def forward():
        torch.mm(x, w13, out=h)
        torch.mm(h[:, :F], w2, out=y)

    return 3 * _median_seconds(forward, reps, device) / rows


def _copy_seconds(comm, H: int, F: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    """Seconds of one replica's exchanges: each projection's weights (dtype) to the next rank, then its fp32
    grads back, with the layer's all-to-all calls (every rank sends one copy: the busiest pattern per rank)."""
    R, r = comm.world_size, comm.rank
    to_next = [1 if d == (r + 1) % R else 0 for d in range(R)]
    from_prev = [1 if q == (r - 1) % R else 0 for q in range(R)]
    shapes = ((H * 2 * F), (F * H))
    bufs = [
        (torch.zeros(1, n, dtype=dt, device=device), torch.empty(1, n, dtype=dt, device=device))
        for n in shapes
        for dt in (dtype, torch.float32)
    ]

    def exchange():
        for src, dst in bufs:
            comm.all_to_all_single(dst, src, from_prev, to_next, validate=False)

    return _median_seconds(exchange, reps, device)


def measure_cost_model(
    comm,
    *,
    H: int,
    F: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    rows: int = 512,
    reps: int = 5,
    max_slack: float = 0.5,
    candidates: int = 8,
) -> planner.CostModel:
    """A ``CostModel`` for experts ``w13 [H, 2F]``, ``w2 [F, H]`` of ``dtype`` on ``comm``'s ranks (collective:
    every rank calls it and gets the same model: the slowest rank's row and copy times)."""
    if min(H, F, rows, reps) < 1:
        raise ValueError(f"measure_cost_model needs positive H, F, rows and reps, got {(H, F, rows, reps)}")
    dev = torch.device(device) if device is not None else torch.device(getattr(comm, "device", None) or "cpu")
    t = torch.tensor(
        [_row_seconds(H, F, dtype, dev, rows, reps), _copy_seconds(comm, H, F, dtype, dev, reps)],
        dtype=torch.float64,
        device=dev,
    )
    comm.all_reduce(t, "max")
    row_s, copy_s = t.tolist()
    return planner.CostModel(row_seconds=row_s, copy_seconds=copy_s, max_slack=max_slack, candidates=candidates)
