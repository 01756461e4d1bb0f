"""Data-parallel gradient reduce-scatter / parameter all-gather in buckets, and what of it the compute hides.

Megatron's DDP packs a rank's parameters into buckets of ``max(40M, 1M x DP)`` parameters
(``DistributedDataParallelConfig.bucket_size``, Megatron-LM ``megatron/core/distributed/
distributed_data_parallel_config.py``: "larger DP sizes need larger buckets to ensure collectives do not become
latency-bound"). With ``overlap_grad_reduce`` a bucket's reduce-scatter starts once the last micro-batch's backward
has produced all its gradients; the buckets are ready in reverse layer order, evenly over that backward, and go one
after another on the DP stream. With ``overlap_param_gather`` the next step's forward waits only for the bucket it
needs: its all-gathers run, in layer order, behind the first micro-batch's forward. ``n`` buckets of total time
``C`` behind a window ``W`` leave ``max(c_last, C - W (n - 1) / n)`` exposed (the last bucket always: the first
layers' gradients come last). Frameworks that shard the gradients (Megatron-FSDP, DeepSpeed ZeRO-2/3, PyTorch
FSDP outside ``no_sync``) send them after every micro-batch's backward instead, ``m`` rounds a step: each earlier
round hides behind its own backward and the forward after it, and only what exceeds that window is exposed (the
DP stream falls behind by it each round). Each bucket pays a ring's latency (``network.ring_latency``, linear in
the ring), so exposure grows with DP at fixed work per replica: the ring latency per bucket and the last bucket's
size grow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from simulator import network as net

BUCKET_MIN_PARAMS = 40_000_000
"""Megatron's default bucket floor (parameters)."""
BUCKET_PARAMS_PER_DP_RANK = 1_000_000
"""Megatron's default bucket growth with the DP size (parameters per DP rank)."""


@dataclass(frozen=True)
class Buckets:
    """One parameter buffer's DP collectives on one rank."""

    count: int
    """Buckets."""
    each_s: float
    """Seconds of one bucket's collective (bandwidth + ring latency)."""

    @property
    def total_s(self) -> float:
        return self.count * self.each_s


def bucket_size(dp: int) -> int:
    """Megatron's default bucket size in parameters for a DP group of ``dp`` ranks."""
    return max(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_DP_RANK * dp)


@lru_cache(maxsize=8192)
def buckets(params: float, bytes_per_param: float, group: net.Group, tiers: net.Tiers, op: str, scale) -> Buckets:
    """``params`` local parameters in default-size buckets, each moved by ``op`` (``reduce_scatter``,
    ``all_gather`` or ``all_reduce``) over ``group``. Kept per arguments: a search's layouts that differ in
    micro-batch or recompute move the same buckets."""
    if params <= 0 or group.n <= 1:
        return Buckets(0, 0.0)
    count = max(1, math.ceil(params / bucket_size(group.n)))
    each = getattr(net, op)(bytes_per_param * params / count, group, tiers, scale)
    return Buckets(count, each)


def exposed(parts: list[Buckets], window: float, *, rounds: int = 1, between: float = 0.0, busy: float = 0.0) -> float:
    """Seconds left after a compute ``window`` by buckets ready evenly over it and sent one after another: at least
    the last bucket, at most all of them. With ``rounds`` > 1 every micro-batch's backward (a ``window`` each)
    sends the buckets again; an earlier round also runs behind the compute that follows it, the ``between`` part
    of the micro-batch before the next backward starts sending, and what it cannot hide there, with the DP
    stream's other work of that micro-batch (``busy``: ZeRO-3's all-gathers), delays the step."""
    parts = [p for p in parts if p.count]
    if not parts:
        return 0.0
    n = sum(p.count for p in parts)
    total = sum(p.total_s for p in parts)
    last = parts[0].each_s  # the first buffer holds the first layers (embedding, dense): ready last
    tail = min(total, max(last, total - max(0.0, window) * (n - 1) / n))
    return tail + (rounds - 1) * max(0.0, total + busy - max(0.0, window) - max(0.0, between))
