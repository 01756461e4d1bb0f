"""Reading a trace folder into per-rank, per-step tables (format: ``collectives/trace.py``).

Files are ``rank<N>.jsonl``, plain JSON lines, parsed with ``json.loads`` only (never pickle). A line that is not
a valid record (not JSON, wrong types, NaN or infinite times) is dropped with a warning naming ``file:line``, and
the rest of the file is kept: one damaged line never hides a rank. A last line cut mid-write (a run still going,
or killed) is dropped the same way. The writer's header line (``kind: "header"``, ``world_size``) says how many
ranks the trace should have; ``load_dir_coverage`` reports what the folder really holds (``Coverage``).

Workload records (``Tracer.record_event``) are split into *compute* and *data loading*: a record whose ``kind``
field is ``"data"``, or whose op starts with ``data``, is data loading; every other non-collective record is
compute. A compute record may carry ``tokens`` (rows it processed: the MoE routing load), ``stage`` (pipeline
stage of the rank) and ``cpu_s`` (seconds the rank really computed: thread CPU time, or CUDA-event time on a
GPU). When ``cpu_s`` is present it replaces the wall duration in compute scores, so time a rank spent
descheduled on a shared host (noise of the host, not of the rank) does not look like a slow rank.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

from tools.intervals import clip, length
from tools.trace_lines import MAX_RANKS, number, parse_lines, rank_id, warn_dropped

COLLECTIVE_OPS = frozenset(
    ("all_to_all_single", "all_gather", "all_reduce", "reduce_scatter", "broadcast", "barrier", "send", "recv")
    + ("validate",)
)
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


class TraceFormatError(ValueError):
    """A trace folder or file that cannot back a diagnosis (no rank information, a damaged archive, a pickle
    holding objects, traces of two runs or world sizes). The message is one line naming the file and the
    problem; ``moonep diagnose`` prints it and exits 2."""


def check_file_rank(path: str, rank: int) -> None:
    """The rank a file's name or header gives is one a trace may name (``trace_lines.rank_id``), else
    ``TraceFormatError``: a damaged one would have the diagnosis walk every rank below it."""
    if not rank_id(rank):
        raise TraceFormatError(f"{path}: rank {rank} is past the {MAX_RANKS} ranks a trace may name")


@dataclass(slots=True)
class Collective:
    """One collective call as seen by one rank."""

    op: str
    """Collective name (``all_to_all_single``, ``validate``, ...)."""
    group: tuple[int, ...]
    """Global ranks of the group, in group order."""
    step: int | None
    """Training step stamped on the record (None when unset)."""
    t_enter: float
    """Wall-clock seconds when this rank entered."""
    t_exit: float
    """Wall-clock seconds when this rank left."""
    nbytes: int = 0
    """Payload bytes this rank contributed."""
    seq: int | None = None
    """Sequence number of the call within its group when the trace carries one (profiler ``Seq``, Flight
    Recorder ``collective_seq_id``): calls are then matched across ranks by it instead of by order."""


@dataclass(slots=True)
class RankTrace:
    """Everything one rank recorded, grouped the way the detectors read it."""

    rank: int
    """Global rank (from the file name)."""
    collectives: list[Collective] = field(default_factory=list)
    """Collective calls in issue order."""
    compute: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    """step -> seconds in compute records (``cpu_s`` when given; waits excluded: collectives are separate records)."""
    compute_ops: dict[int, dict[str, tuple[float, int]]] = field(default_factory=lambda: defaultdict(dict))
    """step -> op -> (seconds, tokens) for compute records (tokens 0 when the record has none)."""
    data: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    """step -> seconds in data-loading records."""
    span: dict[int, tuple[float, float]] = field(default_factory=dict)
    """step -> (first t_enter, last t_exit) over all this rank's records of the step."""
    stage: int | None = None
    """Pipeline stage, when compute records carry one."""
    windows: dict[int, tuple[float, float]] = field(default_factory=dict)
    """step -> (t_enter, t_exit) of the whole iteration, from a ``kind: "step"`` record (the in-loop detector
    writes one); without it a step runs from the previous step's last exit to its own last exit."""
    covered: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    """step -> intervals this rank was inside some record (compute, data or a collective)."""
    starts: dict[int, list[tuple[float, str]]] = field(default_factory=lambda: defaultdict(list))
    """step -> (t_enter, op) of each of its records: names the gap a record ends (``tools.gaps``)."""
    offcpu: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    """step -> seconds inside compute records that were not CPU (or device) time: wall minus ``cpu_s``."""
    phases: dict[int, dict[str, list[float]]] = field(default_factory=lambda: defaultdict(dict))
    """step -> op -> [first t_enter, last t_exit, busy seconds, off-CPU seconds, wall seconds of records without
    ``cpu_s``] of compute records (the cross-rank view finds phases that hide a collective: every rank leaves
    them together)."""
    idle: dict[int, float] = field(default_factory=dict)
    """step -> seconds the rank was neither computing, loading data nor in a recorded collective: gaps between
    records plus off-CPU time inside them (sleep, I/O, a contended core, a host stall). Set by ``finish``."""
    host_op_compute: bool = False
    """Compute is host ops' wall time (a profiler trace without GPU kernels)."""
    damaged: bool = False
    """Lines of this rank's file were dropped: counts of its records per step prove nothing."""
    source: str = "jsonl"
    """Format the trace was read from: ``jsonl``, ``kineto``, ``flight_recorder``."""
    clock_shift: float = 0.0
    """Seconds subtracted from this rank's times (``tools.clocks``: its clock's estimated offset); records read
    later (a followed trace) are shifted as they arrive."""


