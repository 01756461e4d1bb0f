"""torch Flight Recorder dumps (read by ``tools.fr_dumps``) -> which rank hangs, which calls disagree, which rank
arrives late.

Verdicts, in torch's analyzer's terms (``torchfrtrace``): per group, ranks that never entered the last call
their peers entered (``hang``); the first sequence number whose op, sizes or dtypes differ across ranks
(``collective_mismatch``, the minority named); and, from the arrival times, a rank that comes last to the
calls of many steps in a row (``late_arrival``: the dump says who and since when, not why). Steps are inferred
from the repeating pattern of calls (``tools.steps``).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from tools.detect import Finding, Thresholds, confidence, episode, from_the_rise, outliers
from tools.fr_dumps import FRCall, FRRun
from tools.steps import once_per_period, steps_from_anchor
from tools.traces import Collective, RankTrace


@dataclass(slots=True)
class FRAnalysis:
    """Verdicts, a JSON-safe summary and the collectives as per-rank tables (source ``flight_recorder``)."""

    findings: list[Finding]
    summary: dict
    traces: dict[int, RankTrace]


def _steps(run: FRRun) -> tuple[dict[tuple[str, int], int], str]:
    """``(group, seq) -> step`` from the longest dump's repeating pattern of (op, sizes)."""
    ref = max(run.calls, key=lambda r: len(run.calls[r]), default=None)
    if ref is None:
        return {}, "no calls"
    calls = sorted(run.calls[ref], key=lambda c: c.arrival_s)
    labels = [(c.pg, c.op, json.dumps(c.sizes)) for c in calls]
    once = once_per_period(labels)
    if not once:
        return {}, "no repeating pattern of calls: steps unknown"
    # of the calls made once per iteration, the one seen in the most iterations closes them (warm-up ones too:
    # DDP all-reduces its first step's gradients in one bucket before it rebuilds them, so a bucket's call
    # would number every later step one too low); ties: the one followed by the longest pause (the next
    # iteration's data loading and forward pass come before its first collective)
    counts, pauses = Counter(labels), defaultdict(list)
    for a, b, label in zip(calls, calls[1:], labels):
        pauses[label].append(b.arrival_s - a.arrival_s)
    mark = max(once, key=lambda label: (counts[label], float(np.median(pauses[label])) if pauses[label] else 0.0))
    steps = steps_from_anchor(labels, mark)
    return {(c.pg, c.seq): s for c, s in zip(calls, steps)}, f"steps inferred: each ends with {mark[1]} {mark[2]}"


def _matched(run: FRRun) -> dict[tuple, dict[int, dict[int, FRCall]]]:
    """``{(pg, group): {seq: {rank: call}}}`` over the ranks that have a dump."""
    out: dict[tuple, dict[int, dict[int, FRCall]]] = defaultdict(lambda: defaultdict(dict))
    for rank, calls in run.calls.items():
        for c in calls:
            out[(c.pg, c.group)][c.seq][rank] = c
    return out


def _hangs(run, matched, step_of) -> list[Finding]:
    out = []
    for (pg, group), by_seq in matched.items():
        members = [r for r in group if r in run.calls]
        last = {r: max((s for s, calls in by_seq.items() if r in calls), default=0) for r in members}
        top = max(last.values(), default=0)
        behind = sorted(r for r in members if last[r] < top)
        if not behind:
            continue
        lowest = min(last[r] for r in behind)
        first_missing = min(s for s, calls in by_seq.items() if s > lowest and calls)  # seqs may skip (dropped)
        call = next(iter(by_seq[first_missing].values()))
        ahead = sorted(r for r in members if last[r] == top)
        where = f" (issued at {call.where})" if call.where else ""
        out.append(Finding(kind="hang", ranks=behind, onset_step=step_of.get((pg, first_missing)), confidence=0.9,
                           what_if_step_time_s=None,
                           detail=f"ranks {behind} never entered {call.op} #{first_missing} of group {pg} "
                           f"{list(group)}{where}, which ranks {ahead} entered (up to #{top}); those wait in it",
                           evidence={"group": list(group), "seq": first_missing, "op": call.op,
                                     "last_seq": {str(r): last[r] for r in members}}))  # fmt: skip
    return out


def _mismatches(run, matched, step_of) -> list[Finding]:
    out = []
    for (pg, group), by_seq in matched.items():
        members = [r for r in group if r in run.calls]
        for seq in sorted(by_seq):
            calls = by_seq[seq]
            if len(calls) < len(members) or len({c.signature() for c in calls.values()}) < 2:
                continue
            votes = Counter(c.signature() for c in calls.values())
            best = max(votes.values())
            right = calls[min(r for r, c in calls.items() if votes[c.signature()] == best)].signature()
            odd = sorted(r for r, c in calls.items() if c.signature() != right)
            sides = "; ".join(f"rank {r} in {c.signature()}" + (f" at {c.where}" if c.where else "")
                              for r, c in sorted(calls.items()))  # fmt: skip
            out.append(Finding(kind="collective_mismatch", ranks=odd, onset_step=step_of.get((pg, seq)),
                               confidence=0.9, what_if_step_time_s=None,
                               detail=f"call #{seq} of group {pg} {list(group)} differs across ranks: {sides}; "
                               f"the ranks are at different points of the program (each waits for the others)",
                               evidence={"group": list(group), "seq": seq,
                                         "calls": {str(r): c.signature() for r, c in calls.items()}}))  # fmt: skip
            break  # later calls only repeat the consequence of the first
    return out


