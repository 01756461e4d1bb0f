"""Adversarial load families for the planner tests, built from a few hypothesis-drawn integers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from planner.synthetic import zipf_counts

FAMILIES = ("zipf", "uniform", "one_expert", "zeros", "one_rank_hot", "home_heavy", "varlen", "balanced_groups")


def make_counts(family: str, R: int, epn: int, scale: int, seed: int) -> np.ndarray:
    """[R, R*epn] counts of one family; ``scale`` ~ routed slots per rank."""
    E = R * epn
    rng = np.random.default_rng(seed)
    if family == "zipf":
        return zipf_counts(R, E, 1, scale, float(rng.uniform(0.5, 2.5)), seed)
    if family == "uniform":
        return rng.integers(0, scale // max(1, epn) + 2, size=(R, E))
    T = np.zeros((R, E), np.int64)
    if family == "one_expert":  # every slot of every rank to one expert
        T[:, int(rng.integers(E))] = scale
    elif family == "one_rank_hot":  # one home group takes everything
        h = int(rng.integers(R))
        T[:, h * epn : (h + 1) * epn] = rng.integers(0, scale + 1, size=(R, epn))
    elif family == "home_heavy":  # every rank routes to its own experts, unevenly
        for r in range(R):
            T[r, r * epn : (r + 1) * epn] = rng.integers(0, scale + 1, size=epn)
    elif family == "varlen":  # per-rank token counts differ wildly
        for r in range(R):
            T[r] = rng.multinomial(int(rng.integers(0, 2 * scale + 1)), np.full(E, 1.0 / E))
    elif family == "balanced_groups":  # experts skewed but every home group exactly at cap: no migration
        per_group = scale
        for r in range(R):
            for h in range(R):
                T[r, h * epn : (h + 1) * epn] = rng.multinomial(per_group, rng.dirichlet(np.ones(epn)))
    return T


@dataclass(frozen=True)
class Case:
    """One drawn planner input."""

    family: str
    """load family name."""
    R: int
    """ranks."""
    epn: int
    """experts per rank."""
    scale: int
    """about this many routed slots per rank."""
    seed: int
    """generator seed."""
    token_padding: int
    """segment padding."""

    def counts(self) -> np.ndarray:
        """[R, E] counts of this case."""
        return make_counts(self.family, self.R, self.epn, self.scale, self.seed)


def cases(max_R: int = 16, max_epn: int = 6, max_scale: int = 200) -> st.SearchStrategy[Case]:
    """Small geometries with odd R and R = 1 over-represented."""
    R = st.one_of(st.sampled_from([1, 2, 3, 5, 7]), st.integers(1, max_R))
    return st.builds(
        Case,
        st.sampled_from(FAMILIES),
        R,
        st.integers(1, max_epn),
        st.integers(0, max_scale),
        st.integers(0, 2**31 - 1),
        st.sampled_from([1, 1, 2, 3, 8]),
    )


@dataclass(frozen=True)
class Topo:
    """Minimal duck-typed stand-in for collectives.Topology (nodes of consecutive ranks)."""

    num_nodes: int
    """nodes."""
    ranks_per_node: int
    """ranks on each node."""
    weight_rows: int = 3 * 2048
    """cost of one expert weight copy in routed rows (the planner's default)."""
    interleaved: bool = False
    """rank r on node r % num_nodes instead of r // ranks_per_node (nodes that are not rank ranges)."""

    def node_of(self, rank: int) -> int:
        """node id of ``rank``."""
        return rank % self.num_nodes if self.interleaved else rank // self.ranks_per_node

    def nodes(self) -> np.ndarray:
        """[R] node id of every rank."""
        return np.array([self.node_of(r) for r in range(self.num_nodes * self.ranks_per_node)], np.int64)