def _add(trace: RankTrace, rec: dict) -> None:
    if rec.get("kind") == "header":
        return
    step, op = rec.get("step"), rec["op"]
    t0, t1 = float(rec["t_enter"]) - trace.clock_shift, float(rec["t_exit"]) - trace.clock_shift
    if rec.get("kind") == "step":  # the iteration's own window (in-loop detector): not a phase
        if step is not None:
            trace.windows[step] = (t0, t1)
        return
    if op in COLLECTIVE_OPS:
        group = rec.get("group")
        group = tuple(int(g) for g in group) if isinstance(group, list) and group else (trace.rank,)
        trace.collectives.append(Collective(op, group, step, t0, t1, int(rec.get("bytes") or 0)))
    if step is None:
        return
    lo, hi = trace.span.get(step, (t0, t1))
    trace.span[step] = (min(lo, t0), max(hi, t1))
    trace.covered[step].append((t0, t1))
    trace.starts[step].append((t0, op))
    if op in COLLECTIVE_OPS:
        return
    if rec.get("kind") == "data" or op.startswith("data"):
        trace.data[step] += t1 - t0
        return
    cpu = rec.get("cpu_s")
    busy = float(cpu) if number(cpu) and cpu >= 0 else t1 - t0
    off = max(0.0, (t1 - t0) - busy)
    trace.offcpu[step] += off
    phase = trace.phases[step].setdefault(op, [t0, t1, 0.0, 0.0, 0.0])
    phase[0], phase[1] = min(phase[0], t0), max(phase[1], t1)
    phase[2] += busy
    phase[3] += off
    phase[4] += 0.0 if number(cpu) and cpu >= 0 else t1 - t0
    trace.compute[step] += busy
    seconds, tokens = trace.compute_ops[step].get(op, (0.0, 0))
    trace.compute_ops[step][op] = (seconds + busy, tokens + int(rec.get("tokens") or 0))
    if isinstance(rec.get("stage"), int):
        trace.stage = rec["stage"]


def step_windows(trace: RankTrace) -> dict[int, tuple[float, float]]:
    """step -> (start, end) of the iteration: its ``kind: "step"`` record, else from where the previous step's
    last record ended (a sleep between iterations belongs to the next step) to its own last record."""
    out, previous = {}, None
    for step in sorted(trace.span):
        lo, hi = trace.span[step]
        if step in trace.windows:
            lo, hi = trace.windows[step]
        elif previous is not None and previous < lo:
            lo = previous
        out[step] = (lo, hi)
        previous = trace.span[step][1]
    return out


