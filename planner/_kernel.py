"""Fast path of the planner: stages A–D and the send matrix, compiled with numba.

Every function here is written in the subset of Python that numba compiles; without numba (or with
``MOONEP_PLANNER_NUMBA=0``) the same functions run as plain Python, correct but slow. The steps this kernel
shares with the CUDA kernel (``planner._device_kernel``) are written once in ``planner._stages``; this module is
the CPU's driver: its loops, its allocations, the topology passes and stage E's sort. The plain-Python twin
that the tests compare against is ``planner.reference`` (a separate, list-based implementation).

Stages (names follow ``planner/README.md``):
  A. totals: per-expert load ``cnt [E]``, home-group load ``group [R]``, send base ``send [R, R]``;
  B. pairing: one donor per receiver, ``donor [R]`` and ``gift [R]``;
  C. split: each donor hands ``gift[u]`` slots of its experts to each receiver u -> ``alloc [E, R]``;
  D. layout: ``experts_to_copy [R, slots]`` and padded ``cu_seqlens [R, epn + slots]``;
  E. flows: which source's slots of each split expert go where, ``flows [F, 4]``, ``send_counts [R, R]``.
Errors are reported through ``err [3]`` = (code, a, b) (``planner._errors``) so that the caller raises a
ValueError with context.
"""

from __future__ import annotations

import numpy as np

from planner import _errors, _inputs, _jit, _stages, _topology
from planner._errors import NEGATIVE, OK, TOO_LARGE, TOO_MANY_REPLICAS
from planner._inputs import INT32_MAX, TOPOLOGY_CANDIDATES
from planner._jit import HAS_NUMBA, njit, refresh_cache

__all__ = ["HAS_NUMBA", "plan_arrays"]


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
                if v < 0:
                    _stages.report(err, NEGATIVE, r, h * epn + j)
                if v > INT32_MAX:
                    _stages.report(err, TOO_LARGE, r, h * epn + j)
                    v = 0  # the plan is refused anyway; keep the int32 store in range
                keep[r, h * epn + j] = v
                s += v
                cnt[h * epn + j] += v
            send[r, h] = s
    return cnt


@njit(cache=True)
def _local_pass(bal, caps, node, n, donor, gift, err):
    """Stage B, pass (3) for node n: its largest donor fills its smallest receiver, so the node's donors retire
    as many of its receivers as they can and few deficits are left to feed across nodes. Lowest index on ties.
    False (and err) on an infeasible step."""
    while True:
        h, u = _stages.extremes(bal, node, n)
        if h < 0 or u < 0:
            return True
        if not _stages.pair(h, u, bal, caps, donor, gift, err):
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
        h, u = _stages.extremes(bal, node, -1)
        if h < 0 or u < 0:
            return
        if num_nodes > 0:
            for r in range(R):
                if node[r] == node[u] and bal[r] > 0 and (node[h] != node[u] or bal[r] > bal[h]):
                    h = r
        if num_nodes > 1 and node[h] != node[u] and _topology.cross_fill(u, bal, caps, state, donor, gift):
            continue
        if not _stages.pair(h, u, bal, caps, donor, gift, err):
            return


