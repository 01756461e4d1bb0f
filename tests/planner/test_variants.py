"""Sticky and topology-aware plans: exact balance kept, and the measured gains the issue asks for."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import plan, verify
from planner.metrics import internode, new_copies
from planner.synthetic import drifting_trace, zipf_counts

from .loads import Case, Topo, cases


@settings(max_examples=40, deadline=None)
@given(cases(max_R=12), cases(max_R=12), st.booleans())
def test_sticky_and_topology_plans_keep_every_guarantee(a: Case, b: Case, topo: bool):
    """Any previous plan of the right shape, any topology: still exact, one donor, bijective."""
    R = a.R
    T0 = a.counts()
    T1 = b.counts()[:, :T0.shape[1]] if b.R == R and b.epn == a.epn else T0[::-1].copy()
    top = None
    if topo:
        rpn = max(d for d in range(1, R + 1) if R % d == 0 and d <= max(1, R // 2))
        top = Topo(R // rpn, rpn)
    prev = plan(T0, topology=top)
    p = plan(T1, previous=prev, topology=top, token_padding=a.token_padding)
    verify(p, T1)


def test_sticky_plan_halves_weight_copies_on_a_drifting_trace():
    """Goal of the issue: <= 0.5x the expert copies per step of the plain plan, same exact balance."""
    plain = sticky = None
    copies_plain = copies_sticky = 0
    for T in drifting_trace(32, 256, 8, 512, steps=12, skew=1.2, drift=0.05, seed=4):
        p, s = plan(T), plan(T, previous=sticky)
        verify(s, T, routes=False)
        assert np.array_equal(s.recv_counts, p.recv_counts)
        copies_plain += new_copies(plain, p)
        copies_sticky += new_copies(sticky, s)
        plain, sticky = p, s
    assert copies_sticky <= 0.5 * copies_plain, (copies_sticky, copies_plain)


def test_sticky_plan_is_a_fixed_point_for_unchanged_routing():
    """Same counts twice: the sticky plan needs no new weight copies at all."""
    T = zipf_counts(16, 64, 4, 128, 1.4, 1)
    p = plan(T)
    s = plan(T, previous=p)
    assert new_copies(p, s) == 0


def test_topology_plan_cuts_inter_node_weight_copies():
    """Intra-node pairs first: fewer replica weights cross nodes on skewed loads (2 and 4 nodes)."""
    for R, rpn in ((16, 8), (32, 8)):
        node = np.arange(R) // rpn
        plain_w = topo_w = 0
        for seed in range(4):
            T = zipf_counts(R, 8 * R, 8, 256, 1.2, seed)
            q = plan(T, topology=Topo(R // rpn, rpn))
            verify(q, T, routes=False)
            plain_w += internode(plan(T), node)["weight_copies"]
            topo_w += internode(q, node)["weight_copies"]
        assert topo_w < plain_w, (R, topo_w, plain_w)


def test_int_topology_equals_object_topology():
    T = zipf_counts(8, 32, 4, 64, 1.1, 2)
    a, b = plan(T, topology=4), plan(T, topology=Topo(2, 4))
    assert np.array_equal(a.alloc, b.alloc) and np.array_equal(a.flows, b.flows)


def test_topology_plan_cuts_inter_node_bytes_where_weights_dominate():
    """Goal regime of the issue: 8 nodes, few tokens per rank, zipf(1.2): >= 30 % fewer inter-node bytes.

    (With many tokens per rank routed rows dominate and the gain is small; see planner/README.md.)
    """
    from planner.bench import topology_section

    rows = [r for r in topology_section(quick=False, seed=0) if r["nodes"] == 8 and r["S"] == 256]
    assert rows and all(r["bytes_ratio"] <= 0.7 and r["balance"] == 1.0 for r in rows), rows
