"""Cluster topology (a networkx graph) and alpha-beta collective costs over it.

The graph has one vertex per GPU, one NVSwitch per node, leaf switches and one aggregated spine:

- ``fat-tree``: each leaf serves ``nodes_per_leaf`` whole nodes (every NIC of those nodes);
- ``rail``: rail-optimised; each *scalable unit* of ``nodes_per_leaf`` nodes has ``gpus_per_node`` rail
  switches, rail ``i`` joining GPU ``i`` of every node (cross-rail traffic hops over NVLink first, PXN-style).

Edge attribute ``capacity`` is GB/s per direction; a leaf's spine uplink carries its downlink capacity divided
by ``oversubscription``. Collectives see three tiers of per-GPU bandwidth read off the graph: inside a node
(NVLink), inside a leaf domain (NIC) and across the spine (NIC / oversubscription); a ring that leaves the node
spreads its crossing traffic over the NICs of the group's members on each node (NCCL measures 192 GB/s all-reduce
bus bandwidth across DGX-A100 nodes with eight 25 GB/s NICs, NVIDIA/nccl#812). Ranks are laid out
TP fastest, then CP, then DP (EP groups are consecutive DP x CP ranks), then PP (Megatron's order), so a
group of ``n`` ranks with rank stride ``st`` has ``k`` members per node and ``l`` per leaf domain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import networkx as nx

from simulator.hardware import Efficiency, HardwareSpec
from simulator.modelspec import MAX_SIZE

TOPOLOGIES = ("rail", "fat-tree")


@dataclass(kw_only=True, frozen=True)
class ClusterSpec:
    """How the GPUs are wired beyond the node."""

    topology: str = "rail"
    """``rail`` (rail-optimised) or ``fat-tree``."""
    oversubscription: float = 1.0
    """Leaf-to-spine oversubscription (2.0 = 2:1); 1 is non-blocking."""
    nodes_per_leaf: int = 32
    """Nodes under one leaf (fat-tree) or in one rail scalable unit."""

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"ClusterSpec.topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if not (math.isfinite(self.oversubscription) and self.oversubscription >= 1):
            raise ValueError(
                f"ClusterSpec.oversubscription must be a finite number >= 1, got {self.oversubscription!r}"
            )
        n = self.nodes_per_leaf
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SIZE:
            raise ValueError(f"ClusterSpec.nodes_per_leaf must be an integer in [1, {MAX_SIZE}], got {n!r}")


def build_graph(num_gpus: int, hw: HardwareSpec, cluster: ClusterSpec) -> nx.Graph:
    """The topology graph of ``num_gpus`` GPUs (``gpus_per_node`` per node)."""
    gpn = hw.gpus_per_node
    nodes = max(1, math.ceil(num_gpus / gpn))
    g = nx.Graph()
    for n in range(nodes):
        g.add_node(("nvs", n), kind="nvswitch")
    leaves: dict = {}
    for r in range(num_gpus):
        node = r // gpn
        unit = node // cluster.nodes_per_leaf
        leaf = ("leaf", unit, r % gpn) if cluster.topology == "rail" else ("leaf", unit, 0)
        g.add_node(("gpu", r), kind="gpu")
        g.add_edge(("gpu", r), ("nvs", node), capacity=hw.nvlink_gbps, tier=0)
        g.add_edge(("gpu", r), leaf, capacity=hw.nic_gbps, tier=1)
        leaves[leaf] = leaves.get(leaf, 0) + 1
    for leaf, links in leaves.items():
        g.add_edge(leaf, ("spine",), capacity=links * hw.nic_gbps / cluster.oversubscription, tier=2)
    return g


@dataclass(frozen=True)
class Tiers:
    """Per-GPU bandwidth (GB/s, achieved) and latency (s) at each tier, plus the geometry."""

    bw: tuple[float, float, float]
    alpha: tuple[float, float, float]
    gpus_per_node: int
    gpus_per_leaf: int


def tiers_from_graph(g: nx.Graph, hw: HardwareSpec, gpu: int = 0) -> tuple[float, float, float]:
    """Raw per-GPU bandwidth of ``gpu`` at the node, leaf and spine tiers, read off the graph's edges."""
    nvs = [v for v in g[("gpu", gpu)] if v[0] == "nvs"][0]
    leaf = [v for v in g[("gpu", gpu)] if v[0] == "leaf"][0]
    bw0 = g[("gpu", gpu)][nvs]["capacity"]
    bw1 = g[("gpu", gpu)][leaf]["capacity"]
    links = sum(1 for v in g[leaf] if v[0] == "gpu")
    up = g[leaf][("spine",)]["capacity"] / max(1, links)
    return bw0, bw1, min(bw1, up)


@lru_cache(maxsize=64)
def _graph_tiers(num_gpus: int, hw: HardwareSpec, cluster: ClusterSpec) -> tuple[float, float, float]:
    """``tiers_from_graph`` of a healthy cluster (the tiers repeat: 2 leaves are built)."""
    small = min(num_gpus, hw.gpus_per_node * cluster.nodes_per_leaf * 2)
    return tiers_from_graph(build_graph(small, hw, cluster), hw)


