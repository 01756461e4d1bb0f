"""Topology-aware passes of stage B (compiled with numba): cross-node pairs that pay for their weight copy,
few cross-node receivers, and the donor whose experts the receiver's node feeds best.

A 2-level topology (nodes of ranks) makes a routed row cheap inside a node and expensive across nodes, and a
replica on another node costs one expert's weights (``weight_rows`` routed rows' worth of bytes, 3*H' for a
bf16 gate/up/down FFN). Given where an expert is computed, the fewest routed rows that cross nodes are
``cross(e) = sum_n max(0, alloc_n(e) - src_n(e))`` (``src_n``: its slots held by node n's ranks; stage E's
node-first matching reaches this). So a replica of a hot expert on a node that holds many of its slots feeds
them locally: worth it when the gift is larger than the weight copy (many tokens per rank), never when it is
not (few tokens per rank, where what counts is how few replicas cross nodes).

Passes, in the order ``_kernel`` runs them after the sticky pass: ``concentrate`` (each node's deficits on
few ranks, so cross-node receivers are few and large); ``cross_pass`` (pairs with a positive gain); the
node-local pairs (``_kernel``); ``concentrate`` again (a node's leftover deficit); the global pass, whose
cross-node pairs ``cross_fill`` gives to the donor with the best gain. ``_kernel`` also runs them without the
first ``concentrate``, and with it again pricing a copy at 1.25 ``weight_rows``, and keeps the plan with the
lowest ``internode_cost``. Every step fills its receiver completely from one donor that holds enough own rows,
the step of the proof in ``planner/README.md``, so exact balance holds unchanged. A cross-node pair's slots are
handed over at once, chosen by ``hand_over`` (not
stage C's order), and the receiver's gift is set to 0 so that stage C does not hand any over again.
"""

from __future__ import annotations

import numpy as np