def finish(trace: RankTrace) -> RankTrace:
    """Fill ``trace.idle`` once every record is in: per step, the step's window (``step_windows``) minus the
    time covered by any record, plus the off-CPU time inside compute records."""
    if trace.source == "flight_recorder":
        return trace  # only collectives: the time between them is work of unknown kind, not idle time
    for step, (lo, hi) in step_windows(trace).items():
        gap = (hi - lo) - length(clip(trace.covered.get(step, []), lo, hi))
        trace.idle[step] = max(0.0, gap) + trace.offcpu.get(step, 0.0)
    return trace


def traces_from_records(records: dict[int, list[dict]]) -> dict[int, RankTrace]:
    """``{rank: RankTrace}`` from already-parsed records of our JSONL schema (the in-loop detector's window);
    ranks with no record but a header are left out, as ``load_dir`` does."""
    out = {}
    for rank, recs in records.items():
        trace = RankTrace(rank)
        for rec in recs:
            _add(trace, rec)
        if trace.span or trace.collectives:
            out[rank] = finish(trace)
    return out


@dataclass(slots=True)
class Coverage:
    """What a trace folder really holds, against what it should (``moonep diagnose`` refuses to call a trace
    clean without it)."""

    expected_ranks: int | None
    """World size the trace should cover: ``--world-size``, else the writers' headers, else the largest group
    member seen + 1 (None: no evidence at all)."""
    source: str
    """Where ``expected_ranks`` came from: ``world_size`` (the caller), ``header``, ``groups`` or ``none``."""
    ranks: list[int]
    """Ranks with at least one valid record."""
    missing_ranks: list[int]
    """Expected ranks without a readable record."""
    steps: int
    """Steps seen (union over ranks)."""
    short_ranks: dict[int, int]
    """rank -> steps of the union it has no record of (ranks that stopped early or lost lines)."""
    dropped: list[str]
    """``file:line: why`` of every dropped line (and unreadable files)."""
    extra_ranks: list[int] = field(default_factory=list)
    """Ranks with records at or beyond ``expected_ranks`` (a stray file, or a wrong ``--world-size``)."""
    run_id: str | None = None
    """The run every rank file's header names (None: the writers recorded none)."""

    @property
    def empty(self) -> bool:
        return not self.ranks or not self.steps

    @property
    def complete(self) -> bool:
        return not (self.empty or self.missing_ranks or self.short_ranks or self.dropped or self.extra_ranks)

    def to_json(self) -> dict:
        return {
            "expected_ranks": self.expected_ranks,
            "expected_from": self.source,
            "ranks": self.ranks,
            "missing_ranks": self.missing_ranks,
            "extra_ranks": self.extra_ranks,
            "steps": self.steps,
            "ranks_missing_steps": {str(r): n for r, n in self.short_ranks.items()},
            "lines_dropped": len(self.dropped),
            "dropped": self.dropped[:100],
            "complete": self.complete,
            "run_id": self.run_id,
        }


def load_dir(trace_dir: str | os.PathLike) -> dict[int, RankTrace]:
    """``{rank: RankTrace}`` for every readable ``rank<N>.jsonl`` in ``trace_dir`` (bad lines dropped, warned)."""
    return load_dir_coverage(trace_dir)[0]


