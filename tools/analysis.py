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

from tools.traces import RankTrace, load_dir


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


def _match(traces: dict[int, RankTrace]) -> dict[tuple, list[dict[int, object]]]:
    """``{group: [ {rank: Collective} per call ]}`` with calls matched by occurrence within the group."""
    per_rank: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for rank, trace in traces.items():
        for call in trace.collectives:
            per_rank[call.group][rank].append(call)
    matched = {}
    for group, by_rank in per_rank.items():
        present = [r for r in group if r in by_rank]
        if len(present) < 2:
            continue  # one member alone says nothing about waiting or transfer
        n = min(len(by_rank[r]) for r in present)  # a truncated file ends early: keep the common prefix
        matched[group] = [{r: by_rank[r][k] for r in present} for k in range(n)]
    return matched


def _cross_rank(traces, ranks) -> tuple[np.ndarray, list[CallSeries]]:
    index = {r: i for i, r in enumerate(ranks)}
    waits = np.zeros((len(ranks), len(ranks)))
    series: dict[tuple, CallSeries] = {}
    for group, calls in _match(traces).items():
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


def build_tables(traces: dict[int, RankTrace]) -> Tables:
    """Tables for the detectors from already-loaded traces."""
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
    waits, series = _cross_rank(traces, ranks)
    return Tables(
        ranks, steps, compute, norm, tokens, data, step_time, waits, series, {r: traces[r].stage for r in ranks}
    )


def load_tables(trace_dir: str | os.PathLike) -> Tables:
    """``build_tables(load_dir(trace_dir))``; unreadable files are skipped with a ``TraceWarning``."""
    return build_tables(load_dir(trace_dir))
