"""Plain-Python twins of the planner's fast paths (``planner._kernel`` and ``Plan.route``): lists and loops.

It follows the pseudo-code of ``planner/README.md`` line by line and is the oracle the tests compare the
compiled path against (the two must give identical plans, tie-breaks included). Slow: use it for R <= ~64.
The topology passes' twin is ``planner.reference_topology``.
"""

from __future__ import annotations

import numpy as np

from planner._inputs import INT32_MAX, TOPOLOGY_CANDIDATES, default_caps, expert_total_message
from planner.reference_topology import concentrate, cross_pairs, giver, internode_cost


def _pairs(bal: list[int], caps: list[int], prev_donor, node, num_nodes: int, topo_args):
    """Stage B: donor[u] (-1 = none) and gift[u]; a step fills the receiver completely.

    topo_args = (T, alloc, epn, weight_rows) for the topology passes (their cross-node pairs split in alloc).
    With a topology, the TOPOLOGY_CANDIDATES run from the state after the sticky pass: gathering first or not with a
    copy priced at weight_rows, then gathering first with a copy priced at 1.25 weight_rows. The one leaving
    the fewest inter-node bytes (at weight_rows) is kept; ties keep the earlier; a candidate that hits an
    infeasible step (uneven caller caps) loses, and if all do, the first one's error is raised.
    """
    R = len(bal)
    donor, gift = [-1] * R, [0] * R
    step, _ = _steps(bal, caps, donor, gift, None)
    if prev_donor is not None:  # sticky pass: keep last step's pairs while both sides still qualify
        while True:
            cands = [u for u in range(R) if prev_donor[u] >= 0 and bal[u] < 0 and bal[prev_donor[u]] > 0]
            if not cands:
                break
            best = max(cands, key=lambda u: (bal[prev_donor[u]], -u))
            step(prev_donor[best], best)
    if num_nodes <= 1:
        _ordered_pairs(bal, caps, node, num_nodes, donor, gift, None, False)
        return donor, gift
    T, alloc, epn, weight_rows = topo_args
    start = (list(bal), list(donor), list(gift), [row[:] for row in alloc])
    best, failure = None, None
    for margin, gather_first in TOPOLOGY_CANDIDATES:
        cand = (list(start[0]), list(start[1]), list(start[2]), [row[:] for row in start[3]])
        give = giver(T, cand[3], epn, weight_rows + weight_rows * margin // 4, node, num_nodes)
        try:
            _ordered_pairs(cand[0], caps, node, num_nodes, cand[1], cand[2], give, gather_first)
        except ValueError as error:
            failure = failure or error
            continue
        cost = internode_cost(T, cand[3], epn, weight_rows, node, num_nodes)
        if best is None or cost < best[0]:
            best = (cost, cand)
    if best is None:
        assert failure is not None  # no candidate kept: each one failed
        raise failure
    for mine, theirs in zip((bal, donor, gift, alloc), best[1]):
        mine[:] = theirs
    return donor, gift


def _steps(bal, caps, donor, gift, give):
    """step(h, u): the proof's step (h fills u completely); take(h, u): a cross-node pair handed over at once."""

    def step(h: int, u: int) -> None:
        if caps[h] + bal[h] < -bal[u]:
            raise ValueError(
                f"caps are too uneven for a one-donor plan: rank {u} needs {-bal[u]} rows "
                f"but its donor rank {h} holds only {caps[h] + bal[h]}"
            )
        donor[u], gift[u] = h, -bal[u]
        bal[h] += bal[u]
        bal[u] = 0

    def take(h: int, u: int) -> None:  # h's experts handed over at once (gift 0: stage C skips u)
        give(h, u, -bal[u], True)
        step(h, u)
        gift[u] = 0

    return step, take


def _ordered_pairs(bal, caps, node, num_nodes: int, donor, gift, give, gather_first: bool) -> None:
    """Stage B after the sticky pass; give: ``giver``'s function with a topology, else None."""
    R = len(bal)
    step, take = _steps(bal, caps, donor, gift, give)
    if give is not None:  # gather each node's deficits first, so cross-node receivers take large, full gifts
        if gather_first:
            for n in range(num_nodes):
                concentrate([r for r in range(R) if node[r] == n], bal, caps, step)
        cross_pairs(bal, caps, node, give, take)
    for n in range(num_nodes):  # pairs inside each node: smallest deficit first, so its donors retire many
        members = [r for r in range(R) if node[r] == n]
        while any(bal[r] > 0 for r in members) and any(bal[r] < 0 for r in members):
            h = max((r for r in members if bal[r] > 0), key=lambda r: (bal[r], -r))
            step(h, min((r for r in members if bal[r] < 0), key=lambda r: (-bal[r], r)))
    if give is not None:
        for n in range(num_nodes):
            concentrate([r for r in range(R) if node[r] == n], bal, caps, step)
    _global_pass(bal, caps, node, num_nodes, step, give, take)


def _global_pass(bal, caps, node, num_nodes: int, step, give, take) -> None:
    """Largest deficit first, filled by the largest donor; topology: the largest on the receiver's node, else
    (cross-node) the feasible donor with the best gain, then the larger balance, then the lowest rank."""
    R = len(bal)
    while any(b > 0 for b in bal) and any(b < 0 for b in bal):
        u = min((r for r in range(R) if bal[r] < 0), key=lambda r: (bal[r], r))
        givers = [r for r in range(R) if bal[r] > 0]
        h = max(givers, key=lambda r: (bal[r], -r))
        near = [r for r in givers if num_nodes and node[r] == node[u]]
        if near:
            h = max(near, key=lambda r: (bal[r], -r))
        fit = [r for r in givers if caps[r] + bal[r] >= -bal[u]]
        if give is not None and not near and fit:
            take(max(fit, key=lambda r: (give(r, u, -bal[u], False), bal[r], -r)), u)
        else:
            step(h, u)


def _split(cnt: list[int], epn: int, donor, gift, prev_copy, alloc: list[list[int]]) -> None:
    """Stage C: alloc[e][d] for the slots each donor hands to its receivers."""
    R = len(donor)
    q = list(gift)
    for h in range(R):
        receivers = [u for u in range(R) if donor[u] == h]
        if not receivers:
            continue
        rem = [alloc[e][h] for e in range(h * epn, (h + 1) * epn)]  # the topology pass may have split some
        if prev_copy is not None:
            for u in receivers:
                for e in prev_copy[u]:
                    if h * epn <= e < (h + 1) * epn:
                        _give(alloc, rem, q, h * epn, e - h * epn, h, u)
        while True:
            u = max(receivers, key=lambda r: (q[r], -r))
            if q[u] <= 0:
                break
            _give(alloc, rem, q, h * epn, max(range(epn), key=lambda j: (rem[j], -j)), h, u)


def _give(alloc: list[list[int]], rem: list[int], q: list[int], base: int, j: int, h: int, u: int) -> None:
    """Stage C's step: donor h gives receiver u as many slots of its expert base + j as u still takes (q[u]) and
    h still holds (rem[j])."""
    t = min(rem[j], q[u])
    alloc[base + j][u] += t
    alloc[base + j][h] -= t
    rem[j] -= t
    q[u] -= t


def _layout(alloc, epn: int, slots: int, pad: int, donor, prev_copy):
    """Stage D: experts_to_copy rows and padded segment ends per rank."""
    R = len(donor)
    copy, cu = [], []
    for d in range(R):
        row = [-1] * slots
        h = donor[d]
        if h >= 0:
            remote = [e for e in range(h * epn, (h + 1) * epn) if alloc[e][d] > 0]
            if prev_copy is not None:
                row = [e if e in remote else -1 for e in prev_copy[d]]
            fresh = [e for e in remote if e not in row]
            free = [b for b in range(slots) if row[b] < 0]
            if len(fresh) > len(free):
                raise ValueError(f"rank {d} needs {len(remote)} replica slots but slots_per_rank={slots}")
            for b, e in zip(free, fresh):
                row[b] = e
        sizes = [alloc[d * epn + j][d] for j in range(epn)] + [alloc[e][d] if e >= 0 else 0 for e in row]
        ends, off = [], 0
        for c in sizes:
            off += -(-c // pad) * pad
            ends.append(off)
        copy.append(row)
        cu.append(ends)
    return copy, cu


def _flows(T, alloc, cnt, epn: int, node, num_nodes: int):
    """Stage E: send[r][d] and the flows (expert, src, dst, rows) of every split expert, sorted."""
    R, E = len(T), len(cnt)
    send = [[0] * R for _ in range(R)]
    flows = []
    for e in range(E):
        h = e // epn
        if alloc[e][h] == cnt[e]:
            for r in range(R):
                send[r][h] += T[r][e]
            continue
        a = [T[r][e] for r in range(R)]
        b = [alloc[e][d] for d in range(R)]
        groups = [[r for r in range(R) if node[r] == n] for n in range(num_nodes)] + [list(range(R))]
        if num_nodes:  # topology: each rank's own rows to itself first
            groups = [[r] for r in range(R)] + groups
        for ranks in groups:  # same-rank, same-node matching first (topology), then all left in rank order
            sources = [r for r in ranks for _ in range(a[r])]
            dests = [d for d in ranks for _ in range(b[d])]
            pairs: dict[tuple[int, int], int] = {}
            for r, d in zip(sources, dests):
                pairs[(r, d)] = pairs.get((r, d), 0) + 1
                a[r] -= 1
                b[d] -= 1
            for (r, d), t in pairs.items():
                send[r][d] += t
                flows.append((e, r, d, t))
    return send, sorted(flows)


def initial_state(T: list[list[int]], caps=None):
    """(cnt [E], caps [R], bal [R], alloc [E][R] with every expert at home) before stage B."""
    R, E = len(T), len(T[0])
    epn = E // R
    cnt = [sum(T[r][e] for r in range(R)) for e in range(E)]
    caps = default_caps(sum(cnt), R) if caps is None else [int(c) for c in caps]
    bal = [sum(cnt[h * epn : (h + 1) * epn]) - caps[h] for h in range(R)]
    alloc = [[cnt[e] if d == e // epn else 0 for d in range(R)] for e in range(E)]
    return cnt, caps, bal, alloc


def plan_reference(
    T,
    caps=None,
    slots=None,
    token_padding=1,
    prev_donor=None,
    prev_copy=None,
    node=None,
    num_nodes=0,
    weight_rows=3 * 2048,
):
    """Same contract as ``planner._kernel.plan_arrays`` but raises ValueError directly.

    T: [R, E] nested lists or array of ints. Returns numpy arrays (caps, alloc [E, R], donor [R],
    experts_to_copy [R, slots], cu_seqlens [R, epn + slots], send_counts [R, R], flows [F, 4]).
    """
    T = [[int(v) for v in row] for row in np.asarray(T).tolist()]
    R, E = len(T), len(T[0])
    epn = E // R
    slots = epn if slots is None else slots
    cnt, caps, bal, alloc = initial_state(T, caps)
    big = [e for e in range(E) if cnt[e] > INT32_MAX]
    if big:  # Python ints never wrap, but the compiled kernels' alloc table is int32: refuse as they do
        raise ValueError(expert_total_message(big[0], cnt[big[0]]))
    pd = None if prev_donor is None else [int(v) for v in prev_donor]
    pc = None if prev_copy is None else [[int(v) for v in row] for row in np.asarray(prev_copy).tolist()]
    nd = None if node is None else [int(v) for v in node]
    donor, gift = _pairs(bal, caps, pd, nd, num_nodes, (T, alloc, epn, weight_rows))
    _split(cnt, epn, donor, gift, pc, alloc)
    copy, cu = _layout(alloc, epn, slots, token_padding, donor, pc)
    send, flows = _flows(T, alloc, cnt, epn, nd, num_nodes)
    arrays = (caps, alloc, donor, copy, cu, send, flows)
    return tuple(
        np.asarray(a, dtype=np.int64).reshape(shape)
        for a, shape in zip(arrays, [(R,), (E, R), (R,), (R, slots), (R, epn + slots), (R, R), (len(flows), 4)])
    )


def slack_reference(T, U: int, prev_donor=None):
    """Twin of the slack pass (``planner.slack``), on lists: (caps [R], hint [R]) for the row bound U, or None
    when some donor finds no receiver. A donor's candidates are sorted by (not fed last step, fits, room,
    index): fed-last-step first, then the smallest room that holds the rest, else the largest room."""
    T = [[int(v) for v in row] for row in np.asarray(T).tolist()]
    R, E = len(T), len(T[0])
    epn = E // R
    g = [sum(T[r][e] for r in range(R) for e in range(h * epn, (h + 1) * epn)) for h in range(R)]
    caps, hint = list(g), [-1] * R
    room = [max(0, U - v) for v in g]
    for h in sorted((h for h in range(R) if g[h] > U), key=lambda h: (-g[h], h)):
        x, caps[h] = g[h] - U, U
        while x > 0:
            free = [u for u in range(R) if room[u] > 0]
            if not free:
                return None
            sticky = [u for u in free if prev_donor is not None and prev_donor[u] == h]
            pool = sticky or free
            fits = [u for u in pool if room[u] >= x]
            u = min(fits, key=lambda u: (room[u], u)) if fits else min(pool, key=lambda u: (-room[u], u))
            t = min(room[u], x)
            hint[u], caps[u], room[u], x = h, caps[u] + t, 0, x - t
    return caps, hint


def route_reference(plan, rank: int, topk_idx) -> tuple[list[int], list[int]]:
    """Plain-Python twin of ``Plan.route``: (dest_rank, dest_row) of each entry of flattened topk_idx."""
    T = plan.slots_per_expert.tolist()
    R, E = len(T), len(T[0])
    epn = E // R
    flows = [tuple(int(v) for v in f) for f in plan.flows.tolist()]
    copy = plan.experts_to_copy.tolist()
    cu = plan.cu_seqlens.tolist()

    def segment_start(d: int, e: int) -> int:
        g = e - d * epn if e // epn == d else epn + copy[d].index(e)
        return cu[d][g - 1] if g > 0 else 0

    seen = [0] * E  # occurrences of each expert so far in this rank's list
    dests, rows = [], []
    for e in [int(v) for v in list(topk_idx.reshape(-1))]:
        i = seen[e]
        seen[e] += 1
        mine = [f for f in flows if f[0] == e and f[1] == rank]
        if not any(f[0] == e for f in flows):  # unsplit: everything home, in source order
            d = e // epn
            dests.append(d)
            rows.append(segment_start(d, e) + sum(T[r][e] for r in range(rank)) + i)
            continue
        for _, _, d, c in mine:  # this rank's slots of e go to its flows in destination order
            if i < c:
                before = sum(f[3] for f in flows if f[0] == e and f[2] == d and f[1] < rank)
                dests.append(d)
                rows.append(segment_start(d, e) + before + i)
                break
            i -= c
    return dests, rows
