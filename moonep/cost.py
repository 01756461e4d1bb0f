"""``measure_cost_model``: the planner's ``CostModel`` measured on an EP group, for cost-aware balancing.

Both prices are measured on the group's own devices and transport, with the layer's shapes, through moonep's own
code, and agreed across ranks (the slowest rank's times), so every rank builds the same model and hence the same
plans:

- a routed row costs what one more row costs the EP layer's whole step (forward and backward: dispatch, the
  grouped gated MLP, combine and their backward): the step on an exactly balanced routing of ``tokens`` tokens
  per rank minus the same step on half of them, over the rows per rank that differ (the whole step's average
  row where noise hides the difference). Pricing the row in the layer counts its exchange and layout work, not
  only its GEMMs;
- an expert copy costs the exchanges a replica adds: its weights pushed forward (``Buffer.prefetch_weight``) and
  its fp32 gradients reduced back (``Buffer.reduce_grad``), on a plan that replicates, over the most copies a
  rank takes part in. The exchanges are timed on their own: a difference of two whole layer steps would also
  count the other layout's segment sizes, which are not the copy's.

Each time is a median over ``reps`` rounds of one loop that alternates all of them, so that a slow spell of a
shared host moves the row and the copy price alike. Axes: ``H`` hidden, ``F`` expert FFN size; projections
``w13 [H, 2F]`` and ``w2 [F, H]`` of one expert.
"""

from __future__ import annotations

import statistics
import time

import torch

import planner
from collectives.base import Communicator
from moonep.experts import pools_of, push_replicas
from planner.slack import copies_per_rank


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_times(comm: Communicator, fns, reps: int, device: torch.device) -> list[float]:
    """Median wall seconds of each of ``fns`` over ``reps`` rounds (after one warm-up round), the callables
    alternating with their order flipped every round so that drift hits them alike; each call starts after a
    barrier (collective: the same calls on every rank)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(reps + 1):
        for j in range(len(fns)) if i % 2 else reversed(range(len(fns))):
            comm.barrier()
            _sync(device)
            t0 = time.perf_counter()
            fns[j]()
            _sync(device)
            if i:
                times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _routing(tokens: int, E: int, hot: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [tokens, 2], weights) with exactly equal per-expert counts, except that the first ``hot``
    tokens of every rank send their first slot to expert 0 instead (rank 0's home group grows)."""
    slots = torch.arange(tokens * 2, device=device)
    idx = (slots % E).view(tokens, 2)
    idx[:hot, 0] = torch.where(idx[:hot, 1] == 0, 1, 0)  # a token never picks an expert twice
    return idx, torch.full((tokens, 2), 0.5, device=device)


def _layer(comm: Communicator, H: int, F: int, tokens: int, dtype: torch.dtype, device: torch.device):
    """(an exact-balance MoE layer with 2 experts per rank and top-2, this rank's tokens x [tokens, H])."""
    from moonep.moe import MoE  # heavy: the layer itself (moe does not import this module)

    layer = MoE(comm, H=H, F=F, E=2 * comm.world_size, K=2, S=tokens, dtype=dtype).to(device)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(comm.rank)).to(device, dtype)
    return layer, x


def _row_steps(layer, x, device) -> list:
    """The layer's step (forward and backward) on exactly balanced routings of ``tokens`` and ``tokens // 2``
    tokens per rank (2 slots each, no replica in either), with inputs and routing weights that need grads as in
    training: the backward exchanges are part of a row's price."""
    tokens, E = x.shape[0], layer.E
    cases = [(x[:n].detach().requires_grad_(), *_routing(n, E, 0, device)) for n in (tokens, tokens // 2)]

    def step(xs, idx, w):
        return lambda: layer(xs, topk_idx=idx, topk_weights=w.requires_grad_()).float().sum().backward()

    return [step(*c) for c in cases]


def _row_seconds(full: float, half: float, tokens: int) -> float:
    """Seconds one more routed row per rank costs the step, from the two balanced steps' times."""
    if full > half:
        return (full - half) / (2 * (tokens - tokens // 2))  # balanced: every rank computes 2 rows a token
    return full / (2 * tokens)  # the difference drowned in noise (a tiny layer): the average row instead


def _copy_exchanges(layer, x, device):
    """(the replica exchanges of a plan that replicates: weight push and grad reduce through the layer's own
    Buffer and pools, the most copies a rank takes part in under that plan)."""
    idx, w = _routing(x.shape[0], layer.E, x.shape[0] // 2, device)
    layer(x, topk_idx=idx, topk_weights=w).float().sum().backward()  # the plan of a skewed step
    plan, buf, weights = layer.last_plan, layer.buffer, (layer.w13, layer.w2)
    pools = pools_of(buf, weights, "fused")  # shared with the group's other layers of this shape
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) for t in weights]

    def exchanges():  # the layer's own push (it marks the slots as taken: a layer in flight pushes again)
        push_replicas(buf, plan, ("measure_cost_model",), pools, weights)
        buf.reduce_grad(plan, grads, [p.grads for p in pools])

    p = plan.global_plan
    return exchanges, max(int(copies_per_rank(p.donor, p.experts_to_copy).max()), 1)


def measure_cost_model(
    comm: Communicator,
    *,
    H: int,
    F: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    reps: int = 15,
    tokens: int = 256,
    max_slack: float = 0.5,
    candidates: int = 8,
) -> planner.CostModel:
    """A ``CostModel`` for experts ``w13 [H, 2F]``, ``w2 [F, H]`` of ``dtype`` on ``comm``'s ranks (collective:
    every rank calls it and gets the same model: the slowest rank's row and copy times). ``tokens``: tokens per
    rank of the layer steps that price a row (the layer's own S prices it best: a row's exchange and layout
    costs grow with the step)."""
    if min(H, F, reps, tokens - 1) < 1:
        raise ValueError(f"measure_cost_model needs positive H, F, reps and tokens >= 2, got {(H, F, reps, tokens)}")
    dev = torch.device(device) if device is not None else torch.device(getattr(comm, "device", None) or "cpu")
    tokens = 4 * comm.world_size * max(1, tokens // (4 * comm.world_size))  # equal counts per expert, halved too
    layer, x = _layer(comm, H, F, tokens, dtype, dev)
    fns = _row_steps(layer, x, dev)
    if comm.world_size > 1:  # one rank: no exchange, no replica
        exchanges, copies = _copy_exchanges(layer, x, dev)
        fns.append(exchanges)
    times = _median_times(comm, fns, reps, dev)  # in one alternating loop: a slow spell hits all prices alike
    prices = [_row_seconds(times[0], times[1], tokens), times[2] / copies if len(times) > 2 else 0.0]
    t = torch.tensor(prices, dtype=torch.float64, device=dev)
    comm.all_reduce(t, "max")
    row_s, copy_s = t.tolist()
    return planner.CostModel(row_seconds=row_s, copy_seconds=copy_s, max_slack=max_slack, candidates=candidates)
