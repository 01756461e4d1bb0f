"""Fast path of the planner: stages A–D and the send matrix, compiled with numba.

Every function here is written in the subset of Python that numba compiles; without numba (or with
``MOONEP_PLANNER_NUMBA=0``) the same functions run as plain Python, correct but slow. The plain-Python twin
that the tests compare against is ``planner.reference`` (a separate, list-based implementation).

Stages (names follow ``planner/README.md``):
  A. totals: per-expert load ``cnt [E]``, home-group load ``group [R]``, send base ``send [R, R]``;
  B. pairing: one donor per receiver, ``donor [R]`` and ``gift [R]``;
  C. split: each donor hands ``gift[u]`` slots of its experts to each receiver u -> ``alloc [E, R]``;
  D. layout: ``experts_to_copy [R, slots]`` and padded ``cu_seqlens [R, epn + slots]``;
  E. flows: which source's slots of each split expert go where, ``flows [F, 4]``, ``send_counts [R, R]``.
Errors are reported through ``err [3]`` = (code, a, b) so that the caller raises a ValueError with context.
"""

from __future__ import annotations

import numpy as np

from planner import _inputs, _jit, _topology
from planner._inputs import INT32_MAX, TOPOLOGY_CANDIDATES
from planner._jit import HAS_NUMBA, njit, refresh_cache

__all__ = ["HAS_NUMBA", "plan_arrays"]

# error codes written into err[0]
OK = 0
NEGATIVE = 1  # (r, e): a negative count
CAPS_SUM = 2  # (sum caps, total)
INFEASIBLE = 3  # (h, u): donor h cannot fill receiver u alone (caps too uneven)
TOO_MANY_REPLICAS = 4  # (d, n): rank d needs n replica slots, more than slots_per_rank
TOO_LARGE = 5  # (r, e): a count or a rank's rows do not fit the int32 plan tables
EXPERT_TOO_LARGE = 7  # (e, total): an expert's slots over all ranks do not fit alloc (6: device.OVERFLOW)


@njit(cache=True)
def _totals(T, epn, err, keep, send):
    """Stage A. T [R, E] -> cnt [E]; fills send [R, R] (all of rank r's slots to their home ranks) and keep
    [R, E], the plan's own int32 copy of T, in the same pass (T is the largest input; reading it once
    matters)."""
    R, E = T.shape
    cnt = np.zeros(E, np.int64)
    for r in range(R):
        for h in range(R):
            s = 0
            for j in range(epn):
                v = T[r, h * epn + j]
                if v < 0 and err[0] == OK:
                    err[0] = NEGATIVE
                    err[1] = r
                    err[2] = h * epn + j
                if v > INT32_MAX:
                    if err[0] == OK:
                        err[0] = TOO_LARGE
                        err[1] = r
                        err[2] = h * epn + j
                    v = 0  # the plan is refused anyway; keep the int32 store in range
                keep[r, h * epn + j] = v
                s += v
                cnt[h * epn + j] += v
            send[r, h] = s
    return cnt


@njit(cache=True)
def _pair(h, u, bal, caps, donor, gift, err):
    """Donor h fills receiver u completely; False (and err) when h does not hold enough own rows."""
    amount = -bal[u]
    if caps[h] + bal[h] < amount:  # caps[h] + bal[h] = rows h still holds of its own experts
        err[0] = INFEASIBLE
        err[1] = h
        err[2] = u
        return False
    donor[u] = h
    gift[u] = amount
    bal[h] += bal[u]
    bal[u] = 0
    return True


@njit(cache=True)
def _sticky_pairs(bal, caps, prev_donor, donor, gift, err):
    """Stage B, pass (1): re-pair last plan's (donor, receiver) pairs while both still qualify, the pair with
    the largest donor balance first (lowest receiver on ties). False (and err) on an infeasible step."""
    R = bal.shape[0]
    while True:
        best = -1
        for u in range(R):
            h = prev_donor[u]
            if h >= 0 and bal[u] < 0 and bal[h] > 0 and (best < 0 or bal[h] > bal[prev_donor[best]]):
                best = u
        if best < 0:
            return True
        if not _pair(prev_donor[best], best, bal, caps, donor, gift, err):
            return False