def _traces(run, matched, step_of) -> dict[int, RankTrace]:
    """Matched calls as collectives: they leave together once the last member arrived (completion when known)."""
    traces = {r: RankTrace(r, source="flight_recorder") for r in run.calls}
    for (pg, group), by_seq in matched.items():
        for seq, calls in sorted(by_seq.items()):
            everyone = max(c.arrival_s for c in calls.values())
            for r, c in calls.items():
                step = step_of.get((pg, seq))
                t_exit = c.completed_s if c.completed_s and c.completed_s >= c.arrival_s else everyone
                traces[r].collectives.append(Collective(c.op, group, step, c.arrival_s, t_exit, seq=seq))
                if step is not None:
                    lo, hi = traces[r].span.get(step, (c.arrival_s, t_exit))
                    traces[r].span[step] = (min(lo, c.arrival_s), max(hi, t_exit))
    return traces


def _late(run, matched, step_of, th: Thresholds) -> list[Finding]:
    """Per step, the seconds each rank kept its peers waiting as the last to arrive; a rank far above its peers
    for many steps in a row (the per-rank recipe of ``tools.detect``) is ``late_arrival``."""
    steps = sorted(set(step_of.values()))
    ranks = sorted(run.calls)
    if len(steps) < th.min_evidence_steps or len(ranks) < 2:
        return []
    col = {s: j for j, s in enumerate(steps)}
    late = np.zeros((len(ranks), len(steps)))
    for (pg, _group), by_seq in matched.items():
        for seq, calls in by_seq.items():
            if (pg, seq) not in step_of or len(calls) < 2:
                continue
            arrivals = {r: c.arrival_s for r, c in calls.items()}
            last = max(arrivals, key=arrivals.get)
            others = [t for r, t in arrivals.items() if r != last]
            i, j = ranks.index(last), col[step_of[(pg, seq)]]  # the most it held the others back in the step
            late[i, j] = max(late[i, j], arrivals[last] - float(np.median(others)))
    ends: dict[int, float] = {}  # each step's last arrival on any rank (every step has one: step_of's keys)
    for c in (c for r in ranks for c in run.calls[r]):
        if (s := step_of.get((c.pg, c.seq))) is not None:
            ends[s] = max(ends.get(s, c.arrival_s), c.arrival_s)
    span = [ends[s] for s in steps]
    step_s = float(np.median(np.diff(span))) if len(span) > 1 else 0.0
    floor = max(1e-3, 0.05 * step_s)
    ratio, raw, rolled, excess = outliers(late, [list(range(len(ranks)))], 1.5, floor, th, abs_floor=floor)
    out = []
    for i, rank in enumerate(ranks):
        ep = episode(ratio[i], raw[i], rolled[i], th)
        if ep is None:
            continue
        evidence, before = from_the_rise(ep, ratio[i], raw[i], excess[i], th, steps)
        extra = float(np.median(excess[i, ep.onset :]))
        out.append(Finding(kind="late_arrival", ranks=[rank], onset_step=steps[ep.onset],
                           confidence=confidence(ep, 1.5), what_if_step_time_s=max(0.0, step_s - extra) or None,
                           detail=f"rank {rank} reaches collectives last, {extra * 1e3:.1f} ms after its peers per "
                           f"step from step {steps[ep.onset]}{before}: the cause lies before the call on that rank "
                           f"(compute, data loading or the host); the dump cannot tell which, a profiler trace or "
                           f"the in-loop detector can",
                           evidence={"excess_s": extra, "persistence": round(ep.persistence, 3)} | evidence)
                   )  # fmt: skip
    return out


SKEW_ROWS = 200
"""Calls listed in the summary's ``arrival_skew`` (the most recent)."""


def _skews(matched, step_of) -> list[dict]:
    """Per call on every member: who arrived last and by how much after the first (seconds)."""
    rows = []
    for (pg, group), by_seq in matched.items():
        for seq, calls in sorted(by_seq.items()):
            if len(calls) == len(group) > 1:
                arrivals = {r: c.arrival_s for r, c in calls.items()}
                last = max(arrivals, key=arrivals.get)
                rows.append({"group": pg, "seq": seq, "op": calls[last].op, "step": step_of.get((pg, seq)),
                             "last_rank": last, "skew_s": arrivals[last] - min(arrivals.values())})  # fmt: skip
    return rows


def analyse_fr(run: FRRun, thresholds: Thresholds | None = None) -> FRAnalysis:
    """Verdicts (module docstring), the summary for the report, and the collectives as tables."""
    th = thresholds or Thresholds()
    step_of, how = _steps(run)
    matched = _matched(run)
    findings = _hangs(run, matched, step_of) + _mismatches(run, matched, step_of) + _late(run, matched, step_of, th)
    summary = {
        "files": {str(r): p for r, p in sorted(run.paths.items())},
        "arrival_skew": _skews(matched, step_of)[-SKEW_ROWS:],
        "steps": how,
        "last_seq": {str(r): {c.pg: c.seq for c in calls} for r, calls in sorted(run.calls.items())},
        "warnings": list(run.warnings),
    }
    return FRAnalysis(findings, summary, _traces(run, matched, step_of))
