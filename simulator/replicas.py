"""Replica experts a ``moonep`` plan moves to the busiest receiving EP rank, per layer.

Shared by the layer costs (``costs``: the replica-weight traffic), the host model (``host``: one expert segment
per filled replica slot) and the memory model (``memory``: the replica weight and gradient buffers), so it sits
below all three. Priced by ``planner.plan`` on a synthetic load with the requested ``maxvio`` when the planner is
importable (``replica_model`` says which), otherwise by the closed-form upper bound ``min(E/EP, ceil(maxvio E/EP))``.
"""

from __future__ import annotations

import math
from functools import lru_cache

from simulator.modelspec import ModelSpec
from simulator.parallel import ParallelConfig


def replicas_per_rank(spec: ModelSpec, par: ParallelConfig) -> int:
    """Replica experts a ``moonep`` plan moves to the busiest receiving EP rank per layer (0 when balanced).

    Priced by ``planner.plan`` on a synthetic load with the requested ``maxvio`` when the planner is importable
    (``replica_model`` says which); otherwise the closed-form upper bound ``min(E/EP, ceil(maxvio E/EP))``.
    """
    if par.dispatcher != "moonep" or not spec.is_moe or par.ep == 1 or par.maxvio <= 0:
        return 0
    return _replicas(spec.num_experts, par.ep, round(par.maxvio, 4))[0]


def replica_model() -> str:
    """``planner`` when replica traffic is priced by ``planner.plan``, else ``closed-form``."""
    import importlib.util  # optional: only to ask whether the planner is installed

    return "planner" if importlib.util.find_spec("planner") is not None else "closed-form"


@lru_cache(maxsize=256)
def _replicas(E: int, R: int, maxvio: float) -> tuple[int, str]:
    epn = E // R
    bound = min(epn, math.ceil(maxvio * epn - 1e-9))
    if replica_model() != "planner" or maxvio >= R - 1:
        return bound, "closed-form"
    import numpy as np  # heavy: numpy, only to build the planner's input

    import planner  # optional: planner (replica_model checked it imports)

    # Rank 0's experts are hot so that its load is (1 + maxvio) x the mean; inside it popularity halves
    # expert by expert (a realistic hot-expert shape); every source rank routes the same distribution.
    w_hot = (1 + maxvio) * (R - 1) / (R - 1 - maxvio)
    inner = 0.5 ** np.arange(epn)
    p = np.ones(E)
    p[:epn] = w_hot * epn * inner / inner.sum()
    rows = np.round(4096 * 16 * p / p.sum()).astype(np.int64)
    plan = planner.plan(np.tile(rows, (R, 1)))
    return int((plan.experts_to_copy >= 0).sum(axis=1).max()), "planner"