@njit(cache=True)
def _local_pass(bal, caps, node, n, donor, gift, err):
    """Stage B, pass (3) for node n: its largest donor fills its smallest receiver, so the node's donors retire
    as many of its receivers as they can and few deficits are left to feed across nodes. Lowest index on ties.
    False (and err) on an infeasible step."""
    R = bal.shape[0]
    while True:
        h = -1
        u = -1
        for r in range(R):
            if node[r] != n:
                continue
            if bal[r] > 0 and (h < 0 or bal[r] > bal[h]):
                h = r
            if bal[r] < 0 and (u < 0 or bal[r] > bal[u]):
                u = r
        if h < 0 or u < 0:
            return True
        if not _pair(h, u, bal, caps, donor, gift, err):
            return False


@njit(cache=True)
def _global_pass(bal, caps, node, num_nodes, state, donor, gift, err):
    """Stage B, pass (5): the largest deficit first, filled by the largest donor (lowest index on ties).

    Topology-aware plans prefer the largest donor on the receiver's own node (a donor that over-gave may have
    a neighbour that can fill it); with no donor left there, ``_topology.cross_fill`` picks the donor whose
    experts the receiver's node feeds best and hands them over at once.
    """
    R = bal.shape[0]
    while True:
        h = -1
        u = -1
        for r in range(R):
            if bal[r] > 0 and (h < 0 or bal[r] > bal[h]):
                h = r
            if bal[r] < 0 and (u < 0 or bal[r] < bal[u]):
                u = r
        if h < 0 or u < 0:
            return
        if num_nodes > 0:
            for r in range(R):
                if node[r] == node[u] and bal[r] > 0 and (node[h] != node[u] or bal[r] > bal[h]):
                    h = r
        if num_nodes > 1 and node[h] != node[u] and _topology.cross_fill(u, bal, caps, state, donor, gift):
            continue
        if not _pair(h, u, bal, caps, donor, gift, err):
            return


@njit(cache=True)
def _pairing(bal, caps, node, num_nodes, state, donor, gift, err):
    """Stage B, passes (3)-(5). bal [R] (sums to 0) -> donor [R] (-1 = none), gift [R], updated in place.

    Every pass uses the proof's step (a donor holding enough own rows fills the receiver completely), so the
    balance proof holds for each. Passes (1) sticky, (G) topology gathering and (2) topology cross-node run
    before (``_sticky_pairs``, ``_topology.concentrate``, ``_topology.cross_pass``); (3) pairs inside each
    node; (4) topology: ``_topology.concentrate`` gathers each node's leftover deficits on few ranks; (5) the
    global pass. state: ``_topology.cross_state``.
    """
    for n in range(num_nodes):
        if not _local_pass(bal, caps, node, n, donor, gift, err):
            return
    if num_nodes > 1:
        _topology.concentrate(bal, caps, node, num_nodes, donor, gift)
    _global_pass(bal, caps, node, num_nodes, state, donor, gift, err)


@njit(cache=True)
def _ordered_pairing(T, alloc, epn, bal, caps, node, num_nodes, weight_rows, donor, gift, err, gather_first, margin):
    """Stage B with a topology, from the state after the sticky pass, its passes pricing a cross-node copy at
    ``weight_rows * (4 + margin) / 4``; returns the inter-node cost it leaves at ``weight_rows``."""
    decide = weight_rows + weight_rows * margin // 4
    state = _topology.cross_state(T, alloc, epn, node, num_nodes, decide)
    if gather_first:
        _topology.concentrate(bal, caps, node, num_nodes, donor, gift)
    _topology.cross_pass(bal, caps, state, donor, gift)
    _pairing(bal, caps, node, num_nodes, state, donor, gift, err)
    return _topology.internode_cost(state, weight_rows)


