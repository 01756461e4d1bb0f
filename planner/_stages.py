"""The planner's stage steps written once, for both kernels: the CPU's ``planner._kernel`` and the CUDA
``planner._device_kernel``.

Every function here is target-neutral: integer loops over arrays it is handed, no allocation, no
target-specific calls, and calls to each other by bare name. Here they are compiled with numba's ``njit``
(the CPU kernel calls them; without numba they run as plain Python); ``planner._cuda.device_functions``
re-binds the same source as numba-cuda device functions calling each other (the device kernel calls those).
Each kernel keeps only its driver: the CPU's loops and allocations, the device's threads and barriers.
Stage names follow ``planner/README.md`` (B: pairing, C: split, D: layout); errors go to ``err [3]`` =
(code, a, b) with the codes of ``planner._errors``.
"""

from __future__ import annotations

from planner import _errors, _inputs
from planner._errors import CAPS_SUM, EXPERT_TOO_LARGE, INFEASIBLE, OK, TOO_LARGE
from planner._inputs import INT32_MAX
from planner._jit import njit, refresh_cache


@njit(cache=True)
def report(err, code, a, b):
    """Write the error triple err [3] int64 = (code, a, b), unless an earlier error is there already."""
    if err[0] == OK:
        err[0] = code
        err[1] = a
        err[2] = b


@njit(cache=True)
def fill_caps(cnt, caps_in, has_caps, caps, err):
    """Rows each rank computes, refusing what the int32 plan tables cannot hold.

    Args:
        cnt: [E] int64 slots per expert; a total beyond int32 is EXPERT_TOO_LARGE (the kernels preset
            alloc[e, home] = cnt[e]: a wrapped entry would spin stage C forever). err: [3] int64.
        caps_in: [R] int64 caller caps, read when has_caps (CAPS_SUM unless they sum to the total).
        caps: [R] int64, filled: caps_in, else floor/ceil of total / R (the first total % R ranks + 1).
    """
    R = caps.shape[0]
    total = 0
    for e in range(cnt.shape[0]):
        total += cnt[e]
        if cnt[e] > INT32_MAX:
            report(err, EXPERT_TOO_LARGE, e, cnt[e])
    if has_caps:
        s = 0
        for r in range(R):
            caps[r] = caps_in[r]
            s += caps_in[r]
        if s != total:
            report(err, CAPS_SUM, s, total)
    else:
        for r in range(R):
            caps[r] = total // R + (1 if r < total % R else 0)
    for r in range(R):
        if caps[r] > INT32_MAX:  # alloc entries are bounded by caps: int32 tables suffice
            report(err, TOO_LARGE, r, -1)


