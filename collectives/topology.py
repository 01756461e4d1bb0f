"""``Topology``: nodes x ranks per node, with intra- and inter-node link speeds.

Shared by the planner (topology-aware donor choice), the simulator (collective costs) and the straggler tools
(expected link speeds). Ranks are numbered node-major: rank ``r`` lives on node ``r // ranks_per_node``, as
torchrun and mpiexec number them by default.

Sources: a JSON file (``Topology.from_json``), command-line flags (``add_arguments`` / ``from_args``), or
``Topology.detect`` (NVML when a GPU driver is present, else one CPU node).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A homogeneous cluster: ``num_nodes`` nodes of ``ranks_per_node`` ranks each."""

    num_nodes: int = 1
    """Number of nodes (hosts)."""
    ranks_per_node: int = 1
    """Ranks (GPUs or CPU processes) per node."""
    intra_bw_gbps: float = 450.0
    """Per-rank bandwidth to a rank on the same node, GB/s per direction (NVLink 4: 450)."""
    inter_bw_gbps: float = 50.0
    """Per-rank bandwidth to a rank on another node, GB/s per direction (one 400 Gb/s NIC per GPU: 50)."""
    intra_latency_us: float = 3.0
    """One-way latency between ranks of one node, microseconds."""
    inter_latency_us: float = 10.0
    """One-way latency between ranks of different nodes, microseconds."""
    name: str = ""
    """Free-form label (where it came from)."""

    def __post_init__(self):
        for f in ("num_nodes", "ranks_per_node"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{f} must be a positive integer, got {value!r}")
        for f in ("intra_bw_gbps", "inter_bw_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Topology.{f} must be > 0 GB/s, got {getattr(self, f)!r}")
        for f in ("intra_latency_us", "inter_latency_us"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"Topology.{f} must be >= 0 us, got {getattr(self, f)!r}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Node index of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this topology's {self.world_size} ranks")
        return rank // self.ranks_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def bandwidth_gbps(self, a: int, b: int) -> float:
        """Link bandwidth between ranks ``a`` and ``b`` in GB/s (inf for a rank to itself: a local copy)."""
        if a == b:
            return float("inf")
        return self.intra_bw_gbps if self.same_node(a, b) else self.inter_bw_gbps

    def latency_us(self, a: int, b: int) -> float:
        if a == b:
            return 0.0
        return self.intra_latency_us if self.same_node(a, b) else self.inter_latency_us

    def transfer_seconds(self, a: int, b: int, nbytes: float) -> float:
        """Alpha-beta time to move ``nbytes`` from ``a`` to ``b``."""
        if a == b or nbytes == 0:
            return 0.0
        return self.latency_us(a, b) * 1e-6 + nbytes / (self.bandwidth_gbps(a, b) * 1e9)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Topology field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Topology:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a topology file holds one JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    # ------------------------------------------------------------------ command line
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Adds ``--topology FILE`` and one flag per field (``--nodes``, ``--ranks-per-node``, ...)."""
        g = parser.add_argument_group("topology")
        g.add_argument("--topology", metavar="FILE", help="topology JSON file (flags below override it)")
        g.add_argument("--nodes", type=int, help="number of nodes")
        g.add_argument("--ranks-per-node", type=int, help="ranks per node")
        g.add_argument("--intra-bw-gbps", type=float, help="intra-node bandwidth per rank, GB/s")
        g.add_argument("--inter-bw-gbps", type=float, help="inter-node bandwidth per rank, GB/s")
        g.add_argument("--intra-latency-us", type=float, help="intra-node latency, us")
        g.add_argument("--inter-latency-us", type=float, help="inter-node latency, us")

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int | None = None) -> Topology:
        """Topology from ``add_arguments`` flags; without ``--nodes``/``--ranks-per-node`` one node holds all."""
        base = cls.from_json(args.topology).to_dict() if getattr(args, "topology", None) else {}
        flags = {
            "num_nodes": "nodes",
            "ranks_per_node": "ranks_per_node",
            "intra_bw_gbps": "intra_bw_gbps",
            "inter_bw_gbps": "inter_bw_gbps",
            "intra_latency_us": "intra_latency_us",
            "inter_latency_us": "inter_latency_us",
        }
        for field, flag in flags.items():
            if getattr(args, flag, None) is not None:
                base[field] = getattr(args, flag)
        if world_size is not None and "ranks_per_node" not in base:
            nodes = base.get("num_nodes", 1)
            if world_size % nodes:
                raise ValueError(f"world size {world_size} does not divide over {nodes} nodes")
            base["ranks_per_node"] = world_size // nodes
        return cls.from_dict(base)

    # ------------------------------------------------------------------ detection
    @classmethod
    def detect(cls, world_size: int | None = None, num_nodes: int = 1) -> Topology:
        """This machine's topology: GPUs and NVLink from NVML when a driver is present, else CPU ranks.

        Without NVML, ``world_size`` (default: the CPU count) ranks share one node and the bandwidth figures are
        rough memory-copy speeds; measure with ``moonep bench collectives`` for real numbers.
        """
        gpus = _nvml_gpus()
        if gpus is not None and gpus["count"] > 0:
            nvlink = gpus["nvlink_links"] > 0
            return cls(
                num_nodes=num_nodes,
                ranks_per_node=gpus["count"],
                intra_bw_gbps=25.0 * gpus["nvlink_links"] if nvlink else 32.0,
                name=f"nvml: {gpus['count']} x {gpus['name']}" + (" NVLink" if nvlink else " PCIe"),
            )
        ranks = world_size or os.cpu_count() or 1
        if ranks % num_nodes:
            raise ValueError(f"world size {ranks} does not divide over {num_nodes} nodes")
        return cls(
            num_nodes=num_nodes,
            ranks_per_node=ranks // num_nodes,
            intra_bw_gbps=5.0,
            inter_bw_gbps=1.0,
            intra_latency_us=20.0,
            inter_latency_us=50.0,
            name="cpu (no NVML)",
        )


def _nvml_gpus() -> dict | None:
    """GPU count, name and NVLink links of GPU 0, or None when NVML is unavailable."""
    try:
        import pynvml  # pyright: ignore[reportMissingImports]  # optional: nvidia-ml-py (the gpu extra); else CPU defaults
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return {"count": 0, "name": "", "nvlink_links": 0}
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        links = 0
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                links += int(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
            except pynvml.NVMLError:
                break
        return {"count": count, "name": name.decode() if isinstance(name, bytes) else name, "nvlink_links": links}
    finally:
        pynvml.nvmlShutdown()
