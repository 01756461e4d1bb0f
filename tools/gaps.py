"""Gaps between records that end in a synchronisation the trace does not record: waits, not idle time.

A rank's idle time (``RankTrace.idle``) is the part of a step inside no record. An untraced collective (the
loss all-reduce a job makes for logging, a barrier) sits in such a gap, and the rank that reaches it first
waits there for the last one: that wait would read as host idle on a rank whose host did nothing wrong, and
a core that runs a little slower than its peers would make them all look idle. Such a gap shows itself as a
phase that hides a collective does (``tools.analysis.hidden_waits``): every rank leaves it together although
they reached it at different times.

A gap is named by what ends it, the same on every rank: the op of the record that starts at its end (its
n-th such gap in the step) or the end of the step. Per step and name, *arrive* is when the rank entered the
gap, *leave* when it left; a step is aligned when arrivals are at least ``min_spread`` apart and leaves spread
by at most ``align`` of that. A name aligned in at least 2 steps and 10% of them ends in a sync; in its
aligned steps each rank's wait for the last arriver (never more than its gap) leaves its idle time and joins
``wait_matrix_s``. A rank that stalls inside such a gap (a sleep before the sync) leaves it late with its
peers waiting for it: its own gap then has the latest arrival and keeps its idle time.
"""

from __future__ import annotations

from collections import defaultdict

from tools.intervals import clip
from tools.traces import RankTrace, step_windows

END = "end of step"
"""The name of a gap that runs to the end of its step."""


def leave_together(arrive, leave, align: float = 0.5, min_spread: float = 1e-3) -> bool:
    """One step of the sync rule (phases and gaps alike): the ranks reached it at least ``min_spread`` seconds
    apart, and left it within ``align`` of that spread."""
    spread = max(arrive) - min(arrive)
    return spread >= min_spread and max(leave) - min(leave) <= align * spread


def ends_in_a_sync(aligned_steps: int, steps: int) -> bool:
    """The sync rule over a trace: aligned in at least 2 steps and 10% of them."""
    return aligned_steps >= max(2, 0.1 * steps)


def named_gaps(trace: RankTrace, step: int, lo: float, hi: float) -> dict[tuple[str, int], tuple[float, float]]:
    """``{(name, n): (start, end)}``: the gaps of ``trace``'s step ``step`` inside its window ``[lo, hi]``, named
    by the op of the record that starts where the gap ends (``END`` at the window's end), ``n`` counting
    gaps of one name. A gap no named record ends (a profiler trace) is left out."""
    ops: dict[float, str] = {}
    for t0, op in sorted(trace.starts.get(step, ())):
        ops.setdefault(t0, op)
    out, seen, cursor = {}, defaultdict(int), lo
    for a, b in clip(trace.covered.get(step, []), lo, hi) + [(hi, hi)]:
        if a > cursor:
            name = END if a >= hi else ops.get(a)
            if name is not None:
                out[(name, seen[name])] = (cursor, a)
                seen[name] += 1
        cursor = max(cursor, b)
    return out


def gap_waits(traces: dict[int, RankTrace], ranks: list[int], steps: list[int], t, align: float = 0.5,
              min_spread: float = 1e-3) -> dict[str, int]:  # fmt: skip
    """Take the waits in gaps that end in an untraced sync out of ``t.idle_s`` (``[R, S]``) and put them in
    ``t.wait_matrix_s`` (``[R, R]``); returns ``{gap name: aligned steps}`` for the gaps found."""
    index = {r: i for i, r in enumerate(ranks)}
    windows = {r: step_windows(traces[r]) for r in ranks}
    aligned: dict[tuple[str, int], list[tuple[int, dict]]] = defaultdict(list)
    for j, step in enumerate(steps):
        gaps = {r: named_gaps(traces[r], step, *windows[r][step]) for r in ranks if step in windows[r]}
        if len(gaps) < max(2, len(ranks)):
            continue
        for key in set.intersection(*(set(g) for g in gaps.values())):
            marks = {r: g[key] for r, g in gaps.items()}
            if leave_together([a for a, _ in marks.values()], [b for _, b in marks.values()], align, min_spread):
                aligned[key].append((j, marks))
    found = {key: v for key, v in aligned.items() if ends_in_a_sync(len(v), len(steps))}
    for steps_marks in found.values():
        for j, marks in steps_marks:
            last = max(marks, key=lambda r: marks[r][0])
            for r, (a, b) in marks.items():
                wait = min(marks[last][0] - a, b - a)
                if r != last and wait > 0:
                    t.idle_s[index[r], j] = max(0.0, t.idle_s[index[r], j] - wait)
                    t.wait_matrix_s[index[r], index[last]] += wait
    out: dict[str, int] = defaultdict(int)
    for (name, _), v in found.items():
        out[name] = max(out[name], len(v))
    return dict(out)


def gaps_note(found: dict[str, int], steps: int) -> str:
    """One line for the report naming the gaps that end in an untraced sync."""
    parts = ", ".join(f"before {name!r} in {n}" if name != END else f"at the end of the step in {n}"
                      for name, n in sorted(found.items()))  # fmt: skip
    return (
        f"ranks leave the gap {parts} of {steps} steps together although they reach it at different times: it "
        f"ends in a sync the trace does not record (a logging all-reduce, a barrier); the waits there count as "
        f"idle on no rank and go to the last rank to reach it"
    )
