"""What a trace folder holds, read whatever wrote it: ``moonep diagnose DIR`` picks the readers itself.

Formats (``FORMATS``), told apart by content, not by trust in a name:

- ``jsonl``: our ``rank<N>.jsonl`` (``collectives`` tracing, ``moonep train``, the in-loop detector);
- ``kineto``: PyTorch profiler Chrome traces, ``.json`` or ``.json.gz``, one or many per rank (``tools.kineto``);
- ``flight_recorder``: torch Flight Recorder dumps, JSON or pickle (read without running any object:
  ``tools.flight_recorder``).

The per-step tables come from one format: ours when present, else the profiler traces, else the Flight
Recorder's collectives. Flight Recorder dumps always add their own verdicts (a rank that never joined a
collective, mismatched sizes, late arrivals) next to the tables of another format. A second table format in the
same folder is not merged: it is named in a dropped-file line, which makes the trace incomplete (exit 2 without
``--partial``), as a damaged line does. Files that are none of these are ignored and named in the notes.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

from tools import clocks, flight_recorder, fr_dumps, kineto
from tools.detect import Finding
from tools.traces import Coverage, RankTrace, TraceFormatError, check_file_rank, coverage_for, load_dir_coverage

FORMATS = ("jsonl", "kineto", "flight_recorder")
_OURS = re.compile(r"^rank\d+\.jsonl$")
_IGNORED = re.compile(r"^telemetry_rank\d+\.jsonl$")


@dataclass(slots=True)
class Folder:
    """A folder's traces, read into the detectors' per-rank tables."""

    traces: dict[int, RankTrace]
    """Per-rank tables of the chosen format."""
    coverage: Coverage
    """What the folder holds against the ranks it should have."""
    format: str
    """The format the tables were read from (one of ``FORMATS``; ``none`` when the folder has none)."""
    findings: list[Finding] = field(default_factory=list)
    """Verdicts that come with a format rather than from the tables (Flight Recorder: hangs, mismatches)."""
    notes: list[str] = field(default_factory=list)
    """What was inferred or ignored, one line each (printed as warnings)."""
    extra: dict = field(default_factory=dict)
    """Format-specific report sections (``flight_recorder``: its summary)."""


def classify(trace_dir: str) -> dict[str, list[str]]:
    """``{format: [paths]}`` plus ``ignored``: every file of the folder (one level) by what it holds."""
    out: dict[str, list[str]] = defaultdict(list)
    for name in sorted(os.listdir(trace_dir)):
        path = os.path.join(trace_dir, name)
        if not os.path.isfile(path) or _IGNORED.match(name):
            continue
        if _OURS.match(name):
            out["jsonl"].append(path)
        elif kineto.looks_like_kineto(path):
            out["kineto"].append(path)
        elif fr_dumps.looks_like_fr(path):
            out["flight_recorder"].append(path)
        else:
            out["ignored"].append(path)
    return out


def load_folder(trace_dir: str | os.PathLike, *, world_size: int | None = None, rank_from: str | None = None) -> Folder:
    """Read ``trace_dir`` (module docstring). Raises ``TraceFormatError`` (one line) for input no diagnosis can
    stand on: a profiler trace without rank information, a damaged archive, a pickle holding objects, traces
    of two world sizes or of two runs."""
    trace_dir = os.fspath(trace_dir)
    files = classify(trace_dir) if os.path.isdir(trace_dir) else {}
    chosen = next((f for f in FORMATS if files.get(f)), "none")
    fr = _flight_recorder(files.get("flight_recorder", []), rank_from)
    if chosen == "jsonl":
        traces, coverage = load_dir_coverage(trace_dir, world_size)
        if coverage.run_id is None:
            clocks.refuse_disjoint_ranks(traces)
        folder = Folder(traces, coverage, "jsonl")
    elif chosen == "kineto":
        traces, world, notes = _kineto(files["kineto"], rank_from)
        folder = Folder(traces, coverage_for(traces, [], world_size, {world} if world else set(), -1), "kineto")
        folder.notes += notes
    elif chosen == "flight_recorder":
        folder = Folder(fr.traces, coverage_for(fr.traces, [], world_size, set(), _top(fr.traces)), chosen)
        folder.coverage.short_ranks = {}  # steps come from the calls: a rank short of calls is a verdict, not a gap
    else:
        folder = Folder({}, coverage_for({}, [], world_size, set(), -1), "none")
    if fr is not None:
        _check_same_world(folder, fr, files)
        folder.findings += fr.findings
        folder.notes += list(fr.summary.get("warnings", []))
        folder.extra["flight_recorder"] = fr.summary
    for other in FORMATS:
        if other not in (chosen, "flight_recorder") and files.get(other):
            line = (
                f"{trace_dir}: also holds {len(files[other])} {other} file(s) ({os.path.basename(files[other][0])}, "
                f"...) next to the {chosen} traces that were read: not merged; diagnose them from a folder of "
                f"their own"
            )
            folder.coverage.dropped.append(line)
            folder.notes.append(line)
    if files.get("ignored"):
        names = ", ".join(os.path.basename(p) for p in files["ignored"][:5])
        folder.notes.append(f"{trace_dir}: ignored {len(files['ignored'])} file(s) that are no trace ({names})")
    return folder


def _top(traces: dict[int, RankTrace]) -> int:
    return max((g for t in traces.values() for c in t.collectives for g in c.group), default=-1)


def _kineto(paths: list[str], rank_from: str | None) -> tuple[dict[int, RankTrace], int | None, list[str]]:
    """Profiler traces grouped by rank: checks that they come from one run of one world size."""
    docs: dict[int, list[tuple[str, dict]]] = defaultdict(list)
    worlds: dict[int, str] = {}
    for path in paths:
        doc = kineto.read_json(path)
        rank, world = kineto.rank_and_world(doc, path, rank_from)
        if world is not None:
            worlds.setdefault(world, path)
        docs[rank].append((path, doc))
    if len(worlds) > 1:
        (a, pa), (b, pb) = list(worlds.items())[:2]
        raise TraceFormatError(f"traces of two world sizes in one folder: {a} ranks in {pa}, {b} in {pb}")
    world = next(iter(worlds), None)
    for rank, items in docs.items():
        _check_one_run(rank, items)
    group = tuple(range(world if world else max(docs) + 1))
    traces, notes = {}, defaultdict(list)
    for rank, items in sorted(docs.items()):
        traces[rank], rank_notes = kineto.rank_trace(rank, items, group)
        for note in rank_notes:
            notes[note].append(rank)
    lines = [f"ranks {_ranges(ranks)}: {note}" for note, ranks in notes.items()]  # one line, not one per rank
    return {r: t for r, t in traces.items() if t.span or t.collectives}, world, lines


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _check_one_run(rank: int, items: list[tuple[str, dict]]) -> None:
    """One rank's several files must be cycles of one process: another process id is another run, the same
    trace id twice is a copied file."""
    pids: dict[object, str] = {}
    ids: dict[object, str] = {}
    for path, doc in items:
        host = (e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("cat") in ("cpu_op", "user_annotation"))
        pid = next((e.get("pid") for e in host), None)  # GPU events carry the device as their pid
        pids.setdefault(repr(pid), path)  # repr: a damaged file's pid or trace id may be a list or an object
        trace = repr(doc.get("trace_id")) if doc.get("trace_id") is not None else None
        if trace is not None and trace in ids:
            raise TraceFormatError(f"{path}: the same trace as {ids[trace]} (rank {rank} twice)")
        ids[trace or path] = path
    if len(pids) > 1:
        files = ", ".join(pids.values())
        raise TraceFormatError(f"two runs in one folder: rank {rank} has traces of {len(pids)} processes ({files})")


def _flight_recorder(paths: list[str], rank_from: str | None):
    if not paths:
        return None
    by_rank: dict[int, str] = {}
    for path in paths:
        rank = fr_dumps.rank_of(path, rank_from)
        if rank is None:
            raise TraceFormatError(
                f"{path}: a Flight Recorder dump without a rank in its name (dumps are named <prefix><rank>); "
                f"pass --rank-from REGEX"
            )
        check_file_rank(path, rank)
        if rank in by_rank:
            raise TraceFormatError(f"{path}: a second Flight Recorder dump of rank {rank} (first: {by_rank[rank]})")
        by_rank[rank] = path
    return flight_recorder.analyse_fr(fr_dumps.read_flight_recorder(by_rank))


def _check_same_world(folder: Folder, fr, files) -> None:
    want = folder.coverage.expected_ranks
    groups = [c.group for t in fr.traces.values() for c in t.collectives]
    fr_world = max((len(g) for g in groups), default=None)
    if folder.format != "flight_recorder" and want and fr_world and fr_world > want:
        raise TraceFormatError(
            f"traces of two world sizes in one folder: {want} ranks in the {folder.format} traces, "
            f"{fr_world} in the Flight Recorder dumps ({files['flight_recorder'][0]})"
        )
