"""moonep.peak_memory.PeakBytes: measured peak bytes of the storages a block allocates (CPU included)."""

import gc

import torch

from moonep.peak_memory import PeakBytes, peak_bytes

MB = 1 << 20


def test_peak_is_the_most_alive_at_once_not_the_total():
    def fn():
        a = torch.ones(MB // 4)  # 1 MiB
        b = torch.ones(2 * MB // 4)  # 3 MiB alive
        del a  # 2 MiB alive
        c = torch.ones(MB // 4)  # 3 MiB alive again
        return b, c

    with PeakBytes() as mem:
        keep = fn()
    assert mem.peak == 3 * MB and mem.current == 3 * MB
    del keep
    gc.collect()
    assert mem.current == 0


def test_views_in_place_and_existing_storage_are_not_new_bytes():
    base = torch.ones(MB // 4)
    out = torch.empty(MB // 4)

    def fn():
        v = base.view(4, -1).t()  # view of pre-existing storage
        base.mul_(2.0)  # in place
        torch.add(base, 1.0, out=out)  # out=
        return v[:, 0].clone()  # one new row of 256 KiB

    assert peak_bytes(fn) == MB // 4


def test_backward_allocations_are_seen_and_released():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(1024, 256)
    with PeakBytes() as mem:
        (x @ w).relu().sum().backward()
    gc.collect()
    assert w.grad is not None and mem.current == w.grad.nbytes  # made by the backward; all the rest freed
    assert mem.peak >= 2 * 1024 * 256 * 4  # the product and its relu, alive together


def test_nothing_counted_outside_the_block():
    with PeakBytes() as mem:
        pass
    torch.ones(MB)
    assert mem.peak == 0 and mem.current == 0
