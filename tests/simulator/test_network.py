"""Topology graph and alpha-beta collectives."""

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import network as net
from simulator.hardware import load_hardware


@pytest.mark.parametrize("topo", ["rail", "fat-tree"])
def test_graph_structure(topo):
    hw = load_hardware("h200")
    g = net.build_graph(128, hw, net.ClusterSpec(topology=topo, nodes_per_leaf=4))
    gpus = [v for v in g if v[0] == "gpu"]
    assert len(gpus) == 128 and nx.is_connected(g)
    # same node: through the NVSwitch (2 hops); other leaf domain: through the spine
    assert nx.shortest_path_length(g, ("gpu", 0), ("gpu", 1)) == 2
    assert ("spine",) in nx.shortest_path(g, ("gpu", 0), ("gpu", 127))


def test_oversubscription_lowers_spine_tier():
    hw = load_hardware("h100")
    full = net.cluster_tiers(1024, hw, net.ClusterSpec(oversubscription=1.0))
    over = net.cluster_tiers(1024, hw, net.ClusterSpec(oversubscription=2.0))
    assert over.bw[2] == pytest.approx(full.bw[2] / 2) and over.bw[1] == full.bw[1]


def test_group_shapes():
    t = net.cluster_tiers(4096, load_hardware("h200"), net.ClusterSpec())
    assert net.group(8, 1, t) == net.Group(8, 8, 8)
    assert net.group(32, 8, t).k == 1 and net.group(32, 8, t).top_tier == 1 and net.group(64, 8, t).top_tier == 2
    assert net.group(64, 1, t).top_tier == 1 and net.group(512, 1, t).top_tier == 2


@settings(max_examples=30, deadline=None)
@given(
    a=st.floats(1e3, 1e9),
    b=st.floats(1e3, 1e9),
    n=st.sampled_from([2, 8, 16, 64, 256]),
    stride=st.sampled_from([1, 2, 8]),
)
def test_collectives_monotone_in_bytes(a, b, n, stride):
    t = net.cluster_tiers(4096, load_hardware("h100"), net.ClusterSpec())
    g = net.group(n, stride, t)
    lo, hi = sorted((a, b))
    for fn in (net.all_gather, net.all_reduce, net.all_to_all):
        assert fn(hi, g, t) >= fn(lo, g, t)
    assert net.all_to_all(hi, g, t, incast=1.5) >= net.all_to_all(hi, g, t)


@settings(max_examples=30, deadline=None)
@given(nbytes=st.floats(1e8, 1e11), nodes=st.sampled_from([2, 4, 16, 64]), stride=st.sampled_from([1, 2, 4, 8]))
def test_a_ring_across_nodes_shares_its_members_nics(nbytes, nodes, stride):
    """A ring that leaves the node crosses at the NICs of the group's members on each node (NCCL runs a channel
    per NIC: 192 GB/s all-reduce bus bandwidth across DGX-A100 nodes with eight 25 GB/s NICs, NVIDIA/nccl#812):
    ``k`` members per node move ``k`` times one member's bandwidth, up to NVLink. Latency aside, so big buffers."""
    t = net.cluster_tiers(4096, load_hardware("h100"), net.ClusterSpec())
    k = t.gpus_per_node // stride
    g = net.group(nodes * k, stride, t)
    assert g.k == k and g.top_tier >= 1
    one_nic = min(t.bw[: g.top_tier + 1])
    expect = min(t.bw[0], k * min(t.bw[1 : g.top_tier + 1]))
    busy = net.all_gather(nbytes, g, t) - net.ring_latency(g, t)
    assert busy == pytest.approx((g.n - 1) / g.n * nbytes / (expect * 1e9), rel=1e-9)
    assert expect >= one_nic and (k == 1) == (expect == one_nic)


@pytest.mark.parametrize("nodes", [0, True, 2**31, 1.5])
def test_cluster_spec_refuses_a_leaf_size_outside_its_range(nodes):
    with pytest.raises(ValueError, match=r"ClusterSpec.nodes_per_leaf must be an integer in \[1, 2147483647\]"):
        net.ClusterSpec(nodes_per_leaf=nodes)