@njit(cache=True)
def _topology_pairing(T, alloc, epn, bal, caps, node, num_nodes, weight_rows, donor, gift, err):
    """Stage B with a topology: the ``TOPOLOGY_CANDIDATES``, keeping the plan that leaves the fewest inter-node bytes.

    Gathering each node's deficits first (G) gives large receivers, so a node that routes a hot expert more
    than a replica's worth gets it on few full replicas (zipf counts); without it receivers stay small, so
    more nodes each get a replica of the hot experts they route a little to (896 experts, top-16). With large
    receivers the passes' price of a copy matters: the rows a copy saves are counted when it is chosen, and
    later passes often feed part of them locally anyway, so a copy that pays by a small margin may not pay in
    the finished plan; the 1.25 margin drops those (router loads, 2 x 8 ranks, S = 1024: x0.702 -> x0.689).
    Every cross-node move is in alloc after stage B (cross-node pairs are handed over at once), so the cost
    compared is the plan's final ``metrics.internode`` cost in routed rows when there is no sticky plan
    (sticky cross-node pairs are split in stage C, after the choice). Ties keep the earlier candidate; one
    that hits an infeasible step (uneven caller caps) loses; if all do, err holds the first's.
    """
    bal0, donor0, gift0, alloc0 = bal.copy(), donor.copy(), gift.copy(), alloc.copy()
    margin, gather_first = TOPOLOGY_CANDIDATES[0]  # the first candidate runs in place
    best = _ordered_pairing(
        T, alloc, epn, bal, caps, node, num_nodes, weight_rows, donor, gift, err, gather_first, margin
    )
    if err[0] != OK:
        best = -1
    for i in range(1, len(TOPOLOGY_CANDIDATES)):
        margin, gather_first = TOPOLOGY_CANDIDATES[i]
        bal2, donor2, gift2, alloc2 = bal0.copy(), donor0.copy(), gift0.copy(), alloc0.copy()
        err2 = np.zeros(3, np.int64)
        cost = _ordered_pairing(
            T, alloc2, epn, bal2, caps, node, num_nodes, weight_rows, donor2, gift2, err2, gather_first, margin
        )
        if err2[0] == OK and (best < 0 or cost < best):
            best = cost
            bal[:] = bal2
            donor[:] = donor2
            gift[:] = gift2
            alloc[:, :] = alloc2
            err[:] = err2


@njit(cache=True)
def _split(cnt, epn, donor, gift, prev_copy, alloc):
    """Stage C. Fill alloc [E, R] (diagonal blocks preset to cnt): donor h gives gift[u] slots to each receiver u.

    Sticky plans first refill the slots a receiver already holds; then the largest receiver quota takes the
    largest remaining expert (lowest index on ties), so most (donor, receiver) pairs are one expert segment.
    """
    R = donor.shape[0]
    q = gift.copy()
    rem = np.empty(epn, np.int64)
    recv = np.empty(R, np.int64)
    for h in range(R):
        n = 0
        for u in range(R):
            if donor[u] == h:
                recv[n] = u
                n += 1
        if n == 0:
            continue
        for j in range(epn):
            rem[j] = alloc[h * epn + j, h]  # = cnt unless the topology pass already handed some over
        if prev_copy.shape[0] == R:
            for i in range(n):
                u = recv[i]
                for b in range(prev_copy.shape[1]):
                    e = prev_copy[u, b]
                    if e >= h * epn and e < (h + 1) * epn:
                        t = min(rem[e - h * epn], q[u])
                        alloc[e, u] += t
                        alloc[e, h] -= t
                        rem[e - h * epn] -= t
                        q[u] -= t
        while True:
            u = recv[0]
            for i in range(1, n):
                if q[recv[i]] > q[u]:
                    u = recv[i]
            if q[u] <= 0:
                break
            j = 0
            for jj in range(1, epn):
                if rem[jj] > rem[j]:
                    j = jj
            t = min(rem[j], q[u])  # rem[j] > 0: a donor never gives more than it holds (proof, step 3)
            alloc[h * epn + j, u] += t
            alloc[h * epn + j, h] -= t
            rem[j] -= t
            q[u] -= t