from planner._jit import njit


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
def internode_cost(state, weight_rows):
    """Routed rows crossing nodes (``sum_n max(0, on_node - src)``, what stage E reaches) plus ``weight_rows``
    per replica on another node than its expert's home (the true copy cost, not the state's decision price)."""
    epn, node, src, on_node, alloc, _, used = state
    N, E = src.shape
    cost = 0
    for n in range(N):
        for e in range(E):
            cost += max(0, on_node[n, e] - src[n, e])
    for e in range(E):
        home = node[e // epn]
        for d in range(alloc.shape[1]):
            if alloc[e, d] > 0 and node[d] != home:
                cost += weight_rows
    return cost


@njit(cache=True)
def _saved(a_h, s_h, a_u, s_u, t):
    """Inter-node rows saved by moving t slots of an expert from node H (a_h computed there, s_h held by its
    ranks) to node U (a_u, s_u): the change of sum_n max(0, a_n - s_n)."""
    before = max(0, a_h - s_h) + max(0, a_u - s_u)
    after = max(0, a_h - t - s_h) + max(0, a_u + t - s_u)
    return before - after


@njit(cache=True)
def gain_bound(h, u, q, state):
    """Upper bound on ``hand_over(h, u, q, state, False)`` in O(epn), to skip donors that cannot win.

    Moving t slots of e to node U saves at most min(t, max(0, src_U(e) - on_U(e))) inter-node rows (the rows
    U routes to e that are still computed elsewhere), and at least one expert is copied.
    """
    epn, node, src, on_node, alloc, weight_rows, used = state
    nu = node[u]
    local = 0
    for j in range(epn):
        e = h * epn + j
        if alloc[e, h] > 0:
            local += min(alloc[e, h], max(0, src[nu, e] - on_node[nu, e]))
    return min(q, local) - weight_rows


@njit(cache=True)
def _paying_rows(h, u, q, state, t):
    """Steps (1)-(2) of ``hand_over``: the rows of each expert whose copy pays, then the free rows of the copied
    experts; t [epn] (zeros in) gets the slots per expert, used [epn] marks the copies. Returns q left."""
    epn, node, src, on_node, alloc, weight_rows, used = state
    nh = node[h]
    nu = node[u]
    while q > 0:  # (1) the largest paying copy first (ties: lowest index)
        best = -1
        best_k = weight_rows
        for j in range(epn):
            e = h * epn + j
            if used[j] or alloc[e, h] <= 0:
                continue
            k = min(max(0, on_node[nh, e] - src[nh, e]), max(0, src[nu, e] - on_node[nu, e]), alloc[e, h], q)
            if k > best_k:
                best, best_k = j, k
        if best < 0:
            break
        used[best] = True
        t[best] = best_k
        q -= best_k
    for j in range(epn):  # (2) rows that save nothing and cost nothing on experts copied anyway
        if used[j] and q > 0:
            e = h * epn + j
            flat = min(max(on_node[nh, e] - src[nh, e], src[nu, e] - on_node[nu, e]), alloc[e, h]) - t[j]
            add = min(max(0, flat), q)
            t[j] += add
            q -= add
    return q


@njit(cache=True)
def _remaining_rows(h, u, q, state, t):
    """Step (3) of ``hand_over``: the last q slots, as more rows of copied experts (each crosses nodes once)
    while that is cheaper than another copy, else another expert (``hand_over``'s order); updates t, used."""
    epn, node, src, on_node, alloc, weight_rows, used = state
    nh = node[h]
    nu = node[u]
    while q > 0:
        spare = 0
        for j in range(epn):
            if used[j]:
                spare += alloc[h * epn + j, h] - t[j]
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
        if spare >= q and (best < 0 or q <= weight_rows - best_score):
            for j in range(epn):
                if used[j] and q > 0:
                    add = min(alloc[h * epn + j, h] - t[j], q)
                    t[j] += add
                    q -= add
            return
        if best < 0:  # cannot happen: the pair was checked feasible (a donor holds what it gives)
            return
        used[best] = True
        t[best] = min(alloc[h * epn + best, h], q)
        q -= t[best]


@njit(cache=True)
def hand_over(h, u, q, state, take):
    """Donor h gives q slots to receiver u (on another node); returns the gain in routed rows.

    gain = inter-node rows saved (change of ``cross(e)``) minus ``weight_rows`` per expert copied to u. Moving
    t slots of e saves ``min(t, p) - max(0, t - d)`` rows (p: rows of e that h's node computes beyond its
    own sources, d: rows of e that u's node routes but does not compute): +1 a slot up to min(p, d), 0 up to
    max(p, d), -1 beyond. So the receiver takes (1) from each expert whose copy pays (min(p, d) > weight_rows,
    best first) just those slots, (2) the free slots of the experts it copies anyway, (3) for the rest of q
    more slots of those experts (one row each) while that is cheaper than another copy, else another expert:
    the one saving the most, less ``weight_rows`` if it cannot cover the rest alone, ties most remaining
    slots, lowest index (stage C's order, so without savings this gives what stage C gives). take=False only
    evaluates; take=True also moves the slots in alloc [E, R] and on_node [N, E] (state: ``cross_state``).
    """
    epn, node, src, on_node, alloc, weight_rows, used = state
    nh = node[h]
    nu = node[u]
    t = np.zeros(epn, np.int64)
    for j in range(epn):
        used[j] = False
    _remaining_rows(h, u, _paying_rows(h, u, q, state, t), state, t)
    gain = 0
    for j in range(epn):
        if used[j]:
            e = h * epn + j
            gain += _saved(on_node[nh, e], src[nh, e], on_node[nu, e], src[nu, e], t[j]) - weight_rows
            if take:
                alloc[e, h] -= t[j]
                alloc[e, u] += t[j]
                on_node[nh, e] -= t[j]
                on_node[nu, e] += t[j]
    return gain


@njit(cache=True)
def _take(h, u, bal, state, donor, gift):
    """Record the cross-node pair (h, u) and hand h's experts over at once (gift 0: stage C skips u)."""
    hand_over(h, u, -bal[u], state, True)
    donor[u] = h
    gift[u] = 0
    bal[h] += bal[u]
    bal[u] = 0


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
                if gain_bound(h, u, -bal[u], state) <= best:  # cannot beat the best pair so far
                    continue
                g = hand_over(h, u, -bal[u], state, False)
                if g > best:
                    best, best_h, best_u = g, h, u
        if best_h < 0:
            return
        _take(best_h, best_u, bal, state, donor, gift)


@njit(cache=True)
def concentrate(bal, caps, node, num_nodes, donor, gift):
    """Stage B, passes (G) and (4): gather each node's deficits on few ranks (first-fit decreasing).

    Run first, it gives the cross-node pass receivers short by up to a whole rank, so a hot expert's node
    demand lands on few, full replicas. Run after the node-local pairs, a node holds only deficits or only
    surpluses, and each deficit rank left would need its own donor from another node (at least one replica
    crossing nodes each). Either way the node's ranks fill each other first: taking deficits largest first, a
    rank joins the first collector that still holds enough own rows to fill it (caps[c] + bal[c] >= -bal[u],
    checked: the proof's step with a donor whose balance is negative), else opens a collector. A collector
    gives its own rows inside the node and takes its gathered deficit (<= caps) from one donor later, so
    cross-node receivers drop from the deficit ranks to about deficit / caps. Ties: lowest rank. O(R * collectors).
    """
    R = bal.shape[0]
    items = np.empty(R, np.int64)
    bins = np.empty(R, np.int64)
    for n in range(num_nodes):
        m = 0
        for r in range(R):
            if node[r] == n and bal[r] < 0:
                items[m] = r
                m += 1
        order = np.argsort(bal[items[:m]], kind="mergesort")  # largest deficit first; stable: lowest rank
        nb = 0
        for i in range(m):
            u = items[order[i]]
            k = 0
            while k < nb and caps[bins[k]] + bal[bins[k]] < -bal[u]:
                k += 1
            if k == nb:
                bins[nb] = u
                nb += 1
                continue
            c = bins[k]
            donor[u] = c
            gift[u] = -bal[u]
            bal[c] += bal[u]
            bal[u] = 0


@njit(cache=True)
def cross_fill(u, bal, caps, state, donor, gift):
    """Global pass, receiver u with no donor left on its node: the positive donor whose hand-over gains most.

    Gain as in ``hand_over`` (rows the receiver's node then feeds locally, less ``weight_rows`` per expert
    copied), so a collector takes a hot expert that its node routes to, in as few copies as possible. Ties:
    larger balance, then lowest rank. Only donors holding -bal[u] own rows qualify; False when there is none
    (the caller's ordinary step then reports the infeasible pair). Donors are tried by decreasing
    ``gain_bound`` and the rest skipped once no bound can beat the best gain (same choice, fewer hand-overs).
    """
    R = bal.shape[0]
    q = -bal[u]
    bound = np.full(R, -(1 << 62))  # ineligible donors: below any gain (negation stays in range)
    for h in range(R):
        if bal[h] > 0 and caps[h] + bal[h] >= q:
            bound[h] = gain_bound(h, u, q, state)
    order = np.argsort(-bound, kind="mergesort")
    best = -1
    best_gain = 0
    for i in range(R):
        h = order[i]
        if bal[h] <= 0 or caps[h] + bal[h] < q:
            continue
        if best >= 0 and bound[h] < best_gain:
            break  # bounds only decrease from here
        g = hand_over(h, u, q, state, False)
        if (
            best < 0
            or g > best_gain
            or (g == best_gain and bal[h] > bal[best])
            or (g == best_gain and bal[h] == bal[best] and h < best)
        ):
            best = h
            best_gain = g
    if best < 0:
        return False
    _take(best, u, bal, state, donor, gift)
    return True
