"""Per-rank clock offsets, estimated from collective exits and corrected before any score is taken.

Each rank stamps its records with its own host's wall clock. Across hosts those clocks differ, and an offset
moves every record of a rank: a rank whose clock runs 0.5 s behind seems to arrive first at every collective,
so it is never the last arriver, its step windows stretch every step's wall time, and a real straggler can hide
behind it. What a trace does know: the members of a synchronous collective (all-reduce, all-gather,
all-to-all, barrier, reduce-scatter) leave it together, within the transfer's tail. So, per rank, the median
over matched calls of (its exit minus the call's median exit) is its clock's offset, up to that tail.

Offsets are solved over every group at once (sub-groups linked through shared ranks, a few rounds of
median updates), expressed against the lowest rank, and applied only when they are larger than both a floor
(``MIN_OFFSET_S``: below it host clocks on one machine and the transfer tail are indistinguishable) and a few
times their own spread over calls (a trace whose exits do not line up, like host-side NCCL launches, is left
alone). ``align_clocks`` shifts the traces in place (``RankTrace.clock_shift``, which later records of a
followed trace also get) and returns the offsets it corrected, for the report.
"""

from __future__ import annotations

import numpy as np

from tools.calls import match_calls
from tools.traces import RankTrace, TraceFormatError

SYNC_OPS = frozenset({"all_reduce", "all_gather", "all_to_all_single", "barrier", "reduce_scatter", "validate"})
"""Collectives whose members leave together (send/recv and broadcast roots may leave early)."""
MIN_OFFSET_S = 0.005
"""Offsets at or below this are left alone: noise of the exits, not a clock."""
SPREAD_FACTOR = 4.0
"""An offset is corrected only when it is this many times larger than its spread over calls (median |residual|)."""
ROUNDS = 4
MAX_OFFSET_S = 60.0
"""Clock offsets beyond this are not believed (NTP keeps a job's hosts far closer): such ranks are two runs."""


def _exits(matched: dict) -> tuple[list[int], np.ndarray]:
    """(ranks, exits ``[calls, ranks]``, NaN where a rank is no member) of every matched synchronous call with at
    least two members (``matched``: ``tools.calls.match_calls``)."""
    rows = []
    for calls in matched.values():
        for call in calls:
            if next(iter(call.values())).op in SYNC_OPS and len(call) > 1:
                rows.append({r: c.t_exit for r, c in call.items()})
    ranks = sorted({r for row in rows for r in row})
    exits = np.full((len(rows), len(ranks)), np.nan)
    col = {r: j for j, r in enumerate(ranks)}
    for i, row in enumerate(rows):
        for r, t in row.items():
            exits[i, col[r]] = t
    return ranks, exits


def estimate_offsets(
    traces: dict[int, RankTrace], matched: dict | None = None
) -> tuple[dict[int, float], dict[int, float]]:
    """(offset, spread) per rank with synchronous calls, seconds, against the lowest such rank: ``offset[r] > 0``
    means rank r's clock reads ahead. Spread: median |residual - its median| over r's calls."""
    ranks, exits = _exits(match_calls(traces) if matched is None else matched)
    if len(ranks) < 2:
        return {}, {}
    exits = exits - np.nanmin(exits, axis=1, keepdims=True)  # per call: keeps the numbers small and exact
    offset = np.zeros(len(ranks))
    with np.errstate(all="ignore"):
        for _ in range(ROUNDS):
            residual = exits - offset - np.nanmedian(exits - offset, axis=1, keepdims=True)
            offset += np.nan_to_num(np.nanmedian(residual, axis=0))
        spread = np.nanmedian(np.abs(residual - np.nanmedian(residual, axis=0)), axis=0)
    offset -= offset[0]
    return dict(zip(ranks, offset.tolist())), dict(zip(ranks, np.nan_to_num(spread).tolist()))


def shift_trace(trace: RankTrace, dt: float) -> None:
    """Subtract ``dt`` seconds from every time of ``trace`` (and from its later records: ``clock_shift``)."""
    trace.clock_shift += dt
    for c in trace.collectives:
        c.t_enter -= dt
        c.t_exit -= dt
    trace.span = {s: (a - dt, b - dt) for s, (a, b) in trace.span.items()}
    trace.windows = {s: (a - dt, b - dt) for s, (a, b) in trace.windows.items()}
    for intervals in trace.covered.values():
        intervals[:] = [(a - dt, b - dt) for a, b in intervals]
    for starts in trace.starts.values():
        starts[:] = [(a - dt, op) for a, op in starts]
    for ops in trace.phases.values():
        for phase in ops.values():
            phase[0] -= dt
            phase[1] -= dt


def align_clocks(traces: dict[int, RankTrace], matched: dict | None = None) -> dict[int, float]:
    """Correct every rank whose clock offset is clear (module docstring); returns ``{rank: offset corrected}``."""
    offset, spread = estimate_offsets(traces, matched)
    corrected = {}
    for r, off in offset.items():
        if abs(off) > MIN_OFFSET_S and abs(off) > SPREAD_FACTOR * spread[r]:
            shift_trace(traces[r], off)
            corrected[r] = off
    return corrected


def refuse_disjoint_ranks(traces: dict[int, RankTrace]) -> None:
    """For traces without run ids: ranks whose time ranges never overlap are one run with clocks apart only if one
    offset per rank lines up their collective exits and is believable (``MAX_OFFSET_S``); otherwise they are two
    runs and ``TraceFormatError`` names the files. (Two runs of one job a few seconds apart can line up as well
    as one run's clocks do: only the writers' run ids tell those apart.)"""
    ranges = {
        r: (min(a for a, _ in t.span.values()), max(b for _, b in t.span.values())) for r, t in traces.items() if t.span
    }
    if len(ranges) < 2:
        return
    late = max(ranges, key=lambda r: ranges[r][0])
    early = min(ranges, key=lambda r: ranges[r][1])
    gap = ranges[late][0] - ranges[early][1]
    if gap <= 0:
        return
    offset, spread = estimate_offsets(traces)
    if offset and all(abs(o) <= MAX_OFFSET_S and spread[r] <= MIN_OFFSET_S for r, o in offset.items()):
        return  # one run, clocks apart: align_clocks corrects them
    raise TraceFormatError(
        f"rank{early}.jsonl ends before rank{late}.jsonl starts ({gap:.1f} s later) and no believable clock offset "
        f"lines up their collectives: traces of two runs in one folder (these files carry no run id); give each "
        f"run its own trace folder"
    )


def offsets_note(corrected: dict[int, float], ref: int) -> str:
    """One line for the report naming each corrected offset."""
    parts = ", ".join(f"rank {r} {abs(o) * 1e3:.1f} ms {'ahead' if o > 0 else 'behind'}" for r, o in corrected.items())
    return (
        f"clock offsets corrected before scoring, against rank {ref}'s clock: {parts} (estimated from collective "
        f"exits: the members of a synchronous collective leave it together)"
    )


__all__ = ["MIN_OFFSET_S", "align_clocks", "refuse_disjoint_ranks", "estimate_offsets", "offsets_note", "shift_trace"]