def load_dir_coverage(
    trace_dir: str | os.PathLike, world_size: int | None = None
) -> tuple[dict[int, RankTrace], Coverage]:
    """``load_dir`` plus its ``Coverage`` (``world_size``: the ranks the caller knows the job had)."""
    out: dict[int, RankTrace] = {}
    dropped: list[str] = []
    runs: dict[str, str | None] = {}
    headers: set[int] = set()
    top = -1  # largest global rank named in any group
    names = sorted(os.listdir(trace_dir)) if os.path.isdir(trace_dir) else []
    for name in names:
        match = _RANK_FILE.match(name)
        if not match:
            continue
        path = os.path.join(os.fspath(trace_dir), name)
        if int(match.group(1)) >= MAX_RANKS:
            warn_dropped(
                f"{path}: rank {match.group(1)} is past the {MAX_RANKS} ranks a trace may name; file skipped", dropped
            )
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            warn_dropped(f"{path}: unreadable ({type(exc).__name__}); file skipped", dropped)
            continue
        before = len(dropped)
        records = parse_lines(path, text, dropped)
        trace = RankTrace(int(match.group(1)), damaged=len(dropped) > before)
        runs[path] = _check_one_file(path, trace.rank, records)
        for rec in records:
            if rec.get("kind") == "header" and rec.get("world_size"):
                headers.add(rec["world_size"])
            top = max([top, *(g for g in rec.get("group") or () if isinstance(g, int))])
            _add(trace, rec)
        if any(rec.get("kind") != "header" for rec in records):
            out[trace.rank] = finish(trace)
    coverage = coverage_for(out, dropped, world_size, headers, top)
    coverage.run_id = _common_run_id(runs)
    return out, coverage


def _check_one_file(path: str, rank: int, records: list[dict]) -> str | None:
    """The run id of one rank file (None: its writer recorded none). Raises ``TraceFormatError`` for a file that
    holds another rank's records (a copy of another rank's file) or two runs (a reused folder)."""
    other = next((rec["rank"] for rec in records if rec.get("rank", rank) != rank), None)  # a header may omit it
    if other is not None:
        raise TraceFormatError(
            f"{path}: holds records of rank {other}, not of rank {rank} (a copy of another rank's file?): "
            f"remove it or put the real rank{rank}.jsonl back"
        )
    runs = sorted({rec["run_id"] for rec in records if rec.get("kind") == "header" and rec.get("run_id")})
    if len(runs) > 1:
        raise TraceFormatError(
            f"{path}: holds {len(runs)} runs (run ids {', '.join(runs)}): the trace folder was reused; give each "
            f"run its own trace folder"
        )
    return runs[0] if runs else None


def _common_run_id(runs: dict[str, str | None]) -> str | None:
    """Every rank file must come from one run: the same run id in every header that has one (returned; None when
    no header has one). Raises ``TraceFormatError`` naming the files."""
    by_run: dict[str, list[str]] = defaultdict(list)
    for path, run in runs.items():
        if run is not None:
            by_run[run].append(os.path.basename(path))
    if len(by_run) > 1:
        listed = "; ".join(f"run {run}: {', '.join(files)}" for run, files in sorted(by_run.items()))
        raise TraceFormatError(f"traces of {len(by_run)} runs in one folder ({listed}): diagnose one run at a time")
    return next(iter(by_run), None)


def coverage_for(out: dict[int, RankTrace], dropped, world_size, headers: set[int], top: int) -> Coverage:
    """What ``out`` covers against the expected ranks: ``world_size``, else the writers' headers, else the largest
    rank named in a group (``top``) + 1."""
    if world_size is not None:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be in [1, {MAX_RANKS}], got {world_size}")
        expected, source = world_size, "world_size"
    elif headers:
        expected, source = max(headers), "header"
    elif top >= 0 or out:
        expected, source = max(top, *out) + 1, "groups"
    else:
        expected, source = None, "none"
    if expected is not None and expected > MAX_RANKS:  # a reader let a damaged rank through: refuse, never walk it
        raise TraceFormatError(f"the traces name {expected} ranks ({source}), past the {MAX_RANKS} a trace may name")
    ranks = sorted(out)
    everyone = set(range(expected or 0)) | set(ranks)
    steps = set().union(*(t.span for t in out.values())) if out else set()
    short = {r: len(steps - set(out[r].span)) for r in ranks if steps - set(out[r].span)}
    missing = sorted(everyone - set(ranks))
    extra = [r for r in ranks if expected is not None and r >= expected]
    return Coverage(expected, source, ranks, missing, len(steps), short, dropped, extra)
