"""``verify`` catches every kind of broken plan (each mutation below must raise)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner import PlanVerificationError, plan, verify
from planner.synthetic import zipf_counts


@pytest.fixture()
def good():
    T = zipf_counts(6, 24, 4, 50, 1.5, 7)
    p = plan(T, token_padding=4)
    assert p.num_replicas > 1  # the mutations below need replicas to act on
    verify(p, T)
    return p, T


def _with(p, **arrays):
    return dataclasses.replace(p, **{k: np.asarray(v) for k, v in arrays.items()})


def _mutations(p):
    """(name, broken plan) pairs; each breaks exactly one guarantee."""
    a = p.alloc.copy()
    e, d = np.argwhere((a > 0) & (np.arange(a.shape[0])[:, None] // p.experts_per_rank != np.arange(a.shape[1])))[0]
    h = e // p.experts_per_rank
    a1 = a.copy()
    a1[e, d] -= 1
    a1[e, h] += 1  # one slot back home: conservation holds, balance breaks
    yield "balance", _with(p, alloc=a1)
    a2 = a.copy()
    a2[e, d] += 1  # an extra slot out of nowhere
    yield "conservation", _with(p, alloc=a2)
    c = p.experts_to_copy.copy()
    c[d] = -1
    yield "slots", _with(p, experts_to_copy=c)
    cu = p.cu_seqlens.copy()
    cu[0, -1] += 1
    yield "layout", _with(p, cu_seqlens=cu)
    s = p.send_counts.copy()
    s[0, [0, 1]] = s[0, [1, 0]]
    yield "send", _with(p, send_counts=s)
    dn = p.donor.copy()
    dn[d] = (dn[d] + 1) % p.num_ranks
    yield "donor", _with(p, donor=dn)
    f = p.flows.copy()
    if len(f) > 1:
        f[[0, 1], 2] = f[[1, 0], 2]  # two flows swap destinations: rows land in wrong segments
        yield "flows", _with(p, flows=f)
    yield "recv_rows", dataclasses.replace(p, recv_rows=int(p.cu_seqlens[:, -1].max()) - 1)


def test_every_mutation_is_caught(good):
    """A verifier that passes any of these would let a wrong plan reach the transport."""
    p, T = good
    for name, bad in _mutations(p):
        with pytest.raises(PlanVerificationError):
            verify(bad, T)
        assert name


def test_two_donors_are_caught():
    """A receiver fed by two home ranks breaks the slot bound the transport is sized on."""
    T = np.zeros((3, 3), np.int64)
    T[:, :2] = 3  # experts 0 and 1 carry 9 slots each, expert 2 none; caps are 6
    p = plan(T)
    # balanced and conserving, but rank 2 computes experts of ranks 0 and 1
    bad = dataclasses.replace(p, alloc=np.array([[6, 0, 3], [0, 6, 3], [0, 0, 0]]))
    with pytest.raises(PlanVerificationError, match="one donor"):
        verify(bad, T)


def test_other_counts_are_caught(good):
    """A plan checked against counts it was not built from fails."""
    p, T = good
    T2 = T.copy()
    T2[0, 0] += 1
    with pytest.raises(PlanVerificationError):
        verify(p, T2)
