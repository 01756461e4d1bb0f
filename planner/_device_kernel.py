"""The planner as one numba-cuda kernel: one launch, one block, the CPU kernel's algorithm (plain and sticky plans).

Written in the subset of Python that numba's CUDA target compiles: no allocation (every table and scratch
array is passed in, sized by the caller from (R, E, slots) alone), integer loops, ``cuda.atomic``. The steps
it shares with the CPU kernel (``planner._kernel``) are ``planner._stages``'s, re-bound as device functions
(``planner._cuda``): one source, so each stage gives the CPU kernel's result, tie-breaks included (the tests
compare every field under numba's CUDA simulator and compile this file to PTX for sm_90). This module is the
device's driver: which threads run which step, and the barriers between them.

  A. totals (all threads: experts, then (rank, home) pairs, strided over the block);
  B. pairing (thread 0: the sticky pass and the global pass are sequential by nature, O(R) per step);
  C. split (one thread per donor: a donor's receivers and experts are its own);
  D. layout (one thread per rank);
  E. flows and route pieces (one thread per expert, after a count pass and thread 0's prefix sums).

Why stage E needs no sort: without a topology each split expert's sources are matched to its destinations in
rank order, so the (src, dst) pairs come out increasing; experts are visited in id order, so the flow table is
already in the CPU kernel's (expert, src, dst) order, and the route pieces (contiguous runs of the global slot
sequence, see ``Plan._pieces``) come out sorted by their start.
"""

from __future__ import annotations

from planner import _stages
from planner._cuda import cuda, device_functions
from planner._errors import NEGATIVE, NO_ERROR_POS, OK, OVERFLOW, TOO_LARGE, TOO_MANY_REPLICAS
from planner._inputs import INT32_MAX

_step = device_functions(_stages)  # the shared steps as device functions (the CPU kernel's compiled ones stay)
fill_caps, start_balance, pair, sticky_pass = (_step[k] for k in ("fill_caps", "start_balance", "pair", "sticky_pass"))
extremes, split_donor, layout_rank, report = (_step[k] for k in ("extremes", "split_donor", "layout_rank", "report"))


@cuda.jit(device=True)
def _totals(T, keep, send, cnt, errpos, epn, tid, nt):
    """Stage A: cnt [E], keep [R, E] (int32 copy of T), send [R, R]; errpos[0] = first bad flat index."""
    R, E = T.shape
    for e in range(tid, E, nt):
        c = 0
        for r in range(R):
            v = T[r, e]
            if v < 0 or v > INT32_MAX:
                cuda.atomic.min(errpos, 0, r * E + e)
            if v > INT32_MAX:
                v = 0  # the plan is refused anyway; keep the int32 store in range
            keep[r, e] = v
            c += v
        cnt[e] = c
    for p in range(tid, R * R, nt):
        r = p // R
        h = p - r * R
        s = 0
        for j in range(epn):
            v = T[r, h * epn + j]
            if v <= INT32_MAX:
                s += v
        send[r, h] = s


@cuda.jit(device=True)
def _pairing(bal, caps, prev_donor, sticky, donor, gift, err):
    """Stage B: the sticky pass, then the global pass (largest deficit first, filled by the largest donor;
    lowest index on ties): the CPU kernel's passes without a topology."""
    if sticky and not sticky_pass(bal, caps, prev_donor, donor, gift, err):
        return
    while True:
        h, u = extremes(bal, bal, -1)  # all ranks (no topology): the node table is not read
        if h < 0 or u < 0 or not pair(h, u, bal, caps, donor, gift, err):
            return


@cuda.jit(device=True)
def _seg_start(cu, d, g):
    """First row of segment g on rank d (segments: own experts, then replica slots)."""
    return 0 if g == 0 else cu[d, g - 1]


@cuda.jit(device=True)
def _emit_expert(e, T, alloc, cnt, epn, copy, cu, base, f0, p0, split, flows, pieces, send):
    """Stage E for expert e: its flows from row f0 and its route pieces from row p0; corrects send.

    A piece is (end, start, dest, first dest row) of a run of the global slot sequence (experts in id order,
    an expert's slots by source rank, then by appearance).
    """
    R = T.shape[0]
    home = e // epn
    if not split:
        pieces[p0, 0] = base + cnt[e]
        pieces[p0, 1] = base
        pieces[p0, 2] = home
        pieces[p0, 3] = _seg_start(cu, home, e - home * epn)
        return
    for r in range(R):
        cuda.atomic.add(send, (r, home), -T[r, e])
    _walk_flows(e, T, alloc, epn, copy, cu, base, f0, p0, flows, pieces, send, True)