@njit(cache=True)
def _layout(alloc, epn, slots, pad, donor, prev_copy, err):
    """Stage D. -> experts_to_copy [R, slots] (-1 = empty), cu_seqlens [R, epn + slots] (padded segment ends).

    Segments: rank d's epn own experts in id order, then its slots. Fresh plans fill slots in ascending expert
    id; sticky plans keep a replica in the slot it held last step (its weights are already there).
    """
    R = donor.shape[0]
    copy = np.full((R, slots), -1, np.int64)
    cu = np.zeros((R, epn + slots), np.int64)
    sticky = prev_copy.shape[0] == R
    for d in range(R):
        h = donor[d]
        if h >= 0:
            n = 0
            if sticky:
                for b in range(slots):
                    e = prev_copy[d, b]
                    if e >= h * epn and e < (h + 1) * epn and alloc[e, d] > 0:
                        copy[d, b] = e
                        n += 1
            b = 0
            for e in range(h * epn, (h + 1) * epn):
                if alloc[e, d] <= 0:
                    continue
                held = False
                if sticky:
                    for bb in range(slots):
                        if copy[d, bb] == e:
                            held = True
                if held:
                    continue
                while b < slots and copy[d, b] >= 0:
                    b += 1
                n += 1
                if b >= slots:
                    err[0] = TOO_MANY_REPLICAS
                    err[1] = d
                    err[2] = n
                    continue
                copy[d, b] = e
        off = 0
        for g in range(epn + slots):
            c = 0
            if g < epn:
                c = alloc[d * epn + g, d]
            elif copy[d, g - epn] >= 0:
                c = alloc[copy[d, g - epn], d]
            off += (c + pad - 1) // pad * pad
            cu[d, g] = off
    return copy, cu


@njit(cache=True)
def _emit(e, s, d, t, a, b, flows, n, send):
    """Flow n = (e, s, d, t): t rows of expert e from source s to destination d, taken off the remaining source
    rows a [R] and destination rows b [R] and added to send [R, R]. Returns n + 1."""
    flows[n, 0] = e
    flows[n, 1] = s
    flows[n, 2] = d
    flows[n, 3] = t
    send[s, d] += t
    a[s] -= t
    b[d] -= t
    return n + 1


@njit(cache=True)
def _match(a, b, node, which, e, flows, n, send):
    """North-west-corner matching of remaining source rows a [R] with destination rows b [R] of expert e.

    which >= 0 restricts both sides to ranks of that node; -1 matches everything left, in rank order.
    Every step empties a source or a destination, so it emits at most nnz(a) + nnz(b) flows.
    """
    R = a.shape[0]
    s = 0
    d = 0
    while True:
        while s < R and (a[s] == 0 or (which >= 0 and node[s] != which)):
            s += 1
        while d < R and (b[d] == 0 or (which >= 0 and node[d] != which)):
            d += 1
        if s >= R or d >= R:
            return n
        n = _emit(e, s, d, min(a[s], b[d]), a, b, flows, n, send)


