"""Measured peak memory of tensor storage on any device, CPU included (torch keeps allocator statistics only for
CUDA): ``PeakBytes`` is a ``TorchDispatchMode`` that counts every storage an operator creates while it is active
and releases it when the storage is freed.

    with PeakBytes() as mem:
        layer(x).sum().backward()
    mem.peak  # most bytes alive at once that were allocated inside the block

Storages that existed before the block (parameters, preallocated buffers) are not counted: add them yourself.
Views, in-place and ``out=`` results share an input's storage and are not new bytes. Operators the autograd engine
runs in the backward on this thread are seen too. The mode costs Python time per operator: measure peak memory in
a run of its own, not in a timed one.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakBytes(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while this mode is active."""

    def __init__(self):
        super().__init__()
        self.current = 0
        """Bytes allocated inside the block and still alive."""
        self.peak = 0
        """Most bytes alive at once since the block started."""
        self._live: dict[int, int] = {}  # id(storage) -> bytes; storage PyObjects are preserved while alive

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in inputs:  # not a view / in-place / out=
                    self._track(storage)
        return out


def peak_bytes(fn) -> int:
    """Peak bytes of the storages ``fn()`` allocates (``PeakBytes`` around one call)."""
    with PeakBytes() as mem:
        fn()
    return mem.peak


__all__ = ["PeakBytes", "peak_bytes"]