@njit(cache=True)
def _pairing(bal, caps, node, num_nodes, state, donor, gift, err):
    """Stage B, passes (3)-(5). bal [R] (sums to 0) -> donor [R] (-1 = none), gift [R], updated in place.

    Every pass uses the proof's step (a donor holding enough own rows fills the receiver completely), so the
    balance proof holds for each. Passes (1) sticky, (G) topology gathering and (2) topology cross-node run
    before (``_stages.sticky_pass``, ``_topology.concentrate``, ``_topology.cross_pass``); (3) pairs inside each
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
def _split(epn, donor, gift, prev_copy, alloc):
    """Stage C. Fill alloc [E, R] (diagonal blocks preset to cnt): donor h gives gift[u] slots to each receiver
    u (``_stages.split_donor``; consumes gift)."""
    R = donor.shape[0]
    rem = np.empty(epn, np.int64)
    recv = np.empty(R, np.int64)
    for h in range(R):
        _stages.split_donor(h, epn, donor, gift, prev_copy, prev_copy.shape[0] == R, alloc, rem, recv)


@njit(cache=True)
def _layout(alloc, epn, pad, donor, prev_copy, copy, cu, err):
    """Stage D (``_stages.layout_rank``): fills copy = experts_to_copy [R, slots] (preset to -1) and cu =
    cu_seqlens [R, epn + slots] (padded segment ends); err TOO_MANY_REPLICAS names the last slot overflow."""
    R = donor.shape[0]
    for d in range(R):
        over = _stages.layout_rank(d, alloc, epn, pad, donor, prev_copy, prev_copy.shape[0] == R, copy, cu)
        if over > 0:
            err[0] = TOO_MANY_REPLICAS
            err[1] = d
            err[2] = over


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
def plan_arrays(T, keep, alloc, send, caps_in, slots, pad, prev_donor, prev_copy, node, num_nodes, weight_rows):
    """All stages: the plan of T.

    Args:
        T: [R, E] int64 counts. keep: [R, E] int32, alloc: [E, R] int32 zeros and send: [R, R] int64: output
            tables from the caller (numpy maps such large arrays with transparent huge pages; numba's allocator
            faults them in 4 KiB pages, 3-4x slower at R=1024, E=16384); keep gets T's copy.
        caps_in: [R] int64, or [0] (floor/ceil). slots, pad: replica slots per rank, token padding.
        prev_donor: [R] int64 and prev_copy: [R, slots] int64 of a sticky plan, or [0] / [0, slots].
        node: [R] int64 with num_nodes > 0 when topology-aware; weight_rows: a copy's cost in routed rows.
    Returns:
        (T copy [R, E] int32, caps [R], alloc [E, R] int32, donor [R], experts_to_copy [R, slots], cu_seqlens
        [R, epn + slots], send_counts [R, R], flows [F, 4], err [3]), int64 unless said.
    """
    R, E = T.shape
    epn = E // R
    err = np.zeros(3, np.int64)
    cnt = _totals(T, epn, err, keep, send)
    T = keep
    caps = np.empty(R, np.int64)
    _stages.fill_caps(cnt, caps_in, caps_in.shape[0] == R, caps, err)
    donor = np.full(R, -1, np.int64)
    gift = np.zeros(R, np.int64)
    copy = np.full((R, slots), -1, np.int64)
    cu = np.zeros((R, epn + slots), np.int64)
    flows = np.zeros((0, 4), np.int64)
    if err[0] != OK:
        return T, caps, alloc, donor, copy, cu, send, flows, err
    bal = np.empty(R, np.int64)
    _stages.start_balance(cnt, caps, epn, bal, alloc)
    if prev_donor.shape[0] == R:
        _stages.sticky_pass(bal, caps, prev_donor, donor, gift, err)
    if num_nodes > 1 and err[0] == OK:
        _topology_pairing(T, alloc, epn, bal, caps, node, num_nodes, weight_rows, donor, gift, err)
    elif err[0] == OK:
        _pairing(
            bal, caps, node, num_nodes, _topology.cross_state(T, alloc, epn, node, 0, weight_rows), donor, gift, err
        )
    if err[0] != OK:
        return T, caps, alloc, donor, copy, cu, send, flows, err
    _split(epn, donor, gift, prev_copy, alloc)
    _layout(alloc, epn, pad, donor, prev_copy, copy, cu, err)
    flows = _flows(T, alloc, cnt, epn, send, node, num_nodes)
    return T, caps, alloc, donor, copy, cu, send, flows, err


# plan_arrays contains _topology's and _stages's compiled code, but numba's cache only watches this file;
# _inputs and _errors: TOPOLOGY_CANDIDATES, INT32_MAX and the error codes are compiled in
_SOURCES = (__file__, _topology.__file__, _stages.__file__, _jit.__file__, _inputs.__file__, _errors.__file__)
refresh_cache(globals(), _SOURCES, "_kernel.sources.sha256")
