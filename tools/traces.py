"""Reading a trace folder into per-rank, per-step tables (format: ``collectives/trace.py``).

Files are ``rank<N>.jsonl``, plain JSON lines, parsed with ``json.loads`` only (never pickle). A file that does
not parse is skipped with a warning naming it and the analysis goes on with the other ranks; a last line cut
mid-write (a run still going, or killed) is dropped with a warning and the rest of that file is kept.

Workload records (``Tracer.record_event``) are split into *compute* and *data loading*: a record whose ``kind``
field is ``"data"``, or whose op starts with ``data``, is data loading; every other non-collective record is
compute. A compute record may carry ``tokens`` (rows it processed: the MoE routing load), ``stage`` (pipeline
stage of the rank) and ``cpu_s`` (seconds the rank really computed: thread CPU time, or CUDA-event time on a
GPU). When ``cpu_s`` is present it replaces the wall duration in compute scores, so time a rank spent
descheduled on a shared host (noise of the host, not of the rank) does not look like a slow rank.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

COLLECTIVE_OPS = frozenset(
    {
        "all_to_all_single",
        "all_gather",
        "all_reduce",
        "reduce_scatter",
        "broadcast",
        "barrier",
        "send",
        "recv",
        "validate",
    }
)
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")
_REQUIRED = {"op": str, "rank": int, "t_enter": (int, float), "t_exit": (int, float)}


class TraceWarning(UserWarning):
    """A trace file or line was skipped; the message names the file."""


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


def _valid(rec) -> bool:
    if not isinstance(rec, dict):
        return False
    for key, kind in _REQUIRED.items():
        if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
            return False
    step = rec.get("step")
    return (step is None or (isinstance(step, int) and not isinstance(step, bool))) and rec["t_exit"] >= rec["t_enter"]


def parse_lines(path: str, text: str) -> list[dict] | None:
    """Records of one file's text; None (and a warning) when the file is corrupt."""
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]  # text after the last newline was cut mid-write
    records = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not _valid(rec):
            warnings.warn(
                f"{path}: line {number} is not a valid trace record; skipping the file", TraceWarning, stacklevel=2
            )
            return None
        records.append(rec)
    if tail.strip():
        warnings.warn(
            f"{path}: last line is truncated (run still writing, or killed); ignoring it", TraceWarning, stacklevel=2
        )
    return records


def _add(trace: RankTrace, rec: dict) -> None:
    step, t0, t1, op = rec.get("step"), float(rec["t_enter"]), float(rec["t_exit"]), rec["op"]
    if op in COLLECTIVE_OPS:
        group = rec.get("group")
        group = tuple(int(g) for g in group) if isinstance(group, list) and group else (trace.rank,)
        trace.collectives.append(Collective(op, group, step, t0, t1, int(rec.get("bytes") or 0)))
    if step is None:
        return
    lo, hi = trace.span.get(step, (t0, t1))
    trace.span[step] = (min(lo, t0), max(hi, t1))
    if op in COLLECTIVE_OPS:
        return
    if rec.get("kind") == "data" or op.startswith("data"):
        trace.data[step] += t1 - t0
        return
    cpu = rec.get("cpu_s")
    busy = float(cpu) if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and cpu >= 0 else t1 - t0
    trace.compute[step] += busy
    seconds, tokens = trace.compute_ops[step].get(op, (0.0, 0))
    trace.compute_ops[step][op] = (seconds + busy, tokens + int(rec.get("tokens") or 0))
    if isinstance(rec.get("stage"), int):
        trace.stage = rec["stage"]


def load_dir(trace_dir: str | os.PathLike) -> dict[int, RankTrace]:
    """``{rank: RankTrace}`` for every readable ``rank<N>.jsonl`` in ``trace_dir`` (bad files skipped, warned)."""
    out: dict[int, RankTrace] = {}
    names = sorted(os.listdir(trace_dir)) if os.path.isdir(trace_dir) else []
    for name in names:
        match = _RANK_FILE.match(name)
        if not match:
            continue
        path = os.path.join(os.fspath(trace_dir), name)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            warnings.warn(f"{path}: unreadable ({exc}); skipping the file", TraceWarning, stacklevel=2)
            continue
        records = parse_lines(path, text)
        if records is None:
            continue
        trace = RankTrace(int(match.group(1)))
        for rec in records:
            _add(trace, rec)
        out[trace.rank] = trace
    return out
