"""Measurements of plans: balance, migration against its flow lower bound, weight copies, inter-node bytes.

Pure functions used by the tests, the bench and the CLI. Byte figures use a bf16 expert FFN with the
bench's default shape (H = 7168, H' = 2048, three projections); ratios between plans do not depend on it
except where routed rows and weights are added together.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner._inputs import WEIGHT_ROWS, as_counts, caps_for, check_shape
from planner.tables import Plan

ROW_BYTES = 7168 * 2
"""bytes of one routed row (H = 7168, bf16)."""
EXPERT_BYTES = 3 * 7168 * 2048 * 2
"""bytes of one expert's weights (gate, up, down: 3 x H x H', bf16)."""


def balance(plan: Plan) -> float:
    """max / mean real rows per rank (1.0 = perfect; with unequal floor/ceil caps, max/mean of the caps)."""
    return load_balance(plan.recv_counts)


def load_balance(rows: np.ndarray) -> float:
    """max / mean of per-rank rows ``[R]``: 1.0 is perfect, and so is a load with no rows at all."""
    mean = rows.mean()
    return float(rows.max() / mean) if mean > 0 else 1.0


def home_loads(slots_per_expert: Any) -> np.ndarray:
    """[R] rows each rank would compute without planning (every slot at its expert's home)."""
    T = as_counts(slots_per_expert, "slots_per_expert", 2)
    R, _, epn = check_shape(T)
    return T.sum(0).reshape(R, epn).sum(1)


def min_migration(slots_per_expert: Any, caps: Any = None) -> int:
    """Fewest routed slots that must leave their home rank so every rank computes exactly caps rows.

    A networkx min-cost flow: home group h supplies its load, rank d demands caps[d], an edge h -> d costs 1
    per slot when d != h and 0 when d == h. Experts of one home are interchangeable for this cost, so the
    group-level graph (R^2 edges) has the same optimum as the expert-level one. Lower bound for any planner.
    """
    import networkx as nx  # heavy: networkx

    load = home_loads(slots_per_expert)
    R = load.shape[0]
    caps = caps_for(caps, int(load.sum()), R)
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
    return {
        "routed_rows": rows,
        "weight_copies": weight_copies,
        "bytes": rows * ROW_BYTES + weight_copies * EXPERT_BYTES,
    }


def unplanned_internode_rows(slots_per_expert: Any, node: np.ndarray) -> int:
    """Routed rows crossing nodes when every slot goes to its expert's home rank (no balancing)."""
    T = as_counts(slots_per_expert, "slots_per_expert", 2)
    R, _, epn = check_shape(T)
    node = np.asarray(node)
    to_home = T.reshape(R, R, epn).sum(2)
    return int(to_home[node[:, None] != node[None, :]].sum())


def internode_bound(slots_per_expert: Any, node: np.ndarray, caps: Any = None, weight_rows: int = WEIGHT_ROWS) -> int:
    """Lower bound on ``routed_rows + weight_rows * weight_copies`` of ``internode`` for ANY plan with these caps.

    Two facts every plan obeys, whatever its pairing rules:
    1. Expert e's slots routed by node n (n not e's home node) either cross nodes or are computed by replicas on
       n, each an inter-node weight copy holding at most max(caps) rows. So node n sends at least
       ``x_n(k) = foreign_n - (its k largest cap-sized chunks)`` rows out when it holds k such copies.
    2. Node balance: node n computes exactly C_n = sum of its caps and routes O_n slots, so the rows entering
       it are ``X_n - (O_n - C_n)`` when X_n leave it; both cross, so the total is at least
       ``2 X_n - (O_n - C_n)``. (With two nodes what leaves one enters the other.)
    The bound is ``min over copies k [max(sum_n x_n, max_n 2 x_n - delta_n) + weight_rows * sum_n k_n]``,
    solved exactly by ``_balanced_minimum``. The one-donor rule and slot limits are ignored, so every plan
    (this planner's or any other) costs at least this.
    """
    T = as_counts(slots_per_expert, "slots_per_expert", 2)
    R, E, epn = check_shape(T)
    node = np.asarray(node, dtype=np.int64)
    caps = np.asarray(caps_for(caps, int(T.sum()), R), dtype=np.int64)
    cap = max(1, int(caps.max()))
    N = int(node.max()) + 1
    src = np.zeros((N, E), np.int64)
    np.add.at(src, node, T)  # [nodes, E]: slots of e routed by each node's ranks
    src[node[np.arange(E) // epn], np.arange(E)] = 0  # a home node's own slots never need to cross
    delta = np.bincount(node, T.sum(1), N).astype(np.int64) - np.bincount(node, caps, N).astype(np.int64)
    chunks = [_chunks(src[n], cap) for n in range(N)]
    return _balanced_minimum([int(src[n].sum()) for n in range(N)], chunks, delta, weight_rows)


def _chunks(src: np.ndarray, cap: int) -> np.ndarray:
    """[c] the rows one more replica can take, best first: each count split into cap-sized pieces, descending."""
    full = np.repeat(np.full(src.shape[0], cap, np.int64), src // cap)
    return np.sort(np.concatenate([full, src[src % cap > 0] % cap]))[::-1]


def _balanced_minimum(foreign: list[int], chunks: list[np.ndarray], delta: np.ndarray, w: int) -> int:
    """min over k [max(sum_n x_n(k_n), max_n 2 x_n(k_n) - delta_n) + w * sum_n k_n], x_n(k) = foreign_n -
    (sum of chunks[n][:k]).

    For each level tau that max_n (2 x_n - delta_n) can take: every node takes at least the copies that bring
    its term to <= tau, then the largest remaining chunks (of all nodes) while one lowers max(sum x, tau) by
    more than w. Taking largest chunks first is optimal because each node's chunks are sorted; the smallest
    value over tau is the exact minimum (at the optimum's own tau the relaxation is tight). O(C^2) numpy work
    for C chunks (about E per node): fine for analysis at the bench's sizes (0.3 s at 64 ranks, E = 896), not
    meant for a training loop.
    """
    N = len(foreign)
    x = [f - np.concatenate([[0], np.cumsum(c)]) for f, c in zip(foreign, chunks)]  # x[n][k]
    term = [2 * x[n] - delta[n] for n in range(N)]  # non-increasing in k
    empty = [np.zeros(0, np.int64)]
    size = np.concatenate(list(chunks) + empty)
    order = np.argsort(-size, kind="stable")  # all nodes' chunks, largest first
    size = size[order]
    node_of = np.concatenate([np.full(c.shape[0], n) for n, c in enumerate(chunks)] + empty)[order]
    index = np.concatenate([np.arange(c.shape[0]) for c in chunks] + empty)[order]
    best = None
    for tau in np.unique(np.concatenate(term)):
        kmin = np.array([int(np.searchsorted(-t, -tau)) for t in term])  # first k with term <= tau
        if any(k >= len(t) for k, t in zip(kmin, term)):
            continue
        left = sum(int(x[n][kmin[n]]) for n in range(N))
        extra = size[index >= kmin[node_of]]  # chunks still free, largest first
        after = left - np.concatenate([[0], np.cumsum(extra)])  # sum x after m more copies
        value = np.maximum(after, tau) + w * (int(kmin.sum()) + np.arange(after.shape[0]))
        value = int(value.min())
        best = value if best is None else min(best, value)
    assert best is not None  # the largest tau needs no copy (every kmin is 0): it is never skipped
    return best
