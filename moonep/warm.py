"""Importing this module puts moonep's compiled CPU kernels into the process: ``planner.warm``'s plans and the
compiled send layout (``moonep.layout_cpu``) that ``Buffer`` runs on CPU tensors. Without numba it does nothing.

A process that launches many short jobs lists it in ``MOONEP_LAUNCH_PRELOAD`` (``collectives.warm_start``; the
test suite does): the forkserver compiles or loads the kernels once, and no rank forked from it loads its own.
"""

from __future__ import annotations

import torch

import planner.warm
from moonep.layout_cpu import HAS_NUMBA, send_layout_cpu
from planner.core import plan


def warm() -> None:
    """One send layout of a tensor plan: rank 0's four tokens, top-2, routed as ``COUNTS``' first row says."""
    tensor_plan = plan(torch.tensor(planner.warm.COUNTS))
    send_layout_cpu(tensor_plan, 0, torch.tensor([[0, 3], [0, 3], [0, 2], [0, 0]]))


if HAS_NUMBA:
    warm()
