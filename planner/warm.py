"""Importing this module puts the planner's compiled CPU kernels into the process: compiled, or loaded from
numba's cache. Without numba it does nothing.

For a process that forks many short-lived ranks: list it in ``MOONEP_LAUNCH_PRELOAD`` (``collectives.warm_start``,
or ``moonep.warm``, which imports it) and the forkserver holds the machine code once; every rank forked from it
plans without loading a kernel of its own. Otherwise each rank loads it from numba's cache at its first plan
(about 0.2 s per rank per job), and on a machine whose cache is empty (a fresh clone) the ranks of the first jobs
each compile it (about 20 s of a core each) until one has written the cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from planner._jit import HAS_NUMBA
from planner.core import plan
from planner.slack import CostModel

COUNTS = [[5, 0, 1, 2], [0, 3, 2, 1], [1, 1, 1, 1], [4, 0, 0, 0]]
"""[R=4, E=4] slot counts: skewed enough that the exact plan makes replicas (so every step of the kernel runs)."""


def warm() -> None:
    """Plan ``COUNTS`` in every form: numpy and tensor counts, each with a previous plan of its kind, with slack
    and with a cost model, and a numpy plan over two nodes (``host_plan`` hands the kernel one argument type for
    all of them; a form that came to differ would compile here, not in each rank: ``tests/moonep/test_warm.py``)."""
    for counts in (np.array(COUNTS, np.int64), torch.tensor(COUNTS)):
        _plan_every_option(counts)
    plan(np.array(COUNTS, np.int64), topology=2)


def _plan_every_option(counts: Any) -> None:
    """``counts`` planned exactly, with slack and with a cost model, each again with its first plan as previous."""
    cost = CostModel(row_seconds=1e-6, copy_seconds=1e-5)
    plan(counts, previous=plan(counts))
    plan(counts, slack=0.1, previous=plan(counts, slack=0.1))
    plan(counts, cost=cost, previous=plan(counts, cost=cost))


if HAS_NUMBA:
    warm()
