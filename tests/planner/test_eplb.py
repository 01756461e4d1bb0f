"""``rebalance_experts``: DeepSeek EPLB semantics (README example, placement invariants, policy choice)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import rebalance_experts

README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


def test_eplb_readme_worked_example():
    """The only hard-coded expectation: EPLB's README output for this input."""
    phy2log, log2phy, logcnt = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert log2phy.shape == (2, 12, int(logcnt.max()))


@st.composite
def eplb_inputs(draw):
    nodes = draw(st.integers(1, 3))
    gpus = nodes * draw(st.integers(1, 3))
    groups = draw(st.integers(1, 4)) * (nodes if draw(st.booleans()) else 1)
    E = groups * draw(st.integers(1, 3))
    per_gpu = -(-E // gpus) + draw(st.integers(0, 2))
    layers = draw(st.integers(1, 3))
    w = np.array(draw(st.lists(st.integers(0, 500), min_size=layers * E, max_size=layers * E))).reshape(layers, E)
    return w, gpus * per_gpu, groups, nodes, gpus


@settings(max_examples=60, deadline=None)
@given(eplb_inputs())
def test_placement_invariants(args):
    """Every expert has >= 1 replica, counts add up, each GPU gets exactly its slots, maps are inverse."""
    w, replicas, groups, nodes, gpus = args
    if replicas // nodes < w.shape[1] // nodes and groups % nodes == 0:
        return  # a node would hold fewer slots than its logical experts: EPLB's own precondition
    phy2log, log2phy, logcnt = rebalance_experts(w, replicas, groups, nodes, gpus)
    L, E = w.shape
    assert phy2log.shape == (L, replicas) and logcnt.shape == (L, E)
    assert (logcnt >= 1).all() and (logcnt.sum(1) == replicas).all()
    for layer in range(L):
        assert np.array_equal(np.bincount(phy2log[layer], minlength=E), logcnt[layer])
        for e in range(E):
            slots = log2phy[layer, e][log2phy[layer, e] >= 0]
            assert slots.size == logcnt[layer, e] and (phy2log[layer, slots] == e).all()


def test_equal_loads_get_one_replica_each_and_hot_expert_gets_most():
    phy2log, _, logcnt = rebalance_experts(np.full((1, 8), 10), 8, 1, 1, 4)
    assert (logcnt == 1).all()
    w = np.array([[1, 1, 1, 50, 1, 1, 1, 1]])
    _, _, logcnt = rebalance_experts(w, 16, 1, 1, 4)
    assert logcnt[0].argmax() == 3 and logcnt[0, 3] == logcnt.max()


def test_groups_not_divisible_by_nodes_fall_back_to_global():
    w = np.array(README_WEIGHT)
    a = rebalance_experts(w, 16, 3, 2, 8)
    b = rebalance_experts(w, 16, 1, 1, 8)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    out = rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    assert all(isinstance(t, torch.Tensor) for t in out)
    assert out[0].tolist()[0][:4] == [5, 6, 5, 7]


@pytest.mark.parametrize(
    "args, match",
    [
        ((15, 4, 2, 8), "multiple of num_gpus"),
        ((16, 4, 3, 8), "multiple of num_nodes"),
        ((16, 5, 1, 8), "multiple of num_groups"),
        ((8, 4, 2, 8), ">= the number of experts"),
        ((16, 0, 2, 8), "positive"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(np.array(README_WEIGHT), *args)
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(-np.array(README_WEIGHT), 16, 4, 2, 8)
