"""Accept what the wrapped libraries accept: a ``collectives.Communicator``, or a torch ``ProcessGroup``."""
from __future__ import annotations


def as_communicator(group):
    """A Communicator for ``group`` (returned as is when it already is one)."""
    from collectives import Communicator

    if isinstance(group, Communicator):
        return group
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        from collectives.torch_backend import TorchCommunicator

        return TorchCommunicator(group)
    raise ValueError(f"expected a collectives.Communicator or a torch ProcessGroup, got {type(group).__name__}")
