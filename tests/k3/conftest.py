"""Shared fixtures: an in-process world-size-1 communicator (the same code path as many ranks)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def comm1():
    """World size 1 over gloo in this process; reuses torch.distributed if another test set it up."""
    import torch.distributed as dist

    from collectives import init
    from collectives.torch_backend import TorchCommunicator

    torch.set_num_threads(1)
    if dist.is_initialized():
        yield TorchCommunicator(None)
        return
    comm = init("torch")
    yield comm
    comm.close()
