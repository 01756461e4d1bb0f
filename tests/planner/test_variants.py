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


def test_topology_plan_cuts_inter_node_bytes_on_two_nodes():
    """The issue's goal on a skewed 2-node case (2 x 16 ranks, zipf 1.2, S=256): >= 30 % fewer inter-node
    bytes than the plain plan, exact balance kept. (2 x 8 ranks at S=4096 gives only x0.89: see README.)"""
    R, rpn = 32, 16
    node = np.arange(R) // rpn
    plain = topo = 0
    for seed in range(2):
        T = zipf_counts(R, 8 * R, 8, 256, 1.2, seed)
        p, q = plan(T), plan(T, topology=rpn)
        verify(q, T, routes=False)
        assert np.array_equal(q.recv_counts, p.recv_counts)
        plain += internode(p, node)["bytes"]
        topo += internode(q, node)["bytes"]
    assert topo <= 0.7 * plain, topo / plain


def test_cross_node_pass_localises_routed_rows_with_many_tokens():
    """Many tokens per rank: cross-node pairs that feed a hot expert's replica from its own node's sources
    pay for their weight copy, so fewer routed rows cross nodes than in the plain plan (2 and 4 nodes)."""
    for R, rpn in ((16, 8), (32, 8)):
        node = np.arange(R) // rpn
        plain = topo = 0
        for seed in range(2):
            T = zipf_counts(R, 8 * R, 8, 4096, 1.2, seed)
            q = plan(T, topology=rpn)
            verify(q, T, routes=False)
            plain += internode(plan(T), node)["routed_rows"]
            topo += internode(q, node)["routed_rows"]
        assert topo <= 0.9 * plain, (R, topo / plain)


def test_cross_node_pass_equals_twin_on_a_skewed_load():
    """The compiled cross-node pass and its plain-Python twin agree where the pass really acts."""
    from planner.reference import plan_reference

    from .test_reference import assert_same

    T = zipf_counts(8, 64, 8, 2048, 1.2, 3)
    q = plan(T, topology=4)
    node = np.arange(8) // 4
    cross = [(h, u) for u, h in enumerate(q.donor.tolist()) if h >= 0 and node[h] != node[u]]
    assert cross  # the pass made at least one cross-node pair
    assert_same(q, plan_reference(T, node=node, num_nodes=2))
    verify(q, T)


def test_self_first_matching_keeps_own_rows_home():
    """Topology plans feed a destination from its own rank first: for every split expert e and rank r, the
    flow (e, r, r) carries min(T[r, e], alloc[e, r]) rows."""
    T = zipf_counts(8, 64, 8, 512, 1.3, 5)
    q = plan(T, topology=4)
    self_rows = {(int(e), int(r)): int(c) for e, r, d, c in q.flows if r == d}
    for e in np.unique(q.flows[:, 0]):
        for r in range(8):
            assert self_rows.get((int(e), r), 0) == min(int(T[r, e]), int(q.alloc[e, r]))
