"""PyTorch profiler (Kineto) Chrome traces -> the per-rank tables the detectors read (``RankTrace``).

One file per rank and profiling cycle (``prof.export_chrome_trace(path)``, or ``tensorboard_trace_handler``'s
``<worker>.<timestamp>.pt.trace.json[.gz]``); several files of one rank are merged. Read with ``json`` / ``gzip``
only. What each part of a trace becomes:

- **rank**: ``distributedInfo.rank`` (and ``world_size``); else ``--rank-from REGEX`` on the file name; else a
  ``rank<N>`` in the name. A trace with none of these cannot be placed: an error, not a guess.
- **steps**: ``ProfilerStep#N`` spans when the profiler ran with a schedule; otherwise inferred from the
  iteration's repeating structure (``tools.steps``): the user annotations (``Optimizer.step#...``, the
  ``enumerate(DataLoader)`` spans, ``record_function`` labels, ``DistributedDataParallel.forward``) and then
  the collectives. Step ``k`` ends with the ``k``-th occurrence of the label that closes each iteration.
- **collectives**: ``gloo:<op>`` / ``nccl:<op>`` spans (gloo runs them on its own threads: the span is the
  work from start to completion, so a rank that waits for a late peer shows a long span) and, on GPUs, the
  ``ncclDevKernel_*`` kernels (the stream time: waiting and transfer). Calls are matched across ranks by
  process group and sequence number when the events carry them, else by order within the group.
- **data loading**: ``enumerate(DataLoader)`` spans and user labels that name data loading.
- **compute**: the time the host threads (GPU kernels, when the trace has them) were inside some op, data
  loading excluded; **idle** (``tools.traces.finish``): the step's time in no op, data or collective span.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib

from tools.intervals import merge, subtract
from tools.steps import anchor, once_per_period
from tools.trace_lines import MAX_RANKS, finite, rank_id, whole
from tools.traces import Collective, RankTrace, TraceFormatError, check_file_rank

COLLECTIVE_NAME = re.compile(r"^(?:gloo|nccl|mpi|ucc|xccl|c10d):([A-Za-z_]+)")
NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
DATA_LABEL = re.compile(r"dataloader|^data\b|^data[_ .:-]|data_?load|load_?batch|next_?batch|get_?batch", re.I)
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.I)
KINETO_NAME = re.compile(r"\.(?:pt\.)?trace\.json(?:\.gz)?$|\.json(?:\.gz)?$")
_KERNEL_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
               "Broadcast": "broadcast", "SendRecv": "send_recv", "AllToAll": "all_to_all"}  # fmt: skip


def looks_like_kineto(path: str) -> bool:
    """Cheap check: a ``.json``/``.json.gz`` whose first bytes open a Chrome trace (``traceEvents``)."""
    if not KINETO_NAME.search(os.path.basename(path)):
        return False
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            head = f.read(1 << 16)
    except (OSError, EOFError, zlib.error):
        return path.endswith(".gz") or ".trace." in path  # damaged: let the reader say what is wrong
    return b'"traceEvents"' in head or (b'"schemaVersion"' in head and b'"displayTimeUnit"' in head)


def read_json(path: str) -> dict:
    """The trace document; a damaged file is a ``TraceFormatError`` naming it."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            with open(path, "rb") as f:
                raw = f.read()
        doc = json.loads(raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise TraceFormatError(f"{path}: damaged or truncated gzip ({type(exc).__name__}: {exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: unreadable ({type(exc).__name__})") from None
    except ValueError as exc:
        raise TraceFormatError(f"{path}: not JSON, or cut short ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceFormatError(f"{path}: not a PyTorch profiler trace (no traceEvents list)")
    return doc


def rank_and_world(doc: dict, path: str, rank_from: str | None) -> tuple[int, int | None]:
    """``(rank, world size or None)`` of one trace file (module docstring: where each comes from)."""
    info = doc.get("distributedInfo")
    world = info.get("world_size") if isinstance(info, dict) else None
    world = world if whole(world) and 1 <= world <= MAX_RANKS else None
    rank = _rank(info, path, rank_from)
    if rank is not None:
        check_file_rank(path, rank)
        return rank, world
    raise TraceFormatError(
        f"{path}: no rank information (no distributedInfo: the job did not initialise torch.distributed before "
        f"profiling, and no rank<N> in the file name); pass --rank-from REGEX to read the rank from the name"
    )


def _rank(info, path: str, rank_from: str | None) -> int | None:
    """The file's rank from ``--rank-from`` on its name, else ``distributedInfo``, else ``rank<N>`` in its name."""
    if rank_from:
        match = re.search(rank_from, os.path.basename(path))
        if not match or not match.groups() or not (match.group(1) or "").isdigit():
            raise TraceFormatError(f"{path}: --rank-from {rank_from!r} does not capture a rank number in its name")
        return int(match.group(1))
    if isinstance(info, dict) and whole(info.get("rank")) and info["rank"] >= 0:
        return info["rank"]
    match = RANK_IN_NAME.search(os.path.basename(path))
    return int(match.group(1)) if match else None


def _seconds(doc: dict, ts: float) -> float:
    """Epoch seconds of a Chrome ``ts`` (microseconds after ``baseTimeNanoseconds``), so that ranks and Flight
    Recorder dumps of one host compare directly."""
    base = doc.get("baseTimeNanoseconds")
    return (base if finite(base) else 0) / 1e9 + ts / 1e6


def _group_of(args: dict) -> tuple[int, ...] | None:
    """The event's process group ranks, when its args name them (NCCL kernels, ``record_param_comms``)."""
    ranks = args.get("Process Group Ranks", args.get("pg_ranks"))
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            ranks = None
    good = isinstance(ranks, list) and ranks and all(finite(r) and r == int(r) and rank_id(int(r)) for r in ranks)
    return tuple(int(r) for r in ranks) if good else None


class _Events:
    """The spans of one rank's files, sorted by start, split by what they are."""

    def __init__(self, docs: list[tuple[str, dict]], world: tuple[int, ...]):
        self.collectives: list[tuple[float, float, str, tuple, int | None]] = []  # t0, t1, op, group, seq
        self.host: list[tuple[float, float, str, str]] = []  # t0, t1, name, cat: ops and annotations
        self.kernels: list[tuple[float, float]] = []  # compute kernels on GPU streams
        self.steps: list[tuple[int, float, float]] = []
        self.ungrouped = False  # a collective without process-group ranks (gloo's spans): taken as the world's
        has_kernel_collectives = any(
            NCCL_KERNEL.match(str(e.get("name", ""))) for _, d in docs for e in d["traceEvents"] if isinstance(e, dict)
        )
        for _, doc in docs:
            for e in doc["traceEvents"]:
                if isinstance(e, dict) and e.get("ph") == "X" and finite(e.get("ts")) and finite(e.get("dur")):
                    self._add(doc, e, world, has_kernel_collectives)
        for spans in (self.collectives, self.host, self.kernels):
            spans.sort(key=lambda x: x[0])
        self.steps.sort(key=lambda x: x[1])

    def _add(self, doc, e, world, kernel_collectives: bool) -> None:
        t0 = _seconds(doc, float(e["ts"]))
        t1 = t0 + max(0.0, float(e["dur"])) / 1e6
        name, cat, args = str(e.get("name", "")), str(e.get("cat", "")), e.get("args")
        args = args if isinstance(args, dict) else {}  # a damaged event keeps its span, not its details
        step = PROFILER_STEP.match(name)
        if step:
            self.steps.append((int(step.group(1)), t0, t1))
            return
        kernel = NCCL_KERNEL.match(name) if cat == "kernel" else None
        coll = COLLECTIVE_NAME.match(name) if cat in ("user_annotation", "gpu_user_annotation", "cpu_op") else None
        if kernel or (coll and not kernel_collectives):
            op = _KERNEL_OPS.get(kernel.group(1), kernel.group(1).lower()) if kernel else coll.group(1)
            op = str(args.get("Collective name") or op)
            group = _group_of(args)
            self.ungrouped |= group is None
            seq = args.get("Seq", args.get("seq"))
            self.collectives.append((t0, t1, op, group or world, seq if isinstance(seq, int) else None))
        elif coll or name.startswith(("c10d::", "record_param_comms")):
            return  # the host-side issue of a collective whose GPU kernel is the real span
        elif cat == "kernel":
            self.kernels.append((t0, t1))
        elif cat in ("cpu_op", "user_annotation", "python_function"):
            self.host.append((t0, t1, name, cat))


def _pg_count(doc: dict) -> int:
    info = doc.get("distributedInfo")
    count = info.get("pg_count") if isinstance(info, dict) else None
    return count if isinstance(count, int) else 1


def _windows(ev: _Events) -> tuple[list[tuple[int, float, float]], str]:
    """``[(step, start, end)]`` and how they were found. Without ``ProfilerStep`` spans: among the user
    annotations that occur once per iteration, a data-loading span *opens* each step (a rank that skips the
    rest of an iteration still fetched its batch), else the optimizer step (or the last such label) *closes*
    it; without annotations, the collectives' repeating pattern closes it."""
    if ev.steps:
        return ev.steps, "ProfilerStep"
    start = min([x[0] for x in ev.host] + [x[0] for x in ev.collectives], default=0.0)
    end = max([x[1] for x in ev.host] + [x[1] for x in ev.collectives], default=0.0)
    labels = [(name, t0, t1) for t0, t1, name, cat in ev.host if cat == "user_annotation"]
    once = once_per_period([name for name, _, _ in labels])
    opener = next((name for name in once if DATA_LABEL.search(name)), None)
    if opener is not None:
        # a step starts where the previous one's last span ended: a stall before the data fetch (a sleep at
        # the top of the loop) belongs to the step it delays, as in our JSON lines
        ends = sorted(x[1] for x in ev.host + ev.collectives)
        starts = []
        for name, t0, _ in labels:
            if name == opener:
                k = _bisect(ends, t0)  # the last span that ended before this fetch began
                starts.append(max(start, ends[k]) if k >= 0 else t0)
        bounds = list(zip(starts, starts[1:] + [end]))
        return [(k, lo, hi) for k, (lo, hi) in enumerate(bounds)], f"user annotations (each step opens with {opener!r})"
    how = "user annotations"
    mark = next((name for name in reversed(once) if name.startswith("Optimizer.step")), once[-1] if once else None)
    if mark is None:
        labels = [(op, t0, t1) for t0, t1, op, _, _ in ev.collectives]
        mark, how = anchor([op for op, _, _ in labels]), "collectives"
    if mark is None:
        return [], "none"
    ends = [t1 for name, _, t1 in labels if name == mark]
    return [
        (k, lo, hi) for k, (lo, hi) in enumerate(zip([start] + ends, ends))
    ], f"{how} (each step ends with {mark!r})"


def rank_trace(rank: int, docs: list[tuple[str, dict]], world: tuple[int, ...]) -> tuple[RankTrace, list[str]]:
    """One rank's ``RankTrace`` (source ``kineto``) from its trace documents, and notes on what was inferred."""
    ev = _Events(docs, world)
    windows, how = _windows(ev)
    trace = RankTrace(rank, source="kineto", host_op_compute=not ev.kernels)
    notes = [] if how == "ProfilerStep" else [f"no ProfilerStep spans; steps inferred from {how}"]
    groups = max((_pg_count(doc) for _, doc in docs), default=1)
    if ev.ungrouped and groups > 1:
        notes.append(
            f"{groups} process groups, but the collective spans do not say which group ran them (gloo): they "
            f"are matched by order over the world, so waits across groups may be paired wrongly"
        )
    if not windows:
        return trace, ["no ProfilerStep spans and no repeating structure: no steps"]
    starts = [lo for _, lo, _ in windows]

    def step_at(t: float) -> int | None:
        k = _bisect(starts, t)
        return windows[k][0] if k >= 0 and t <= windows[k][2] else None

    for t0, t1, op, group, seq in ev.collectives:
        trace.collectives.append(Collective(op, group, step_at(t0), t0, t1, seq=seq))
    data = [(t0, t1) for t0, t1, name, cat in ev.host if cat == "user_annotation" and DATA_LABEL.search(name)]
    busy = ev.kernels if ev.kernels else [(t0, t1) for t0, t1, _, _ in ev.host]
    coll = [(t0, t1) for t0, t1, *_ in ev.collectives]
    for step, lo, hi in windows:
        step_data = merge((max(a, lo), min(b, hi)) for a, b in data if a < hi and b > lo)
        step_busy = [(max(a, lo), min(b, hi)) for a, b in busy if a < hi and b > lo]
        compute = subtract(step_busy, step_data + coll if ev.kernels else step_data)
        trace.compute[step] = sum(b - a for a, b in compute)
        trace.compute_ops[step]["ops"] = (trace.compute[step], 0)
        trace.data[step] = sum(b - a for a, b in step_data)
        trace.span[step] = (lo, hi)
        trace.windows[step] = (lo, hi)
        host = [(max(a, lo), min(b, hi)) for a, b, _, _ in ev.host if a < hi and b > lo]
        trace.covered[step] = merge(host + step_busy + step_data + [(a, b) for a, b in coll if a < hi and b > lo])
    return trace, notes


def _bisect(starts: list[float], t: float) -> int:
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1
