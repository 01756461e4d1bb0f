"""Plain-Python twin of the topology passes of stage B (``planner._topology``), for ``planner.reference``: lists
and loops."""

from __future__ import annotations


def concentrate(members: list[int], bal, caps, step) -> None:
    """A node's leftover deficits, largest first, each filled by the first collector that holds enough own
    rows (first-fit decreasing), else a new collector: few ranks are left to take a cross-node donor."""
    collectors: list[int] = []
    for u in sorted((r for r in members if bal[r] < 0), key=lambda r: (bal[r], r)):
        c = next((c for c in collectors if caps[c] + bal[c] >= -bal[u]), None)
        if c is None:
            collectors.append(u)
        else:
            step(c, u)


def cross_pairs(bal, caps, node, give, take) -> None:
    """Stage B topology pass: take the cross-node pair with the largest positive gain (rows saved minus weight
    copies), split it at once, repeat. Lowest (receiver, donor) on ties."""
    R = len(bal)
    while True:
        options = [
            (give(h, u, -bal[u], False), -u, -h)
            for u in range(R)
            for h in range(R)
            if bal[u] < 0 < bal[h] and node[h] != node[u] and caps[h] + bal[h] >= -bal[u]
        ]
        best = max(options, default=(0, 0, 0))
        if best[0] <= 0:
            return
        take(-best[2], -best[1])


def giver(T, alloc, epn: int, weight_rows: int, node, num_nodes: int):
    """give(h, u, q, take) -> gain: donor h's q slots to u on another node, the experts that save the most
    inter-node rows first (less weight_rows each); take=True also moves them in alloc."""
    R, E = len(T), len(alloc)
    src = [[sum(T[r][e] for r in range(R) if node[r] == n) for e in range(E)] for n in range(num_nodes)]
    on = [[sum(alloc[e][d] for d in range(R) if node[d] == n) for e in range(E)] for n in range(num_nodes)]

    def cross(e: int) -> int:  # fewest inter-node rows of expert e for its current placement
        return sum(max(0, on[n][e] - src[n][e]) for n in range(num_nodes))

    def move(e: int, h: int, u: int, t: int) -> None:
        alloc[e][h] -= t
        alloc[e][u] += t
        on[node[h]][e] -= t
        on[node[u]][e] += t

    def saved(e: int, h: int, u: int, t: int) -> int:  # inter-node rows saved by moving t slots of e
        before = cross(e)
        move(e, h, u, t)
        after = cross(e)
        move(e, u, h, t)
        return before - after

    def give(h: int, u: int, q: int, take: bool) -> int:
        own = [h * epn + j for j in range(epn)]
        over = [max(0, on[node[h]][e] - src[node[h]][e]) for e in own]  # h's node computes beyond its sources
        short = [max(0, src[node[u]][e] - on[node[u]][e]) for e in own]  # u's node routes but does not compute
        t, q = _paying_copies(over, short, [alloc[e][h] for e in own], q, weight_rows)  # (1)
        for j, e in enumerate(own):  # (2) free slots of experts copied anyway
            add = min(max(0, min(max(over[j], short[j]), alloc[e][h]) - t[j]), q) if t[j] else 0
            t[j] += add
            q -= add
        while q > 0:  # (3) more rows of copied experts (one crossing each) or another copy
            spare = sum(alloc[e][h] - t[j] for j, e in enumerate(own) if t[j])
            fresh = [
                (saved(e, h, u, min(alloc[e][h], q)) - (weight_rows if alloc[e][h] < q else 0), alloc[e][h], -j)
                for j, e in enumerate(own)
                if not t[j] and alloc[e][h] > 0
            ]
            best = max(fresh, default=None)
            if spare >= q and (best is None or q <= weight_rows - best[0]):
                for j, e in enumerate(own):
                    add = min(alloc[e][h] - t[j], q) if t[j] else 0
                    t[j] += add
                    q -= add
                break
            assert best is not None  # spare < q: an own expert not taken yet still holds rows
            j = -best[2]
            t[j] = min(alloc[own[j]][h], q)
            q -= t[j]
        gain = sum(saved(e, h, u, t[j]) - weight_rows for j, e in enumerate(own) if t[j])
        for j, e in enumerate(own):
            if take and t[j]:
                move(e, h, u, t[j])
        return gain

    return give


def _paying_copies(over: list[int], short: list[int], held: list[int], q: int, weight_rows: int):
    """Pass (1) of a cross-node hand-over: copies that pay for themselves, the largest first.

    over / short: rows of each of the donor's experts its node computes beyond its sources / the receiver's node
    routes without computing; held: the donor's slots of each. Returns (rows taken per expert, q left)."""
    t = [0] * len(held)
    while q > 0:
        k, j = max(
            ((min(over[j], short[j], held[j], q), -j) for j in range(len(held)) if not t[j] and held[j] > 0),
            default=(0, 0),
        )
        if k <= weight_rows:
            break
        t[-j] = k
        q -= k
    return t, q


def internode_cost(T, alloc, epn: int, weight_rows: int, node, num_nodes: int) -> int:
    """Routed rows crossing nodes (sum over experts and nodes of max(0, computed - routed there)) plus
    weight_rows per replica on another node than its expert's home, recounted from T and alloc."""
    R, E = len(T), len(alloc)
    rows = sum(
        max(0, sum(alloc[e][d] for d in range(R) if node[d] == n) - sum(T[r][e] for r in range(R) if node[r] == n))
        for e in range(E)
        for n in range(num_nodes)
    )
    copies = sum(1 for e in range(E) for d in range(R) if alloc[e][d] > 0 and node[d] != node[e // epn])
    return rows + weight_rows * copies
