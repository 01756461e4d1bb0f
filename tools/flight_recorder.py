"""torch Flight Recorder dumps -> which rank hangs, which calls disagree, which rank arrives late.

A dump is one rank's ring buffer of collectives (``TORCH_FR_BUFFER_SIZE``), written on a watchdog timeout to
``TORCH_FR_DUMP_TEMP_FILE<rank>`` (pickle) or on demand (``torch._C._distributed_c10d._dump_fr_trace()``, pickle,
or ``_dump_fr_trace_json()``, JSON). Keys: ``version``, ``pg_config`` (group name -> ``ranks`` as a string),
``pg_status``, ``entries``; an entry has ``collective_seq_id``, ``profiling_name`` (``gloo:all_reduce``),
``process_group`` ([name, desc]), ``input_sizes`` / ``input_dtypes``, ``state``, ``time_created_ns`` (when the
rank issued it: its arrival), ``time_discovered_started_ns`` / ``_completed_ns`` (0 or None on gloo), ``frames``.
The dump does not hold its rank: it comes from the file name (trailing digits) or ``--rank-from``.

A pickle a user hands us is untrusted: ``SafeUnpickler`` admits builtin containers and scalars only (a dump holds
nothing else) and refuses every global, so nothing in the file runs.

Verdicts, in torch's analyzer's terms (``torchfrtrace``): per group, ranks that never entered the last call
their peers entered (``hang``); the first sequence number whose op, sizes or dtypes differ across ranks
(``collective_mismatch``, the minority named); and, from the arrival times, a rank that comes last to the
calls of many steps in a row (``late_arrival``: the dump says who and since when, not why). Steps are inferred
from the repeating pattern of calls (``tools.steps``).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from tools.detect import Finding, Thresholds, confidence, episode, from_the_rise, outliers
from tools.steps import once_per_period, steps_from_anchor
from tools.traces import Collective, RankTrace, TraceFormatError

_TRAILING_DIGITS = re.compile(r"(\d+)$")


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, strings and numbers and refuses every global."""

    path = ""

    def find_class(self, module, name):
        raise TraceFormatError(
            f"{self.path}: the pickle holds {module}.{name}, not plain containers: refusing to unpickle it (a "
            f"Flight Recorder dump holds only dicts, lists, tuples, strings and numbers)"
        )


def _head(path: str, n: int = 1 << 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def looks_like_fr(path: str) -> bool:
    """A pickle, or a JSON object with Flight Recorder keys (``entries`` and ``collective_seq_id``/``pg_config``)."""
    try:
        head = _head(path)
    except OSError:
        return False
    if head[:1] == b"\x80":
        return True
    text = head.lstrip()[:1]
    return (
        text == b"{"
        and b'"entries"' in head
        and b'"traceEvents"' not in head
        and any(key in head for key in (b'"collective_seq_id"', b'"pg_config"', b'"comm_lib_version"'))
    )


def load_dump(path: str) -> dict:
    """The dump as plain data; a damaged file, a pickle with objects, or no ``entries`` list: ``TraceFormatError``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise TraceFormatError(f"{path}: unreadable ({type(exc).__name__})") from None
    if raw[:1] == b"\x80":
        unpickler = SafeUnpickler(io.BytesIO(raw))
        unpickler.path = path
        try:
            doc = unpickler.load()
        except TraceFormatError:
            raise
        except Exception as exc:
            raise TraceFormatError(f"{path}: damaged or truncated pickle ({type(exc).__name__})") from None
    else:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise TraceFormatError(f"{path}: not JSON, or cut short ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise TraceFormatError(f"{path}: not a Flight Recorder dump (no entries list)")
    return doc


def rank_of(path: str, rank_from: str | None = None) -> int | None:
    """The dump's rank: ``rank_from``'s first group on the file name, else the name's trailing digits (before
    any extension: ``fr_trace_3``, ``fr3.json``, ``rank3.pkl``); None when neither gives one."""
    name = os.path.basename(path)
    if rank_from:
        match = re.search(rank_from, name)
        return int(match.group(1)) if match and match.groups() and (match.group(1) or "").isdigit() else None
    match = _TRAILING_DIGITS.search(name.split(".")[0])
    return int(match.group(1)) if match else None


@dataclass(slots=True)
class FRCall:
    """One collective as one rank's dump recorded it."""

    group: tuple[int, ...]
    """Global ranks of its process group."""
    pg: str
    """Process group name (description when it has one)."""
    seq: int
    """``collective_seq_id`` within the group."""
    op: str
    """``profiling_name`` without the backend prefix (``all_reduce``)."""
    sizes: list
    """Input sizes."""
    dtypes: list
    """Input dtypes."""
    arrival_s: float
    """When the rank issued (or, when known, started) it: epoch seconds."""
    completed_s: float | None
    """When it completed, when the dump knows (None on gloo)."""
    state: str
    """``scheduled``, ``started`` or ``completed``."""
    where: str = ""
    """The outermost user frame that issued it (``file:line (function)``), when the dump has frames."""

    def signature(self) -> str:
        return f"{self.op} {self.sizes} {','.join(map(str, self.dtypes))}"