@njit(cache=True)
def _flows(T, alloc, cnt, epn, send, node, num_nodes):
    """Stage E. Split experts' slots: flows [F, 4] = (expert, src, dst, rows), sorted; corrects send in place.

    Unsplit experts (all slots at home) need no entry. A split expert's source rows are matched to its
    destinations in rank order (the upstream cut); topology-aware plans first match each rank with itself,
    then sources and destinations inside each node, so a destination is fed by its own node's sources where
    they suffice: per expert this minimises the rows that cross nodes (a 2-level transportation problem,
    where filling each node's destinations from its own sources first is optimal).
    """
    R, E = T.shape
    split = np.empty(E, np.int64)
    ns = 0
    for e in range(E):
        if alloc[e, e // epn] != cnt[e]:
            split[ns] = e
            ns += 1
    cols = np.empty((ns, R), np.int64)  # split experts' columns of T, gathered row by row (T rows are long)
    for r in range(R):
        for k in range(ns):
            cols[k, r] = T[r, split[k]]
    F = 0
    for k in range(ns):
        for r in range(R):
            if cols[k, r] > 0:
                F += 1
            if alloc[split[k], r] > 0:
                F += 1
    flows = np.zeros((F, 4), np.int64)
    b = np.empty(R, np.int64)
    n = 0
    for k in range(ns):
        e = split[k]
        h = e // epn
        a = cols[k]
        for r in range(R):
            b[r] = alloc[e, r]
            send[r, h] -= a[r]
        if num_nodes > 0:  # a source's own rows to itself first: they never leave the rank
            for r in range(R):
                t = min(a[r], b[r])
                if t > 0:
                    n = _emit(e, r, r, t, a, b, flows, n, send)
        for which in range(num_nodes):
            n = _match(a, b, node, which, e, flows, n, send)
        n = _match(a, b, node, -1, e, flows, n, send)
    key = (flows[:n, 0] * R + flows[:n, 1]) * R + flows[:n, 2]  # unique: a (src, dst) pair matches once
    return flows[:n][np.argsort(key)]


@njit(cache=True)
def _caps(cnt, caps_in, R, err):
    """caps [R]: caps_in when given (err CAPS_SUM unless it sums to the total), else floor/ceil of total/R.

    Also refuses an expert whose total does not fit int32 (EXPERT_TOO_LARGE), although each count does: the
    kernel presets alloc[e, home] = cnt[e] before stage B, and a wrapped (negative) entry spins stage C forever."""
    total = 0
    for e in range(cnt.shape[0]):
        total += cnt[e]
        if cnt[e] > INT32_MAX and err[0] == OK:
            err[0] = EXPERT_TOO_LARGE
            err[1] = e
            err[2] = cnt[e]
    caps = np.empty(R, np.int64)
    if caps_in.shape[0] == R:
        s = 0
        for r in range(R):
            caps[r] = caps_in[r]
            s += caps_in[r]
        if s != total and err[0] == OK:
            err[0] = CAPS_SUM
            err[1] = s
            err[2] = total
    else:
        for r in range(R):
            caps[r] = total // R + (1 if r < total % R else 0)
    for r in range(R):
        if caps[r] > INT32_MAX and err[0] == OK:  # alloc entries are bounded by caps: int32 tables suffice
            err[0] = TOO_LARGE
            err[1] = r
            err[2] = -1
    return caps


@njit(cache=True)
def plan_arrays(T, keep, alloc, send, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows):
    """All stages. T [R, E] int64; keep [R, E] int32 (filled with T's copy), alloc [E, R] int32 zeros and
    send [R, R] int64 are the output tables, allocated by the caller (numpy maps such large arrays with
    transparent huge pages; numba's allocator faults them in 4 KiB pages, 3-4x slower at R=1024, E=16384).
    caps_in [R] or [0] (default floor/ceil); prev_* [0] when not sticky; node [R] with num_nodes > 0 when
    topology-aware; weight_rows: one expert copy's cost in routed rows.
    Returns (T copy, caps, alloc, donor, experts_to_copy, cu_seqlens, send_counts, flows, err)."""
    R, E = T.shape
    epn = E // R
    err = np.zeros(3, np.int64)
    cnt = _totals(T, epn, err, keep, send)
    T = keep
    caps = _caps(cnt, caps_in, R, err)
    donor = np.full(R, -1, np.int64)
    gift = np.zeros(R, np.int64)
    copy = np.full((R, slots), -1, np.int64)
    cu = np.zeros((R, epn + slots), np.int64)
    flows = np.zeros((0, 4), np.int64)
    if err[0] != OK:
        return T, caps, alloc, donor, copy, cu, send, flows, err
    bal = np.empty(R, np.int64)
    for h in range(R):
        g = 0
        for j in range(epn):
            g += cnt[h * epn + j]
        bal[h] = g - caps[h]
    for e in range(E):
        alloc[e, e // epn] = cnt[e]
    if prev_donor.shape[0] == R:
        _sticky_pairs(bal, caps, prev_donor, donor, gift, err)
    if num_nodes > 1 and err[0] == OK:
        _topology_pairing(T, alloc, epn, bal, caps, node, num_nodes, weight_rows, donor, gift, err)
    elif err[0] == OK:
        _pairing(
            bal, caps, node, num_nodes, _topology.cross_state(T, alloc, epn, node, 0, weight_rows), donor, gift, err
        )
    if err[0] != OK:
        return T, caps, alloc, donor, copy, cu, send, flows, err
    _split(cnt, epn, donor, gift, prev_copy, alloc)
    copy, cu = _layout(alloc, epn, slots, pad, donor, prev_copy, err)
    flows = _flows(T, alloc, cnt, epn, send, node, num_nodes)
    return T, caps, alloc, donor, copy, cu, send, flows, err


# plan_arrays and _pairing contain _topology's compiled code, but numba's cache only watches this file
refresh_cache(
    globals(), [__file__, _topology.__file__, _jit.__file__, _inputs.__file__], "_kernel.sources.sha256"
)  # _inputs: TOPOLOGY_CANDIDATES is compiled in
