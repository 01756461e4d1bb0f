"""Per-rank, per-step tables from a trace folder, and the cross-rank view of every collective.

Shapes: ``R`` ranks (rows, in ``ranks`` order), ``S`` steps (columns, in ``steps`` order); a missing value is
NaN. A collective call is matched across the ranks of its group by occurrence: the k-th call a rank made on
group G is the k-th call every member made on G (``collectives`` requires every member to call in the same
order). With all ranks on one host clock, the last rank to enter defines when the transfer can start, so each
call splits into *waiting* (``last enter - my enter``, blamed on the last arriver) and *transfer*
(``median exit - last enter``): the ByteDance what-if paper's ``transfer_duration``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from tools.calls import match_calls
from tools.clocks import align_clocks, offsets_note
from tools.gaps import ends_in_a_sync, gap_waits, gaps_note, leave_together
from tools.traces import RankTrace, finish, load_dir


@dataclass(slots=True)
class CallSeries:
    """Transfer and wait times of one (group, op) across steps."""

    group: tuple[int, ...]
    """Global ranks of the group."""
    op: str
    """Collective name."""
    steps: list[int] = field(default_factory=list)
    """Step of each matched call (calls without a step are left out)."""
    transfer_s: list[float] = field(default_factory=list)
    """Median exit minus last enter, seconds, per call."""
    max_wait_s: list[float] = field(default_factory=list)
    """Longest wait for the last arriver, seconds, per call."""
    nbytes: list[int] = field(default_factory=list)
    """Largest payload any member contributed, per call."""


@dataclass(slots=True)
class Tables:
    """What the detectors read. Arrays are ``[R, S]`` unless said otherwise."""

    ranks: list[int]
    """Global ranks with a readable trace, ascending."""
    steps: list[int]
    """Steps seen on any rank, ascending."""
    compute_s: np.ndarray
    """Seconds in compute records per rank and step (waits excluded)."""
    norm_compute_s: np.ndarray
    """Compute seconds rescaled as if every rank had the step's median routed tokens (equals compute_s when
    records carry no ``tokens``): slowness not explained by routing load."""
    tokens: np.ndarray
    """Routed rows processed (sum of ``tokens`` fields); 0 when records carry none."""
    data_s: np.ndarray
    """Seconds in data-loading records."""
    step_time_s: np.ndarray
    """``[S]`` wall time of each step: last exit minus first enter over all ranks."""
    wait_matrix_s: np.ndarray
    """``[R, R]`` seconds rank i (row) waited in collectives with rank j (column) as the last arriver."""
    series: list[CallSeries]
    """Per (group, op) transfer series."""
    stages: dict[int, int | None]
    """Pipeline stage of each rank (None when the trace does not say)."""
    idle_s: np.ndarray | None = None
    """Seconds the rank spent in no record (gaps, off-CPU time inside compute records), without the off-CPU time
    of phases that hold a hidden collective (``hidden_waits``: waiting there looks like being descheduled) and
    the waits in gaps that end in one (``tools.gaps``)."""
    hidden: dict[str, int] = field(default_factory=dict)
    """Phase -> steps in which every rank left the phase together (it holds a collective the trace does not
    record, like DDP's gradient all-reduce inside backward); their waits were attributed to the last arriver."""
    synced_gaps: dict[str, int] = field(default_factory=dict)
    """Gap name -> steps in which every rank left that gap between records together (``tools.gaps``: it ends
    in an untraced sync); their waits were taken out of ``idle_s`` and attributed to the last arriver."""
    notes: list[str] = field(default_factory=list)
    """What the tables cannot tell (printed as warnings by the report)."""
    calls: np.ndarray | None = None
    """``[R, S]`` collective calls each rank issued in each step (0 where it recorded none that step)."""
    damaged: list[int] = field(default_factory=list)
    """Ranks whose trace lost lines (their per-step record counts are not evidence)."""
    host_op_compute: bool = False
    """Compute is the wall time of host ops (profiler traces of CPU jobs), not CPU or device time."""
    clock_offsets: dict[int, float] = field(default_factory=dict)
    """rank -> seconds its clock read ahead of the lowest rank's (negative: behind), corrected before scoring."""
    blind: bool = False
    """True when waits may hide inside phases (no collective recorded, or phases that hold one): a rank slowed
    off-CPU before such a sync cannot be told from the peers that waited for it."""


def _cross_rank(matched: dict, ranks) -> tuple[np.ndarray, list[CallSeries]]:
    index = {r: i for i, r in enumerate(ranks)}
    waits = np.zeros((len(ranks), len(ranks)))
    series: dict[tuple, CallSeries] = {}
    for group, calls in matched.items():
        for call in calls:
            enters = {r: c.t_enter for r, c in call.items()}
            last = max(enters, key=enters.get)
            t_last = enters[last]
            for r, t in enters.items():
                waits[index[r], index[last]] += t_last - t
            first = next(iter(call.values()))
            step = next((c.step for c in call.values() if c.step is not None), None)
            if step is None:
                continue
            s = series.setdefault((group, first.op), CallSeries(group, first.op))
            s.steps.append(step)
            s.transfer_s.append(max(0.0, float(np.median([c.t_exit for c in call.values()])) - t_last))
            s.max_wait_s.append(t_last - min(enters.values()))
            s.nbytes.append(max(c.nbytes for c in call.values()))
    np.fill_diagonal(waits, 0.0)
    return waits, list(series.values())


def _normalised(traces, ranks, steps) -> tuple[np.ndarray, np.ndarray]:
    """Compute seconds as if each rank processed the median tokens of its peers, per op and step."""
    norm = np.full((len(ranks), len(steps)), np.nan)
    tokens = np.zeros((len(ranks), len(steps)))
    for j, step in enumerate(steps):
        ops = defaultdict(list)
        for r in ranks:
            for op, (_, tok) in traces[r].compute_ops.get(step, {}).items():
                if tok > 0:
                    ops[op].append(tok)
        median_tok = {op: float(np.median(v)) for op, v in ops.items()}
        for i, r in enumerate(ranks):
            by_op = traces[r].compute_ops.get(step)
            if not by_op:
                continue
            total = 0.0
            for op, (sec, tok) in by_op.items():
                # linear cost in rows is the model; a rank with no rows keeps its raw time (nothing to scale)
                total += sec * median_tok[op] / tok if tok > 0 and op in median_tok else sec
                tokens[i, j] += tok
            norm[i, j] = total
    return norm, tokens


def _phase_marks(traces, ranks, steps):
    """``(j, op, {rank: mark})`` for every phase every rank ran in step ``steps[j]`` with no recorded collective
    inside it (a recorded collective keeps its own waits)."""
    recorded = {r: defaultdict(list) for r in ranks}  # step -> enter times of recorded collectives
    for r in ranks:
        for c in traces[r].collectives:
            if c.step is not None:
                recorded[r][c.step].append(c.t_enter)
    for j, step in enumerate(steps):
        per_op: dict[str, dict[int, list[float]]] = defaultdict(dict)
        for r in ranks:
            for op, mark in traces[r].phases.get(step, {}).items():
                per_op[op][r] = mark
        for op, marks in per_op.items():
            if len(marks) >= max(2, len(ranks)) and not any(
                m[0] <= c <= m[1] for r, m in marks.items() for c in recorded[r].get(step, ())
            ):
                yield j, op, marks


def hidden_waits(traces, ranks, steps, t: Tables, align: float = 0.5) -> dict[str, int]:
    """Find phases that hold a collective the trace does not record; take the waits in them out of the tables.

    A phase (a compute record's op) that every rank leaves together although they reached its end at
    different times ends in a synchronisation (DDP's gradient all-reduce inside ``backward``): exits spread by
    at most ``align`` of the spread of arrivals, arrivals at least 1 ms apart, in at least 2 steps and 10% of
    them. A rank *arrives* when its work in the phase is done: enter + CPU seconds with ``cpu_s``, else at
    enter. In such a phase, waiting for a peer and being descheduled (a contended core, the GIL) both show as
    off-CPU time, so with ``cpu_s`` its off-CPU time is idle on no rank (a rank slowed off-CPU elsewhere, in a
    gap or another phase, is still seen); without ``cpu_s`` each rank's wait for the last arriver leaves its
    compute. Where a step is aligned, the waits join ``wait_matrix_s``. Returns phase -> aligned steps.
    """
    index = {r: i for i, r in enumerate(ranks)}
    aligned: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    marks_of: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for j, op, marks in _phase_marks(traces, ranks, steps):
        marks_of[op].append((j, marks))
        arrive = {r: m[0] + (m[2] if not m[4] else 0.0) for r, m in marks.items()}
        exits = [m[1] for m in marks.values()]
        if leave_together(list(arrive.values()), exits, align):
            aligned[op].append((j, arrive))
    found = {op: len(v) for op, v in aligned.items() if ends_in_a_sync(len(v), len(steps))}
    for op in found:
        for j, marks in marks_of[op]:
            for r, m in marks.items():
                if not m[4]:
                    t.idle_s[index[r], j] = max(0.0, t.idle_s[index[r], j] - m[3])
        for j, arrive in aligned[op]:
            last = max(arrive, key=arrive.get)
            for r, m in dict(marks_of[op])[j].items():
                wait = min(arrive[last] - arrive[r], m[4] if m[4] else m[3])
                if r == last or wait <= 0:
                    continue
                if m[4]:  # wall time only: the wait sits in compute
                    for table in (t.compute_s, t.norm_compute_s):
                        table[index[r], j] = max(0.0, table[index[r], j] - wait)
                t.wait_matrix_s[index[r], index[last]] += wait
    return found


def build_tables(traces: dict[int, RankTrace]) -> Tables:
    """Tables for the detectors from already-loaded traces."""
    for trace in traces.values():
        finish(trace)  # idempotent: --follow adds records between calls
    matched = match_calls(traces)  # shifting a clock moves these same Collective objects: match once
    align_clocks(traces, matched)  # before any score: an offset clock hides a late rank
    clock_offsets = {r: t.clock_shift for r, t in sorted(traces.items()) if t.clock_shift}  # all passes (--follow)
    ranks = sorted(traces)
    steps = sorted({s for t in traces.values() for s in t.span})
    shape = (len(ranks), len(steps))
    compute, data = np.full(shape, np.nan), np.zeros(shape)
    col = {s: j for j, s in enumerate(steps)}
    for i, r in enumerate(ranks):
        for s, sec in traces[r].compute.items():
            compute[i, col[s]] = sec
        for s, sec in traces[r].data.items():
            data[i, col[s]] = sec
    norm, tokens = _normalised(traces, ranks, steps)
    step_time = np.full(len(steps), np.nan)
    for j, s in enumerate(steps):
        spans = [traces[r].span[s] for r in ranks if s in traces[r].span]
        step_time[j] = max(b for _, b in spans) - min(a for a, _ in spans)
    waits, series = _cross_rank(matched, ranks)
    idle = np.full(shape, np.nan)
    for i, r in enumerate(ranks):
        for s, sec in traces[r].idle.items():
            idle[i, col[s]] = sec
    tables = Tables(
        ranks, steps, compute, norm, tokens, data, step_time, waits, series, {r: traces[r].stage for r in ranks}
    )
    tables.idle_s = idle
    tables.clock_offsets = clock_offsets
    if clock_offsets:
        tables.notes.append(offsets_note(clock_offsets, ranks[0]))
    tables.damaged = [r for r in ranks if traces[r].damaged]
    tables.host_op_compute = any(traces[r].host_op_compute for r in ranks)
    tables.calls = np.zeros(shape)
    for i, r in enumerate(ranks):
        for c in traces[r].collectives:
            if c.step is not None and c.op != "validate":
                tables.calls[i, col[c.step]] += 1
    tables.hidden = hidden_waits(traces, ranks, steps, tables)
    for op, n in tables.hidden.items():
        tables.notes.append(
            f"phase {op!r} ends together on every rank in {n} of {len(steps)} steps: it holds a collective the "
            f"trace does not record (DDP's gradient all-reduce inside backward): its off-CPU time counts as idle "
            f"on no rank (waiting for a peer and being descheduled look the same there), and its waits go to the "
            f"last rank to reach it"
        )
    tables.synced_gaps = gap_waits(traces, ranks, steps, tables)
    if tables.synced_gaps:
        tables.notes.append(gaps_note(tables.synced_gaps, len(steps)))
    tables.blind = len(ranks) > 1 and (bool(tables.hidden) or not any(t.collectives for t in traces.values()))
    if len(ranks) > 1 and not any(t.collectives for t in traces.values()) and not tables.hidden:
        tables.notes.append(
            "the trace records no collective: a rank waiting for a late peer inside a phase cannot be told from "
            "a slow one, so compute findings may blame the waiting rank"
        )
    return tables


def load_tables(trace_dir: str | os.PathLike) -> Tables:
    """``build_tables(load_dir(trace_dir))``; unreadable files are skipped with a ``TraceWarning``."""
    return build_tables(load_dir(trace_dir))
