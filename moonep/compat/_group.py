"""Accept what the wrapped libraries accept: a ``collectives.Communicator``, or a torch ``ProcessGroup``."""

from __future__ import annotations

import torch.distributed as dist

from collectives import Communicator
from collectives.torch_backend import TorchCommunicator


def as_communicator(group: object) -> Communicator:
    """A Communicator for ``group`` (returned as is when it already is one)."""
    if isinstance(group, Communicator):
        return group
    if isinstance(group, dist.ProcessGroup):
        return TorchCommunicator(group)
    raise ValueError(f"expected a collectives.Communicator or a torch ProcessGroup, got {type(group).__name__}")
