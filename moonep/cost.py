"""``measure_cost_model``: the planner's ``CostModel`` measured on an EP group, for cost-aware balancing.

A routed row costs the expert step's grouped gated MLP (forward and backward, timed through moonep's own
code); an expert copy costs the exchanges a replica adds to a step: its weights pushed forward
(``Buffer.prefetch_weight``, one all-to-all per projection) and its fp32 gradients reduced back
(``Buffer.reduce_grad``). Both are timed here on the group's own devices and
transport, with the layer's shapes, and agreed across ranks (the slowest rank's times), so every rank builds the
same model and hence the same plans. The copy is priced inside the layer (a step that replicates minus a
balanced one), because on a shared host an isolated exchange misses what the copy costs the step.

Axes: ``H`` hidden, ``F`` expert FFN size; projections ``w13 [H, 2F]`` and ``w2 [F, H]`` of one expert.
"""

from __future__ import annotations

import statistics
import time

import torch

import planner
from planner.slack import copies_per_rank

from .experts import gated_backward, gated_forward


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
    """Seconds per routed row of the expert step's grouped gated MLP, forward and backward (one segment of
    ``rows`` rows through ``moonep.experts``' own forward and backward)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, H, generator=g).to(device, dtype)
    ws = (torch.randn(1, H, 2 * F, generator=g).to(device, dtype), torch.randn(1, F, H, generator=g).to(device, dtype))
    dy, segs = torch.randn(rows, H, generator=g).to(device, dtype), ((0, 0, rows),)

    def step():
        _, pre = gated_forward(x, ws, segs)
        gated_backward(x, ws, segs, pre, dy)

    return _median_seconds(step, reps, device) / rows


def _routing(tokens: int, E: int, hot: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [tokens, 2], weights) with exactly equal per-expert counts, except that the first ``hot``
    tokens of every rank send their first slot to expert 0 instead (rank 0's home group grows)."""
    slots = torch.arange(tokens * 2, device=device)
    idx = (slots % E).view(tokens, 2)
    idx[:hot, 0] = torch.where(idx[:hot, 1] == 0, 1, 0)  # a token never picks an expert twice
    return idx, torch.full((tokens, 2), 0.5, device=device)


def _copy_seconds(comm, H: int, F: int, dtype: torch.dtype, device: torch.device, reps: int, tokens: int) -> float:
    """Seconds one replica costs where it is paid: the EP layer's step (forward and backward) on a routing whose
    exact plan replicates, minus the same step on an exactly balanced routing (same rows on every rank, no
    replica), alternating, divided by the most copies a rank takes part in. In place, it counts what an
    isolated exchange misses: the weight push and grad reduce competing with the step's own traffic and work."""
    from .moe import MoE  # heavy: the layer itself (moe does not import this module)

    R = comm.world_size
    if R == 1:
        return 0.0
    tokens, E = 2 * R * max(1, tokens // (2 * R)), 2 * R  # equal per-expert counts need tokens % (2R) == 0
    layer = MoE(comm, H=H, F=F, E=E, K=2, S=tokens, dtype=dtype).to(device)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(comm.rank)).to(device, dtype)
    cases = [_routing(tokens, E, hot, device) for hot in (0, tokens // 2)]
    times, copies = [[], []], 0
    for i in range(reps + 1):
        for j in (0, 1) if i % 2 else (1, 0):
            idx, w = cases[j]
            comm.barrier()
            t0 = time.perf_counter()
            layer(x, topk_idx=idx, topk_weights=w).float().sum().backward()
            if i:
                times[j].append(time.perf_counter() - t0)
            if j == 1:
                p = layer.last_plan.global_plan
                copies = int(copies_per_rank(p.donor, p.experts_to_copy).max())
    return max(0.0, statistics.median(times[1]) - statistics.median(times[0])) / max(copies, 1)


def measure_cost_model(
    comm,
    *,
    H: int,
    F: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    rows: int = 512,
    reps: int = 15,
    tokens: int = 256,
    max_slack: float = 0.5,
    candidates: int = 8,
) -> planner.CostModel:
    """A ``CostModel`` for experts ``w13 [H, 2F]``, ``w2 [F, H]`` of ``dtype`` on ``comm``'s ranks (collective:
    every rank calls it and gets the same model: the slowest rank's row and copy times). ``rows``: the segment
    that prices a row; ``tokens``: tokens per rank of the layer step that prices a copy (the layer's own S prices
    it best: a copy competes with that step's traffic)."""
    if min(H, F, rows, reps, tokens) < 1:
        raise ValueError(
            f"measure_cost_model needs positive H, F, rows, reps and tokens, got {(H, F, rows, reps, tokens)}"
        )
    dev = torch.device(device) if device is not None else torch.device(getattr(comm, "device", None) or "cpu")
    t = torch.tensor(
        [_row_seconds(H, F, dtype, dev, rows, reps), _copy_seconds(comm, H, F, dtype, dev, reps, tokens)],
        dtype=torch.float64,
        device=dev,
    )
    comm.all_reduce(t, "max")
    row_s, copy_s = t.tolist()
    return planner.CostModel(row_seconds=row_s, copy_seconds=copy_s, max_slack=max_slack, candidates=candidates)
