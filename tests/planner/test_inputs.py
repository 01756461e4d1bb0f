"""Bad input is refused with a ValueError that names the problem."""

from __future__ import annotations

import numpy as np
import pytest

from planner import plan
from planner.synthetic import zipf_counts
from tests.planner.loads import Topo

T = zipf_counts(4, 8, 2, 10, 1.0, 0)


@pytest.mark.parametrize(
    "counts, match",
    [
        (np.array([[1, -2], [3, 4]]), "non-negative"),
        (np.array([[1.5, 2.0], [3.0, 4.0]]), "integer"),
        (np.array([[True, False], [True, True]]), "integer"),
        (np.array(["a", "b"]), "integer|2-D"),
        (np.arange(4), "2-D"),
        (np.ones((2, 2, 2), np.int64), "2-D"),
        (np.ones((3, 4), np.int64), "E % R"),
        (np.ones((0, 4), np.int64), "at least one"),
    ],
)
def test_bad_counts(counts, match):
    with pytest.raises(ValueError, match=match):
        plan(counts)


def test_bad_caps():
    total = int(T.sum())
    with pytest.raises(ValueError, match="sum"):
        plan(T, caps=[total, 0, 0, 1])
    with pytest.raises(ValueError, match=r"shape \[R\]"):
        plan(T, caps=[total, 0, 0])
    with pytest.raises(ValueError, match="non-negative"):
        plan(T, caps=[total + 1, -1, 0, 0])
    with pytest.raises(ValueError, match="integer"):
        plan(T, caps=[total - 0.5, 0.5, 0, 0])


def test_uneven_caps_that_no_single_donor_can_fill():
    """caps that put every row on one rank cannot be met with one donor per receiver."""
    T = np.ones((3, 3), np.int64)  # each home group holds 3 rows
    with pytest.raises(ValueError, match="too uneven"):
        plan(T, caps=[9, 0, 0])


def test_bad_previous_and_options():
    with pytest.raises(ValueError, match="previous plan has shape"):
        plan(T, previous=plan(zipf_counts(2, 8, 2, 10, 1.0, 0)))
    with pytest.raises(ValueError, match="previous must be a Plan"):
        plan(T, previous=T)
    with pytest.raises(ValueError, match="token_padding"):
        plan(T, token_padding=0)
    with pytest.raises(ValueError, match="slots_per_rank"):
        plan(T, slots_per_rank=0)


def test_too_few_slots_is_named():
    """With fewer slots than epn a receiver can need more replicas than it has; the error says which rank."""
    T = np.zeros((2, 8), np.int64)
    T[0, :4] = 10  # rank 1 must take 20 rows, more than any single expert of rank 0 holds
    with pytest.raises(ValueError, match="replica slots"):
        plan(T, slots_per_rank=1)


def test_bad_topology():
    with pytest.raises(ValueError, match="ranks"):
        plan(T, topology=Topo(3, 2))
    with pytest.raises(ValueError, match="does not divide"):
        plan(T, topology=3)
    with pytest.raises(ValueError, match="node_of"):
        plan(T, topology=object())


def test_counts_beyond_int32_tables_are_refused():
    """Plan tables are int32 (bounded by one rank's rows); larger counts must fail loudly, not wrap."""
    T = np.zeros((2, 2), np.int64)
    T[0, 0] = 2**31
    with pytest.raises(ValueError, match="too large"):
        plan(T)
    T[0, 0] = 2**31 - 1  # fits one entry, but caps = ceil(total / 2) still fits too
    assert plan(T).alloc.sum() == 2**31 - 1
