"""Sticky and topology-aware plans: exact balance kept, and the measured gains the issue asks for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import plan, verify
from planner.metrics import internode, internode_bound, new_copies
from planner.synthetic import drifting_trace, zipf_counts
from tests.planner.loads import Case, Topo, cases


@settings(max_examples=40, deadline=None)
@given(cases(max_R=12), cases(max_R=12), st.booleans())
def test_sticky_and_topology_plans_keep_every_guarantee(a: Case, b: Case, topo: bool):
    """Any previous plan of the right shape, any topology: still exact, one donor, bijective."""
    R = a.R
    T0 = a.counts()
    T1 = b.counts()[:, : T0.shape[1]] if b.R == R and b.epn == a.epn else T0[::-1].copy()
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
    """Goal of the issue on every skewed load of the bench with few tokens per rank (S = 256; zipf counts and
    router top-k counts; 2, 4 and 8 nodes; K3's E = 896, K = 16): >= 30 % fewer inter-node bytes, exact balance.
    """
    from planner.bench import topology_grid, topology_section

    grid = [g for g in topology_grid(quick=False) if g[-1] == 256]
    rows = topology_section(quick=False, seed=0, timed=False, grid=grid)
    assert len(rows) == 7 and all(r["bytes_ratio"] <= 0.7 and r["balance"] == 1.0 for r in rows), rows


@pytest.mark.slow
def test_topology_plan_meets_the_goal_wherever_a_plan_can_at_s_1024():
    """S = 1024, every row of the bench (zipf counts and router top-k counts on 2, 4 and 8 nodes, K3's shape):
    where ``internode_bound`` leaves room under x0.70 the planner meets the goal (router 2 x 8 at x0.689, the
    row the 1.25 copy margin brought under it, x0.702 before); elsewhere the bound is above x0.70 and the
    planner within 0.04 of it (zipf 2 x 8: x0.718 vs x0.709; K3's shape: x0.783 vs x0.749)."""
    from planner.bench import topology_grid, topology_section

    grid = [g for g in topology_grid(quick=False) if g[-1] == 1024]
    rows = topology_section(quick=False, seed=0, timed=False, grid=grid)
    assert len(rows) == 7
    for r in rows:
        assert r["balance"] == 1.0 and r["bytes_ratio_bound"] <= r["bytes_ratio"], r
        if r["bytes_ratio_bound"] <= 0.7:
            assert r["bytes_ratio"] <= 0.7, r
        else:
            assert r["bytes_ratio"] <= r["bytes_ratio_bound"] + 0.04, r
    assert sum(r["bytes_ratio_bound"] <= 0.7 for r in rows) == 5


def test_no_plan_reaches_the_goal_on_router_loads_with_many_tokens():
    """S = 4096 router loads on 2 and 4 nodes: the bound for ANY plan with these caps is above x0.70 of the
    plain plan's bytes, so the >= 30 % goal is out of reach there; the planner stays within 0.08 of it."""
    from planner.bench import topology_section

    rows = topology_section(
        quick=False, seed=0, timed=False, grid=[("router", 16, 128, 8, 4096), ("router", 32, 256, 8, 4096)]
    )
    for r in rows:
        assert 0.7 < r["bytes_ratio_bound"] <= r["bytes_ratio"] <= r["bytes_ratio_bound"] + 0.08, r


@pytest.mark.parametrize("R, rpn, seeds", [(32, 16, 2), (16, 8, 4)], ids=["2x16", "2x8"])
def test_topology_plan_cuts_inter_node_bytes_on_two_nodes(R, rpn, seeds):
    """The issue's goal on skewed 2-node cases (zipf 1.2, S=256): >= 30 % fewer inter-node bytes than the plain
    plan, identical exact balance. 2 x 8 ranks on the bench's four seeds is the case the node-local passes alone
    missed (x0.76): gathering each node's deficits on few ranks leaves few cross-node receivers, each fed the
    expert its node routes to most. (S=4096: see test_topology_plan_with_many_tokens_per_rank.)"""
    node = np.arange(R) // rpn
    plain = topo = 0
    for seed in range(seeds):
        T = zipf_counts(R, 8 * R, 8, 256, 1.2, seed)
        p, q = plan(T), plan(T, topology=rpn)
        verify(q, T)
        assert np.array_equal(q.recv_counts, p.recv_counts)
        plain += internode(p, node)["bytes"]
        topo += internode(q, node)["bytes"]
    assert topo <= 0.7 * plain, topo / plain


def test_topology_plan_with_many_tokens_per_rank():
    """S=4096 on 2 x 8 ranks, the bench's four seeds: <= 0.80 x the plain plan's inter-node bytes (x0.78; the
    previous release, which gathered deficits only after the node-local pairs and handed whole experts over,
    gave x0.86). Gathering first makes cross-node receivers large, and a hand-over takes from an expert only
    the rows that pay for its copy, so a replica does not drag its home node's own rows across. No plan with
    these caps does better than x0.695 (``metrics.internode_bound``; README)."""
    R, rpn = 16, 8
    node = np.arange(R) // rpn
    plain = topo = 0
    for seed in range(4):
        T = zipf_counts(R, 8 * R, 8, 4096, 1.2, seed)
        p, q = plan(T), plan(T, topology=rpn)
        verify(q, T, routes=False)
        assert np.array_equal(q.recv_counts, p.recv_counts)
        plain += internode(p, node)["bytes"]
        topo += internode(q, node)["bytes"]
    assert topo <= 0.80 * plain, topo / plain


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
    from tests.planner.test_reference import assert_same

    for R, rpn, S, seed in ((8, 4, 2048, 3), (16, 8, 4096, 0)):  # the second: slot-sized hand-overs
        T = zipf_counts(R, 8 * R, 8, S, 1.2, seed)
        q = plan(T, topology=rpn)
        node = np.arange(R) // rpn
        cross = [(h, u) for u, h in enumerate(q.donor.tolist()) if h >= 0 and node[h] != node[u]]
        assert cross  # the pass made at least one cross-node pair
        assert_same(q, plan_reference(T, node=node, num_nodes=R // rpn))
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


def test_short_node_gathers_its_deficit_on_few_receivers():
    """Node 1's four ranks are each 360 rows short (their experts are cold): the plain plan gives each its own
    donor on node 0 (four replicas cross nodes); the topology plan gathers the 1440-row deficit on two ranks
    (720 each: one rank of 640 own rows cannot take three), each fed one hot expert: two replicas cross."""
    R, rpn, epn = 8, 4, 2
    node = np.arange(R) // rpn
    e = np.arange(R * epn)
    home_node = node[e // epn]
    row = np.where(home_node == 1, 40, np.where(e % epn == 0, 150, 20))  # 1000 slots per rank, caps 1000
    T = np.repeat(row[None, :], R, axis=0)
    q = plan(T, topology=rpn)
    verify(q, T)
    cross = [u for u in range(R) if q.donor[u] >= 0 and node[q.donor[u]] != node[u]]
    assert len(cross) == 2, q.donor
    assert internode(q, node)["weight_copies"] == 2
    assert internode(plan(T), node)["weight_copies"] == 4


def test_bytes_model_prices_a_copy_as_the_planner_does():
    """The bench's bytes (and internode_bound's default) weigh an expert copy as the planner's weight_rows."""
    from planner._inputs import WEIGHT_ROWS
    from planner.metrics import EXPERT_BYTES, ROW_BYTES

    assert EXPERT_BYTES == WEIGHT_ROWS * ROW_BYTES


@settings(max_examples=40, deadline=None)
@given(cases(max_R=12), st.integers(1, 4), st.sampled_from([0, 5, 3 * 2048]))
def test_internode_bound_is_below_every_plan(case: Case, nodes: int, weight_rows: int):
    """internode_bound is a lower bound: plain, topology-aware and sticky plans all cost at least it."""
    T = case.counts()
    R = T.shape[0]
    nodes = nodes if R % nodes == 0 else 1
    topo = Topo(nodes, R // nodes, weight_rows)
    node = topo.nodes()
    bound = internode_bound(T, node, weight_rows=weight_rows)
    for p in (plan(T), plan(T, topology=topo), plan(T, topology=topo, previous=plan(T[::-1].copy()))):
        cost = internode(p, node)
        assert cost["routed_rows"] + weight_rows * cost["weight_copies"] >= bound


def test_internode_bound_counts_the_rows_node_balance_forces_across():
    """Only rank 0 (node 0) routes, to its own expert: no slot of node 1 wants another node, but node 1 must
    compute half the rows, so 5 rows cross (the bound), plus the copy that computes them (the plan)."""
    T = np.array([[10, 0], [0, 0]])
    node = np.array([0, 1])
    assert internode_bound(T, node, weight_rows=3) == 5
    cost = internode(plan(T, topology=Topo(2, 1, 3)), node)
    assert cost == {"routed_rows": 5, "weight_copies": 1, "bytes": cost["bytes"]}


def _relaxed_optimum(T: np.ndarray, w: int) -> int:
    """Exact min of routed rows crossing + w * copies over all plans with default caps, one rank per node and
    no one-donor rule: every set of copies, each routed by a networkx min-cost flow (the bound's own problem)."""
    import itertools

    import networkx as nx

    from planner._inputs import default_caps

    R, E = T.shape
    epn = E // R
    caps = default_caps(int(T.sum()), R)
    options = [(e, d) for e in range(E) for d in range(R) if d != e // epn]
    best = None
    for chosen in itertools.product((0, 1), repeat=len(options)):
        holds = {(e, e // epn) for e in range(E)} | {o for o, c in zip(options, chosen) if c}
        g = nx.DiGraph()
        for d in range(R):
            g.add_node(("rank", d), demand=caps[d])
        for r in range(R):
            for e in range(E):
                g.add_node(("slots", r, e), demand=-int(T[r, e]))
                for d in range(R):
                    if (e, d) in holds:
                        g.add_edge(("slots", r, e), ("rank", d), weight=int(r != d))
        try:
            cost = nx.min_cost_flow_cost(g) + w * sum(chosen)
        except nx.NetworkXUnfeasible:
            continue
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(2, 2), (2, 4), (3, 3)]), st.integers(0, 2**31 - 1), st.sampled_from([0, 2, 7]))
def test_internode_bound_is_below_the_exact_optimum_without_the_one_donor_rule(shape, seed: int, w: int):
    """On tiny loads (one rank per node) the bound never exceeds the exact optimum over ALL placements of
    copies, and never falls below the node-by-node bound it strengthens."""
    R, E = shape
    rng = np.random.default_rng(seed)
    T = rng.integers(0, 12, size=(R, E)) * (rng.random((R, E)) < 0.7)
    node = np.arange(R)
    bound = internode_bound(T, node, weight_rows=w)
    assert bound <= _relaxed_optimum(T, w)
    assert bound >= _per_node_bound(T, w)


def _per_node_bound(T: np.ndarray, w: int) -> int:
    """The bound without node balance: each (expert, non-home node) pair on its own."""
    R, E = T.shape
    cap = max(1, -(-int(T.sum()) // R))
    total = 0
    for e in range(E):
        for n in range(R):
            if n != e // (E // R):
                s = int(T[n, e])
                total += min(s + k * (w - cap) if s >= k * cap else k * w for k in range(s // cap + 2))
    return total


@settings(max_examples=60, deadline=None)
@given(cases(max_R=10), st.sampled_from([0, 5, 3 * 2048]), st.data())
def test_gain_bound_is_never_below_the_hand_over_gain(case: Case, weight_rows: int, data):
    """The donor searches skip a donor when its gain_bound cannot win: the bound must hold for any placement
    (some slots already moved off home, as after earlier hand-overs) and any amount."""
    from planner import _topology

    T = case.counts().astype(np.int32)
    R, E = T.shape
    if R == 1:
        return  # no second node
    nodes = data.draw(st.sampled_from([d for d in range(2, R + 1) if R % d == 0]))
    epn = E // R
    node = np.arange(R) // (R // nodes)
    alloc = np.zeros((E, R), np.int32)
    alloc[np.arange(E), np.arange(E) // epn] = T.sum(0)
    for e in data.draw(st.lists(st.integers(0, E - 1), max_size=6)):  # part of e already computed elsewhere
        d = data.draw(st.integers(0, R - 1))
        t = data.draw(st.integers(0, int(alloc[e, e // epn])))
        alloc[e, e // epn] -= t
        alloc[e, d] += t
    state = _topology.cross_state(T, alloc, epn, node, nodes, weight_rows)
    for h in range(R):
        held = int(alloc[h * epn : (h + 1) * epn, h].sum())
        for u in range(R):
            if node[u] == node[h]:
                continue
            for q in {min(1, held), held // 2, held} - {0}:  # a donor never gives more than it holds
                assert _topology.gain_bound(h, u, q, state) >= _topology.hand_over(h, u, q, state, False)


def test_router_counts_are_counts_of_distinct_top_k_lists():
    """router_counts = per-rank bincount of zipf_topk's lists: each token names K distinct experts, so no rank
    sends one expert more than S slots, while zipf_counts at the same skew does (why the bench has both)."""
    from planner.synthetic import router_counts, synthetic_counts, zipf_topk

    R, E, K, S = 4, 32, 4, 64
    topk = zipf_topk(R, E, K, S, 1.2, 3)
    assert all(len(set(row)) == K for row in topk.reshape(-1, K).tolist())
    T = router_counts(R, E, K, S, 1.2, 3)
    assert np.array_equal(T, np.stack([np.bincount(topk[r].ravel(), minlength=E) for r in range(R)]))
    assert np.array_equal(T, synthetic_counts("router:1.2", R, E, K, S, 3))
    assert T.sum(1).tolist() == [S * K] * R and T.max() <= S
    assert zipf_counts(R, E, K, S, 1.2, 3).max() > S