@dataclass(slots=True)
class FRRun:
    """The dumps of one job, by rank."""

    calls: dict[int, list[FRCall]]
    """rank -> its collectives (point-to-point left out), by sequence number."""
    paths: dict[int, str]
    """rank -> dump file."""
    world: int
    """Ranks of the largest group."""
    warnings: list[str] = field(default_factory=list)
    """What the dumps cannot show (a wrapped ring buffer, a rank without a dump)."""


def _group(entry: dict, pg_config: dict, fallback: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    pg = entry.get("process_group") or ["", ""]
    name, desc = (str(pg[0]), str(pg[1])) if isinstance(pg, (list, tuple)) and len(pg) == 2 else (str(pg), "")
    cfg = pg_config.get(name) or next((c for c in pg_config.values() if c.get("desc") == desc), None)
    if cfg is None and len(pg_config) == 1:
        cfg = next(iter(pg_config.values()))
    ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            ranks = None
    group = tuple(int(r) for r in ranks) if isinstance(ranks, list) and ranks else fallback
    return desc or name, group


def _where(frames) -> str:
    for f in reversed(frames or []):  # innermost first: the last user frame is the outermost caller
        if isinstance(f, dict) and "site-packages" not in str(f.get("filename", "")):
            return f"{os.path.basename(str(f.get('filename')))}:{f.get('line')} ({f.get('name')})"
    return ""


def _call(entry: dict, pg_config: dict, fallback) -> FRCall | None:
    if entry.get("is_p2p") or not isinstance(entry.get("collective_seq_id"), int):
        return None
    pg, group = _group(entry, pg_config, fallback)
    started = entry.get("time_discovered_started_ns") or 0
    arrival = (started or entry.get("time_created_ns") or 0) / 1e9
    done = entry.get("time_discovered_completed_ns") or 0
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    return FRCall(group, pg, entry["collective_seq_id"], op, entry.get("input_sizes") or [],
                  entry.get("input_dtypes") or [], arrival, done / 1e9 if done else None,
                  str(entry.get("state", "")), _where(entry.get("frames")))  # fmt: skip


def read_flight_recorder(paths: dict[int, str]) -> FRRun:
    """Load every rank's dump (``TraceFormatError`` for a damaged one, or dumps of two world sizes)."""
    calls, worlds, warnings = {}, {}, []
    fallback = tuple(sorted(paths))
    for rank, path in sorted(paths.items()):
        doc = load_dump(path)
        pg_config = doc.get("pg_config") if isinstance(doc.get("pg_config"), dict) else {}
        mine = [c for e in doc["entries"] if isinstance(e, dict) and (c := _call(e, pg_config, fallback))]
        mine.sort(key=lambda c: (c.pg, c.seq))
        calls[rank] = mine
        if mine:
            worlds.setdefault(max(len(c.group) for c in mine), path)
            first = min(c.seq for c in mine)
            if first > 1:
                warnings.append(f"{path}: the ring buffer wrapped (oldest call #{first}): earlier calls are gone")
    if len(worlds) > 1:
        (a, pa), (b, pb) = list(worlds.items())[:2]
        raise TraceFormatError(f"Flight Recorder dumps of two world sizes: {a} ranks in {pa}, {b} in {pb}")
    world = next(iter(worlds), len(paths))
    missing = sorted(set(range(world)) - set(paths))
    if missing:
        warnings.append(f"no Flight Recorder dump for ranks {missing}: their calls are unknown")
    return FRRun(calls, dict(paths), world, warnings)


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
        first_missing = min(last[r] for r in behind) + 1
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
    span = [max(c.arrival_s for c in run.calls[ranks[0]] if step_of.get((c.pg, c.seq)) == s) for s in steps]
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
