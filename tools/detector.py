"""An in-loop straggler detector for any ``torch.distributed`` job (three lines in the training loop).

    det = StragglerDetector(every=50, window=100, trace_dir="trace/", on_finding=print)  # device="cuda" on GPUs
    for batch in loader:
        with det.step():
            with det.section("data", kind="data"):
                x, y = next(batches)
            with det.section("forward"):
                loss = loss_fn(model(x), y)
            ...
    findings = det.close()   # rank 0: the findings over the last window; other ranks: []

Each section is one record of our JSON-lines schema (``collectives/trace.py``): wall-clock enter and exit
(``time.time()``, one clock for the ranks of a host) and ``cpu_s``, the seconds the rank really worked: thread
CPU time on CPU, CUDA-event time on a GPU (events are read only when the window is gathered, so timing adds no
host sync per step). ``step()`` adds the iteration's own window (``kind: "step"``), which lets the detectors see
time spent outside every section (a sleep, a stall). Every ``every`` steps the ranks send their new records
to rank 0 in ONE exchange through the job's rendezvous store (never per step; no collective, nothing on the GPU
stream, only rank 0 waits); rank 0 keeps the last ``window`` steps and runs the same detectors as ``moonep
diagnose`` (``tools.traces`` -> ``tools.analysis`` -> ``tools.findings``), reporting each new (kind, ranks) once
through ``on_finding`` and the ``tools.detector`` logger. With ``trace_dir`` every rank
also appends its records to ``<trace_dir>/rank<N>.jsonl``, so ``moonep diagnose trace_dir`` finds the same.

Depends on torch and torch.distributed only (not on ``collectives``); works without an initialised process
group (one rank, no gather).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tools.analysis import build_tables
from tools.detect import Finding, Thresholds
from tools.findings import diagnose
from tools.traces import traces_from_records

log = logging.getLogger("tools.detector")


@dataclass(kw_only=True)
class DetectorConfig:
    """How often the ranks exchange timings and what rank 0 diagnoses."""

    every: int = 50
    """Steps between gathers (one collective each time; never on every step unless set to 1)."""
    window: int = 100
    """Steps rank 0 keeps and diagnoses (the detectors need about 20 steps after an onset)."""
    trace_dir: str | None = None
    """Folder for ``rank<N>.jsonl`` (our schema), read later by ``moonep diagnose``; None: nothing written."""
    thresholds: Thresholds = field(default_factory=Thresholds)
    """Detector knobs (``tools.detect.Thresholds``)."""
    run_id: str | None = None
    """Written in each file's header; None: torchrun's ``TORCHELASTIC_RUN_ID`` (the same on every rank), else
    none."""

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an integer >= 1, got {self.every!r}")
        if not isinstance(self.window, int) or self.window < self.every:
            raise ValueError(f"window must be an integer >= every ({self.every}), got {self.window!r}")
        if not isinstance(self.thresholds, Thresholds):
            raise ValueError(f"thresholds must be a tools.detect.Thresholds, got {type(self.thresholds).__name__}")


class StragglerDetector:
    """Times sections of each step on every rank; rank 0 diagnoses the gathered window (module docstring).

    Args:
        on_finding: called on rank 0 with each new ``Finding`` (once per kind and ranks).
        group: the ``torch.distributed`` group to gather over (default: the world).
        device: ``"cuda"`` (or a CUDA device) to time sections with CUDA events on the current stream; None:
            thread CPU time.
        **config: ``DetectorConfig`` fields (``every``, ``window``, ``trace_dir``, ``thresholds``, ``run_id``).
    """

    _made = 0  # detectors made in this process: their store keys' tag

    def __init__(self, *, on_finding=None, group=None, device=None, **config):
        self.config = DetectorConfig(**config)
        if self.config.run_id is None:
            self.config.run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        self.on_finding = on_finding
        self.group = group

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self._dist.get_rank() if self._dist else 0
        self.world_size = self._dist.get_world_size(group) if self._dist else 1
        self.device = device
        self.step_index = 0
        self.gathers = 0
        """Gathers done so far (one store exchange each)."""
        self.cost_s = 0.0
        """Seconds spent in the detector's own code on this rank per step (timing, bookkeeping)."""
        self.gather_s = 0.0
        """Seconds spent in gathers (the exchange, the JSON lines, rank 0's diagnosis)."""
        self.findings: list[Finding] = []
        """Rank 0: the findings of the last diagnosis; other ranks: []."""
        self._pending: list[dict] = []
        self._events: list[tuple[dict, object, object]] = []  # (record, start event, end event) on CUDA
        self._window: dict[int, deque] = {}
        self._alerted: set[tuple] = set()
        self._file = None
        StragglerDetector._made += 1  # the same count on every rank: detectors are made in program order
        self._tag = StragglerDetector._made

    def _cuda(self) -> bool:
        return self.device is not None and str(self.device).startswith("cuda")

    @contextmanager
    def step(self):
        """The whole iteration: its window, then (every ``every`` steps) the gather and diagnosis."""
        t0 = time.time()
        try:
            yield self
        finally:
            c = time.perf_counter()
            rec = {"op": "step", "kind": "step", "rank": self.rank, "step": self.step_index, "t_enter": t0}
            rec["t_exit"] = time.time()
            self._pending.append(rec)
            self.step_index += 1
            self.cost_s += time.perf_counter() - c
            if self.step_index % self.config.every == 0:
                self.gather()

    @contextmanager
    def section(self, name: str, *, kind: str = "compute"):
        """One phase of the step: ``kind`` ``"data"`` for data loading, else compute."""
        if kind not in ("compute", "data"):
            raise ValueError(f"kind must be 'compute' or 'data', got {kind!r}")
        c = time.perf_counter()
        start = end = None
        if self._cuda():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0, cpu0 = time.time(), time.thread_time()
        self.cost_s += time.perf_counter() - c
        try:
            yield
        finally:
            c = time.perf_counter()
            t1, cpu1 = time.time(), time.thread_time()
            rec = {"op": name, "kind": kind, "rank": self.rank, "step": self.step_index, "t_enter": t0, "t_exit": t1}
            rec.update(group=[self.rank], bytes=0, cpu_s=cpu1 - cpu0)
            if end is not None:
                end.record()
                self._events.append((rec, start, end))
            self._pending.append(rec)
            self.cost_s += time.perf_counter() - c

    def _resolve_events(self) -> None:
        """CUDA-event times into ``cpu_s`` (one synchronize per gather, not per step)."""
        if self._events:
            self._events[-1][2].synchronize()
            for rec, start, end in self._events:
                rec["cpu_s"] = start.elapsed_time(end) / 1e3
            self._events.clear()

    def gather(self) -> list[Finding]:
        """Send the new records to rank 0, which diagnoses the window; returns rank 0's new findings."""
        start = time.perf_counter()
        try:
            return self._gather()
        finally:
            self.gather_s += time.perf_counter() - start

    def _gather(self) -> list[Finding]:
        self._resolve_events()
        batch, self._pending = self._pending, []
        if self._dist is not None and self.world_size > 1:
            dst = self._dist.get_global_rank(self.group, 0) if self.group is not None else 0
            batches = self._gather_json([self.rank, batch, self.config.run_id], dst)
        else:
            batches = [(self.rank, batch, self.config.run_id)]
        self.gathers += 1
        self._write(batch)
        return self._diagnose(batches) if batches else []

    def _gather_json(self, obj, dst: int) -> list:
        """``obj`` from every rank of the group, as JSON, in rank order on ``dst``; [] elsewhere.

        Through the job's rendezvous store, not a collective: no rank but ``dst`` waits, nothing touches the
        GPU stream, and no gloo Work is left to die in its worker thread. (``gather_object``'s does, and its last
        tensor release takes the GIL: a job that exits right after ``close()`` is by then finalizing and the
        process aborts, "terminate called without an active exception", about 1 run in 20 on two cores.)"""
        store = self._dist.distributed_c10d._get_default_store()
        key = f"moonep/detector/{self._tag}/{self.gathers}"
        if self.rank != dst:
            store.set(f"{key}/{self.rank}", json.dumps(obj))
            return []
        ranks = self._dist.get_process_group_ranks(self.group) if self.group is not None else range(self.world_size)
        keys = [f"{key}/{r}" for r in ranks if r != dst]
        got = dict(zip((r for r in ranks if r != dst), store.multi_get(keys), strict=True)) if keys else {}
        for k in keys:
            store.delete_key(k)
        return [obj if r == dst else json.loads(bytes(got[r])) for r in ranks]

    def _write(self, batch: list[dict]) -> None:
        if not self.config.trace_dir:
            return
        if self._file is None:
            os.makedirs(self.config.trace_dir, exist_ok=True)
            self._file = open(os.path.join(self.config.trace_dir, f"rank{self.rank}.jsonl"), "a")  # noqa: SIM115
            now = time.time()
            header = {"op": "header", "kind": "header", "rank": self.rank, "world_size": self.world_size}
            header.update(run_id=self.config.run_id, source="detector", t_enter=now)
            header.update(t_exit=now, step=None)
            self._file.write(json.dumps(header) + "\n")
        self._file.write("".join(json.dumps(r) + "\n" for r in batch))
        self._file.flush()

    def _diagnose(self, batches) -> list[Finding]:
        for rank, records, _ in batches:
            steps = self._window.setdefault(rank, deque())
            steps.extend(records)
            last = max((r["step"] for r in steps), default=0)
            while steps and steps[0]["step"] <= last - self.config.window:
                steps.popleft()
        traces = traces_from_records({r: list(recs) for r, recs in self._window.items()})
        self.findings = diagnose(build_tables(traces), self.config.thresholds)
        new = [f for f in self.findings if (f.kind, tuple(f.ranks)) not in self._alerted]
        for f in new:
            self._alerted.add((f.kind, tuple(f.ranks)))
            log.warning("straggler at step %d: %s ranks %s since step %s: %s", self.step_index - 1, f.kind,
                        f.ranks, f.onset_step, f.detail)  # fmt: skip
            if self.on_finding is not None:
                self.on_finding(f)
        return new

    def close(self) -> list[Finding]:
        """The last gather (when steps are pending) and the file closed; rank 0's findings, [] elsewhere."""
        try:
            if self._pending or self._events:
                self.gather()
        finally:
            if self._file is not None:
                self._file.close()
                self._file = None
        return list(self.findings)
