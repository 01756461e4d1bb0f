"""Topology-aware pass of stage B (compiled with numba): cross-node pairs that pay for their weight copy.

A 2-level topology (nodes of ranks) makes a routed row cheap inside a node and expensive across nodes, and a
replica on another node costs one expert's weights (``weight_rows`` routed rows' worth of bytes, 3*H' for a
bf16 gate/up/down FFN). Given where an expert is computed, the fewest routed rows that cross nodes are
``cross(e) = sum_n max(0, alloc_n(e) - src_n(e))`` (``src_n``: its slots held by node n's ranks; stage E's
node-first matching reaches this). So a replica of a hot expert on a node that holds many of its slots feeds
them locally: worth it when the gift is larger than the weight copy (many tokens per rank), never when it is
not (few tokens per rank, where the node-local passes keep weights inside nodes).

This pass runs after the sticky pass and before the node-local passes. Each step is the ordinary step of the
proof (a donor with positive balance fills a receiver with negative balance completely), so exact balance
holds unchanged; the donor's experts are handed over at once (the split of stage C for that pair), and the
receiver's gift is set to 0 so that stage C does not hand them over again.
"""
from __future__ import annotations

import numpy as np

from ._jit import njit


@njit(cache=True)
def cross_state(T, alloc, epn, node, num_nodes, weight_rows):
    """State shared by the topology steps: (epn, node [R], src [N, E], on_node [N, E], alloc [E, R],
    weight_rows, scratch [epn]). src[n, e]: slots of e held by node n's ranks (from T [R, E]); on_node[n, e]:
    slots of e computed on node n (from alloc). num_nodes = 0 gives an empty state (plans without topology)."""
    R, E = T.shape
    src = np.zeros((num_nodes, E), np.int64)
    on_node = np.zeros((num_nodes, E), np.int64)
    if num_nodes > 0:
        for r in range(R):
            n = node[r]
            for e in range(E):
                src[n, e] += T[r, e]
        for e in range(E):
            for d in range(R):
                on_node[node[d], e] += alloc[e, d]
    return epn, node, src, on_node, alloc, weight_rows, np.zeros(epn, np.bool_)


@njit(cache=True)
def _saved(a_h, s_h, a_u, s_u, t):
    """Inter-node rows saved by moving t slots of an expert from node H (a_h computed there, s_h held by its
    ranks) to node U (a_u, s_u): the change of sum_n max(0, a_n - s_n)."""
    before = max(0, a_h - s_h) + max(0, a_u - s_u)
    after = max(0, a_h - t - s_h) + max(0, a_u + t - s_u)
    return before - after


@njit(cache=True)
def hand_over(h, u, q, state, take):
    """Donor h gives q slots to receiver u (on another node); returns the gain in routed rows.

    gain = inter-node rows saved (change of ``cross(e)``) minus ``weight_rows`` per expert copied to u.
    Experts one at a time (all of its remaining slots, up to q), the one saving the most inter-node rows
    first, less ``weight_rows`` if it cannot cover q alone (then another copy follows); ties: most remaining
    slots, lowest index (stage C's order, so without savings this gives what stage C gives). take=False only
    evaluates; take=True also moves the slots in alloc [E, R] and on_node [N, E] (state: ``cross_state``).
    """
    epn, node, src, on_node, alloc, weight_rows, used = state
    nh = node[h]
    nu = node[u]
    for j in range(epn):
        used[j] = False
    gain = 0
    while q > 0:
        best = -1
        best_score = 0
        for j in range(epn):
            e = h * epn + j
            r = alloc[e, h]
            if used[j] or r <= 0:
                continue
            score = _saved(on_node[nh, e], src[nh, e], on_node[nu, e], src[nu, e], min(r, q))
            if r < q:  # a partial expert leaves slots that need another copy
                score -= weight_rows
            if best < 0 or score > best_score or (score == best_score and r > alloc[h * epn + best, h]):
                best = j
                best_score = score
        if best < 0:  # cannot happen: the pair was checked feasible (a donor holds what it gives)
            break
        e = h * epn + best
        t = min(alloc[e, h], q)
        gain += _saved(on_node[nh, e], src[nh, e], on_node[nu, e], src[nu, e], t) - weight_rows
        used[best] = True
        q -= t
        if take:
            alloc[e, h] -= t
            alloc[e, u] += t
            on_node[nh, e] -= t
            on_node[nu, e] += t
    return gain


@njit(cache=True)
def cross_pass(bal, caps, state, donor, gift):
    """Stage B, topology pass: while some cross-node (donor, receiver) pair has a positive gain, take the best.

    bal [R] balances (updated), caps [R], state from ``cross_state`` (alloc updated: only home slots given
    away so far), donor/gift [R] (updated; gift 0 = already split). Ties: lowest (u, h). O(R^3 epn^2) worst
    case; only topology-aware plans run it.
    """
    node = state[1]
    R = bal.shape[0]
    while True:
        best_h = -1
        best_u = -1
        best = 0
        for u in range(R):
            if bal[u] >= 0:
                continue
            for h in range(R):
                if bal[h] <= 0 or node[h] == node[u] or caps[h] + bal[h] < -bal[u]:
                    continue
                g = hand_over(h, u, -bal[u], state, False)
                if g > best:
                    best, best_h, best_u = g, h, u
        if best_h < 0:
            return
        hand_over(best_h, best_u, -bal[best_u], state, True)
        donor[best_u] = best_h
        gift[best_u] = 0
        bal[best_h] += bal[best_u]
        bal[best_u] = 0