@njit(cache=True)
def start_balance(cnt, caps, epn, bal, alloc):
    """Before stage B: bal [R] int64 = home-group load - caps (sums to 0); alloc [E, R] int32 gets every
    expert's slots at home (cnt [E] int64 on its home rank's column)."""
    R = bal.shape[0]
    for h in range(R):
        g = 0
        for j in range(epn):
            g += cnt[h * epn + j]
        bal[h] = g - caps[h]
    for e in range(cnt.shape[0]):
        alloc[e, e // epn] = cnt[e]


@njit(cache=True)
def pair(h, u, bal, caps, donor, gift, err):
    """Stage B's step (the proof's): donor h fills receiver u completely.

    Args:
        bal, caps, donor, gift: [R] int64 balances, caps, donor per receiver (-1 = none), rows given;
            updated in place.
    Returns:
        False (and INFEASIBLE (h, u) in err [3]) when h does not hold enough own rows, else True.
    """
    amount = -bal[u]
    if caps[h] + bal[h] < amount:  # caps[h] + bal[h] = rows h still holds of its own experts
        report(err, INFEASIBLE, h, u)  # the first error: stage B stops at it
        return False
    donor[u] = h
    gift[u] = amount
    bal[h] += bal[u]
    bal[u] = 0
    return True


@njit(cache=True)
def sticky_pass(bal, caps, prev_donor, donor, gift, err):
    """Stage B, pass (1): re-pair last plan's (donor, receiver) pairs while both still qualify, the pair with
    the largest donor balance first (lowest receiver on ties). prev_donor [R] int64 (-1 = none); the rest as
    in ``pair``. Returns False on an infeasible step."""
    R = bal.shape[0]
    while True:
        best = -1
        for u in range(R):
            h = prev_donor[u]
            if h >= 0 and bal[u] < 0 and bal[h] > 0 and (best < 0 or bal[h] > bal[prev_donor[best]]):
                best = u
        if best < 0:
            return True
        if not pair(prev_donor[best], best, bal, caps, donor, gift, err):
            return False


@njit(cache=True)
def extremes(bal, node, which):
    """Stage B's next pair (donor h, receiver u) of bal [R] int64, lowest index on ties, -1 where there is none.
    which < 0: the largest donor and the largest deficit of all ranks (the global pass); which >= 0: the largest
    donor and the smallest deficit among node ``which``'s ranks (the node-local pass; node [R] int64 is read
    only then)."""
    h = -1
    u = -1
    for r in range(bal.shape[0]):
        if which >= 0 and node[r] != which:
            continue
        if bal[r] > 0 and (h < 0 or bal[r] > bal[h]):
            h = r
        if bal[r] < 0 and (u < 0 or (bal[r] > bal[u] if which >= 0 else bal[r] < bal[u])):
            u = r
    return h, u


@njit(cache=True)
def split_donor(h, epn, donor, quota, prev_copy, sticky, alloc, rem, recv):
    """Stage C for donor h: quota[u] slots of h's experts to each receiver u of h.

    Sticky plans first refill the slots a receiver already holds; then the largest receiver quota takes the
    largest remaining expert (lowest index on ties), so most (donor, receiver) pairs are one expert segment.

    Args:
        donor: [R] int64 stage B's donor per receiver. prev_copy: [R, slots] int64, read when sticky.
        quota: [R] int64 rows each receiver still takes (stage B's gift); h's receivers' entries are consumed.
        alloc: [E, R] int32, home columns preset; h's experts' slots move to the receivers' columns.
        rem: [epn] int64 and recv: [R] int64, scratch of this donor.
    """
    R = donor.shape[0]
    n = 0
    for u in range(R):
        if donor[u] == h:
            recv[n] = u
            n += 1
    if n == 0:
        return
    for j in range(epn):
        rem[j] = alloc[h * epn + j, h]  # = cnt unless the topology pass already handed some over
    if sticky:
        for i in range(n):
            u = recv[i]
            for b in range(prev_copy.shape[1]):
                e = prev_copy[u, b]
                if e >= h * epn and e < (h + 1) * epn:
                    _move(h, e - h * epn, u, epn, quota, alloc, rem)
    while True:
        u = recv[0]
        for i in range(1, n):
            if quota[recv[i]] > quota[u]:
                u = recv[i]
        if quota[u] <= 0:
            return
        j = 0
        for jj in range(1, epn):
            if rem[jj] > rem[j]:
                j = jj
        _move(h, j, u, epn, quota, alloc, rem)  # rem[j] > 0: a donor never gives more than it holds (proof)


@njit(cache=True)
def _move(h, j, u, epn, quota, alloc, rem):
    """Stage C: as many slots of donor h's expert j as receiver u still takes, up to what h holds of it."""
    t = min(rem[j], quota[u])
    alloc[h * epn + j, u] += t
    alloc[h * epn + j, h] -= t
    rem[j] -= t
    quota[u] -= t


@njit(cache=True)
def layout_rank(d, alloc, epn, pad, donor, prev_copy, sticky, copy, cu):
    """Stage D for rank d: its replica slots and padded segment ends.

    Segments: rank d's epn own experts in id order, then its slots. Fresh plans fill slots in ascending expert
    id; sticky plans keep a replica in the slot it held last step (its weights are already there).

    Args:
        alloc: [E, R] int32 stage C's table. donor: [R] int64. prev_copy: [R, slots] int64, read when sticky.
        copy: [R, slots] int64 experts_to_copy, row d preset to -1, filled (-1 = empty).
        cu: [R, epn + slots] int64 cu_seqlens, row d filled (segment ends, each padded to pad rows).
    Returns:
        0, or the replica count at rank d's last slot overflow (TOO_MANY_REPLICAS (d, count)).
    """
    slots = copy.shape[1]
    over = 0
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
            if alloc[e, d] <= 0 or _holds(copy, d, e, sticky):
                continue
            while b < slots and copy[d, b] >= 0:
                b += 1
            n += 1
            if b >= slots:
                over = n
                continue
            copy[d, b] = e
    off = 0
    for g in range(epn + slots):
        c = 0  # int(): under the simulator an int32 entry stays int32 and wraps when padded up near 2**31
        if g < epn:
            c = int(alloc[d * epn + g, d])
        elif copy[d, g - epn] >= 0:
            c = int(alloc[copy[d, g - epn], d])
        off += (c + pad - 1) // pad * pad
        cu[d, g] = off
    return over


@njit(cache=True)
def _holds(copy, d, e, sticky):
    """Stage D: whether a sticky plan already kept expert e in one of rank d's slots."""
    if sticky:
        for b in range(copy.shape[1]):
            if copy[d, b] == e:
                return True
    return False


# the error codes and INT32_MAX are compiled in, but numba's cache only watches this file
refresh_cache(globals(), (__file__, _errors.__file__, _inputs.__file__), "_stages.sources.sha256")