@cuda.jit(device=True)
def _walk_flows(e, T, alloc, epn, copy, cu, base, f0, p0, flows, pieces, send, emit):
    """The north-west-corner matching of split expert e's sources with its destinations; returns its flows.

    emit=False only counts them (stage E's first pass: copy and cu are not ready, and not read). emit=True
    writes flow n at row f0 + n and its route piece at row p0 + n, and adds the flow to send.
    """
    R = T.shape[0]
    home = e // epn
    s = 0
    d = 0
    a = 0
    b = 0
    n = 0
    done = 0  # slots of e already assigned: the next piece's start
    row = 0  # rows of e already placed on destination d: d advances only once its rows are full
    while True:
        while s < R and a == 0:
            a = T[s, e]
            if a == 0:
                s += 1
        while d < R and b == 0:
            b = alloc[e, d]
            row = 0
            if b == 0:
                d += 1
        if s >= R or d >= R:
            return n
        t = min(a, b)
        if emit:
            flows[f0 + n, 0] = e
            flows[f0 + n, 1] = s
            flows[f0 + n, 2] = d
            flows[f0 + n, 3] = t
            cuda.atomic.add(send, (s, d), t)
            g = e - d * epn
            if d != home:
                for j in range(copy.shape[1]):
                    if copy[d, j] == e:
                        g = epn + j
            pieces[p0 + n, 0] = base + done + t
            pieces[p0 + n, 1] = base + done
            pieces[p0 + n, 2] = d
            pieces[p0 + n, 3] = _seg_start(cu, d, g) + row
        done += t
        row += t
        a -= t
        b -= t
        n += 1
        if a == 0:
            s += 1
        if b == 0:
            d += 1


@cuda.jit(device=True)
def _prefix(E, split, nflow, base_out, foff, poff, cnt, totals):
    """Thread 0: exclusive prefix sums over experts of slots (base), flows and pieces; totals = (F, P)."""
    b = 0
    f = 0
    p = 0
    for e in range(E):
        base_out[e] = b
        foff[e] = f
        poff[e] = p
        b += cnt[e]
        if split[e]:
            f += nflow[e]
            p += nflow[e]
        else:
            p += 1
    totals[0] = f
    totals[1] = p


@cuda.jit  # the arguments by role, one line each: inputs, the plan's tables, scratch
def plan_kernel(
    T, caps_in, has_caps, pad, prev_donor, prev_copy, sticky,
    keep, alloc, send, caps, donor, copy, cu, flows, pieces, totals, err,
    cnt, bal, gift, rem, recv, lay_err, split, nflow, base, foff, poff, errpos,
):  # fmt: skip
    """All stages in one block: the plan of T into the tables the caller allocated (``planner.device``).

    Args:
        T: [R, E] int64 counts. caps_in: [R] int64, read when has_caps. pad: token padding.
        prev_donor: [R] int64 and prev_copy: [R, slots] int64, last plan's (or the slack pass's) pairs and
            slots, read when sticky.
        keep, alloc, send, caps, donor, copy, cu: [R, E] int32, [E, R] int32, [R, R], [R], [R], [R, slots],
            [R, epn + slots] int64: the plan's tables (``TensorPlan``'s fields), filled. The caller zeroes
            alloc, send, totals, err and lay_err, and fills donor and copy with -1.
        flows: [flow_rows, 4] int64 and pieces: [E + flow_rows, 4] int64, filled up to totals [2] = (flows,
            pieces) rows; err: [3] int64 (code, a, b) of ``planner._errors``.
        cnt, split, nflow, base, foff, poff: [E] int64; bal, gift, lay_err: [R] int64; rem: [R, epn] int64;
            recv: [R, R] int64; errpos: [1] int64 = NO_ERROR_POS: scratch.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    R, E = T.shape
    epn = E // R
    _totals(T, keep, send, cnt, errpos, epn, tid, nt)
    cuda.syncthreads()
    if tid == 0:
        if errpos[0] != NO_ERROR_POS:
            r = errpos[0] // E
            report(err, NEGATIVE if T[r, errpos[0] - r * E] < 0 else TOO_LARGE, r, errpos[0] - r * E)
        fill_caps(cnt, caps_in, has_caps, caps, err)
        if err[0] == OK:
            start_balance(cnt, caps, epn, bal, alloc)
            _pairing(bal, caps, prev_donor, sticky, donor, gift, err)
    cuda.syncthreads()
    if err[0] != OK:
        return  # every thread sees thread 0's verdict after the barrier
    for h in range(tid, R, nt):
        split_donor(h, epn, donor, gift, prev_copy, sticky, alloc, rem[h], recv[h])
    cuda.syncthreads()
    for d in range(tid, R, nt):
        lay_err[d] = layout_rank(d, alloc, epn, pad, donor, prev_copy, sticky, copy, cu)
    for e in range(tid, E, nt):
        split[e] = 1 if alloc[e, e // epn] != cnt[e] else 0
        if split[e]:
            nflow[e] = _walk_flows(e, keep, alloc, epn, copy, cu, 0, 0, 0, flows, pieces, send, False)
    cuda.syncthreads()
    if tid == 0:
        for d in range(R - 1, -1, -1):  # the CPU kernel's sequential loop leaves the last overflow's report
            if lay_err[d] > 0:
                report(err, TOO_MANY_REPLICAS, d, lay_err[d])
        _prefix(E, split, nflow, base, foff, poff, cnt, totals)
        if totals[0] > flows.shape[0]:
            err[0] = OVERFLOW
            err[1] = totals[0]
            err[2] = flows.shape[0]
    cuda.syncthreads()
    if err[0] != OK:
        return  # a refused plan (too few slots: a replica has no segment to route to) gets no flows
    for e in range(tid, E, nt):
        _emit_expert(e, keep, alloc, cnt, epn, copy, cu, base[e], foff[e], poff[e], split[e], flows, pieces, send)
