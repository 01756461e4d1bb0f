"""Measurements of plans: balance, migration against its flow lower bound, weight copies, inter-node bytes.

Pure functions used by the tests, the bench and the CLI. Byte figures use a bf16 expert FFN with the
bench's default shape (H = 7168, H' = 2048, three projections); ratios between plans do not depend on it
except where routed rows and weights are added together.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._inputs import WEIGHT_ROWS, as_counts, check_shape
from .core import Plan

ROW_BYTES = 7168 * 2
"""bytes of one routed row (H = 7168, bf16)."""
EXPERT_BYTES = 3 * 7168 * 2048 * 2
"""bytes of one expert's weights (gate, up, down: 3 x H x H', bf16)."""


def balance(plan: Plan) -> float:
    """max / mean real rows per rank (1.0 = perfect; with unequal floor/ceil caps, max/mean of the caps)."""
    rows = plan.recv_counts
    mean = rows.mean()
    return float(rows.max() / mean) if mean > 0 else 1.0


def home_loads(tokens_per_expert: Any) -> np.ndarray:
    """[R] rows each rank would compute without planning (every slot at its expert's home)."""
    T = as_counts(tokens_per_expert, "tokens_per_expert", 2)
    R, _, epn = check_shape(T)
    return T.sum(0).reshape(R, epn).sum(1)


def min_migration(tokens_per_expert: Any, caps: Any = None) -> int:
    """Fewest routed slots that must leave their home rank so every rank computes exactly caps rows.

    A networkx min-cost flow: home group h supplies its load, rank d demands caps[d], an edge h -> d costs 1
    per slot when d != h and 0 when d == h. Experts of one home are interchangeable for this cost, so the
    group-level graph (R^2 edges) has the same optimum as the expert-level one. Lower bound for any planner.
    """
    import networkx as nx

    load = home_loads(tokens_per_expert)
    R = load.shape[0]
    total = int(load.sum())
    if caps is None:
        caps = [total // R + (1 if r < total % R else 0) for r in range(R)]
    caps = [int(c) for c in caps]
    if sum(caps) != total:
        raise ValueError(f"caps must sum to the total routed slots: sum(caps)={sum(caps)}, total={total}")
    g = nx.DiGraph()
    for h in range(R):
        g.add_node(("home", h), demand=-int(load[h]))
        g.add_node(("rank", h), demand=caps[h])
    for h in range(R):
        for d in range(R):
            g.add_edge(("home", h), ("rank", d), weight=0 if d == h else 1)
    return int(nx.min_cost_flow_cost(g))


def new_copies(previous: Plan | None, current: Plan) -> int:
    """Replicas ``current`` needs that ``previous`` did not have on the same rank (weights that must move)."""
    if previous is None:
        return current.num_replicas
    count = 0
    for d in range(current.num_ranks):
        held = set(previous.experts_to_copy[d][previous.experts_to_copy[d] >= 0].tolist())
        count += sum(1 for e in current.experts_to_copy[d].tolist() if e >= 0 and e not in held)
    return count


def internode(plan: Plan, node: np.ndarray) -> dict[str, int]:
    """Traffic crossing nodes: routed rows and replica weight copies (node [R] = node id of each rank)."""
    node = np.asarray(node)
    cross = node[:, None] != node[None, :]
    epn = plan.experts_per_rank
    copy = plan.experts_to_copy
    d, b = np.nonzero(copy >= 0)
    weight_copies = int((node[copy[d, b] // epn] != node[d]).sum())
    rows = int(plan.send_counts[cross].sum())
    return {"routed_rows": rows, "weight_copies": weight_copies,
            "bytes": rows * ROW_BYTES + weight_copies * EXPERT_BYTES}


def unplanned_internode_rows(tokens_per_expert: Any, node: np.ndarray) -> int:
    """Routed rows crossing nodes when every slot goes to its expert's home rank (no balancing)."""
    T = as_counts(tokens_per_expert, "tokens_per_expert", 2)
    R, _, epn = check_shape(T)
    node = np.asarray(node)
    to_home = T.reshape(R, R, epn).sum(2)
    return int(to_home[node[:, None] != node[None, :]].sum())


def internode_bound(tokens_per_expert: Any, node: np.ndarray, caps: Any = None,
                    weight_rows: int = WEIGHT_ROWS) -> int:
    """Lower bound on ``routed_rows + weight_rows * weight_copies`` of ``internode`` for ANY plan with these caps.

    Expert e's slots routed by node n (``src``, n not e's home node) either cross nodes or are computed on n by
    replicas there, each an inter-node weight copy holding at most max(caps) rows; so they cost at least
    ``min_k max(0, src - k*max(caps)) + k*weight_rows``, summed over (e, n). Node balance, the one-donor rule
    and slot limits are ignored, so every plan (this planner's or any other) costs at least this.
    """
    T = as_counts(tokens_per_expert, "tokens_per_expert", 2)
    R, E, epn = check_shape(T)
    node = np.asarray(node, dtype=np.int64)
    total = int(T.sum())
    cap = max(1, -(-total // R) if caps is None else int(np.max(caps)))
    src = np.zeros((int(node.max()) + 1, E), np.int64)
    np.add.at(src, node, T)  # [nodes, E]: slots of e routed by each node's ranks
    src[node[np.arange(E) // epn], np.arange(E)] = 0  # a home node's own slots never need to cross
    k = src // cap
    cost = np.minimum.reduce([src, src - k * cap + k * weight_rows, (k + (src % cap > 0)) * weight_rows])
    return int(cost.sum())