@lru_cache(maxsize=64)
def cluster_tiers(num_gpus: int, hw: HardwareSpec, cluster: ClusterSpec) -> Tiers:
    """Achieved tier bandwidths for a healthy cluster (cached: the search calls it per config; the graph is cached
    on the hardware without its efficiencies, which it does not read, so a fit's trials share one)."""
    bw0, bw1, bw2 = _graph_tiers(num_gpus, replace(hw, efficiency=Efficiency(), host=None), cluster)
    eff = hw.efficiency
    return Tiers(
        bw=(bw0 * eff.nvlink, bw1 * eff.network, bw2 * eff.network),
        alpha=(hw.nvlink_latency_us * 1e-6, hw.nic_latency_us * 1e-6, 2 * hw.nic_latency_us * 1e-6),
        gpus_per_node=hw.gpus_per_node,
        gpus_per_leaf=hw.gpus_per_node * cluster.nodes_per_leaf,
    )


# ------------------------------------------------------------------------------------------- group shapes
@dataclass(frozen=True)
class Group:
    """A communicator: ``n`` ranks, ``k`` per node, ``l`` per leaf domain."""

    n: int
    k: int
    l: int

    @property
    def top_tier(self) -> int:
        return 0 if self.n <= self.k else (1 if self.n <= self.l else 2)


def group(n: int, stride: int, t: Tiers) -> Group:
    """Shape of a group of ``n`` ranks spaced ``stride`` apart in the rank order."""
    k = min(n, max(1, t.gpus_per_node // stride))
    l = min(n, max(1, t.gpus_per_leaf // stride))
    return Group(n, k, max(k, l))


def _bottleneck(gr: Group, t: Tiers, scale: tuple[float, float, float]) -> tuple[float, float]:
    """Bandwidth (B/s) and latency of a ring over ``gr``. A ring that leaves the node crosses between nodes once
    per node per channel, and NCCL runs one channel through the NIC of each of the group's ``k`` members on a node
    (its ring search spreads channels over NICs), so the node's crossing traffic shares ``k`` NICs: a group with
    one member per node is held to one NIC, a whole node's ring to the lesser of NVLink and ``k`` NICs."""
    tier = gr.top_tier
    bw = min(t.bw[i] * scale[i] * (gr.k if i else 1) for i in range(tier + 1))
    return bw * 1e9, t.alpha[tier]


def ring_latency(gr: Group, t: Tiers) -> float:
    """Latency of one ring reduce-scatter or all-gather, NCCL's tuning model (``src/graph/tuning.cc``: ``(n - 1 -
    inter) x`` the intra-node step + ``inter = nodes - 1`` network steps): it grows linearly with the ring."""
    if gr.n <= 1:
        return 0.0
    inter = math.ceil(gr.n / gr.k) - 1
    return (gr.n - 1 - inter) * t.alpha[0] + inter * t.alpha[gr.top_tier]


def all_gather(nbytes: float, gr: Group, t: Tiers, scale=(1.0, 1.0, 1.0)) -> float:
    """Ring all-gather (or reduce-scatter) of an ``nbytes`` full buffer: (n-1)/n of it crosses the bottleneck."""
    if gr.n <= 1 or nbytes <= 0:
        return 0.0
    bw, _ = _bottleneck(gr, t, scale)
    return (gr.n - 1) / gr.n * nbytes / bw + ring_latency(gr, t)


reduce_scatter = all_gather


def all_reduce(nbytes: float, gr: Group, t: Tiers, scale=(1.0, 1.0, 1.0)) -> float:
    """All-reduce: the faster of a ring (reduce-scatter + all-gather) and NCCL's tree across nodes (latency
    ``2 ((k - 1) alpha_node + log2(nodes) alpha_net)``, bandwidth 0.9 x half the bus bandwidth: tuning.cc)."""
    ring = 2.0 * all_gather(nbytes, gr, t, scale)
    nodes = math.ceil(gr.n / gr.k)
    if nodes <= 2 or nbytes <= 0:
        return ring
    bw, _ = _bottleneck(gr, t, scale)
    tree = 2.0 * nbytes / (0.9 * bw) + 2.0 * ((gr.k - 1) * t.alpha[0] + math.log2(nodes) * t.alpha[gr.top_tier])
    return min(ring, tree)


def all_to_all(
    nbytes: float, gr: Group, t: Tiers, scale=(1.0, 1.0, 1.0), incast: float = 1.0, remote: float = 1.0
) -> float:
    """All-to-all where each rank sends ``nbytes`` spread evenly over the group (its own share stays local).

    The node, leaf and spine portions move concurrently, so the time is the largest portion over its tier's
    bandwidth; ``incast`` >= 1 scales it for the busiest receiver (routing skew); ``remote`` <= 1 scales the
    bytes that leave the node (a dispatcher that sends a token once per destination node).
    """
    if gr.n <= 1 or nbytes <= 0:
        return 0.0
    n, k, l = gr.n, gr.k, gr.l
    parts = (
        nbytes * (k - 1) / n / (t.bw[0] * scale[0]),
        nbytes * remote * (n - k) / n / (t.bw[1] * scale[1]),
        nbytes * remote * (n - l) / n / (t.bw[2] * scale[2]),
    )
    return max(parts) * 1e-9 * incast + t.alpha[gr.top_tier] * (1 + math.log2(n))


def p2p(nbytes: float, stride: int, t: Tiers, scale=(1.0, 1.0, 1.0)) -> float:
    """Point-to-point send between ranks ``stride`` apart."""
    if nbytes <= 0:
        return 0.0
    tier = 0 if stride < t.gpus_per_node else (1 if stride < t.gpus_per_leaf else 2)
    bw = min(t.bw[i] * scale[i] for i in range(tier + 1))
    return nbytes / (bw * 1e9) + t.alpha[tier]
