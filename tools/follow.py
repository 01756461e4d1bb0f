"""``moonep diagnose --follow TRACE_DIR``: tail the rank files of a running job and print alerts.

Each poll reads only the bytes appended since the last poll (complete lines; a line still being written waits
for the next poll), adds them to the per-rank tables, and re-runs the detectors. A finding is alerted once per
(kind, ranks). A file with a corrupt complete line is dropped with one warning naming it, as in offline mode.
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from typing import TextIO

from moonep_base import seconds_problem
from tools.analysis import build_tables
from tools.detect import Thresholds
from tools.findings import diagnose
from tools.trace_lines import TraceWarning, parse_lines
from tools.traces import RankTrace, _add

_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


class Tail:
    """Incremental reader of ``rank<N>.jsonl`` files in one folder."""

    def __init__(self, trace_dir: str | os.PathLike):
        self.trace_dir = os.fspath(trace_dir)
        self.traces: dict[int, RankTrace] = {}
        self._offset: dict[str, int] = {}
        self._bad: set[str] = set()

    def poll(self) -> int:
        """Read what was appended; returns the number of new records."""
        new = 0
        names = sorted(os.listdir(self.trace_dir)) if os.path.isdir(self.trace_dir) else []
        for name in names:
            match = _RANK_FILE.match(name)
            path = os.path.join(self.trace_dir, name)
            if not match or path in self._bad:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(self._offset.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1  # complete lines only; the rest is re-read next poll
            if not end:
                continue
            records = parse_lines(path, chunk[:end].decode("utf-8", errors="replace"))
            if records is None:
                self._bad.add(path)  # parse_lines warned, naming the file
                self.traces.pop(int(match.group(1)), None)
                continue
            self._offset[path] = self._offset.get(path, 0) + end
            trace = self.traces.setdefault(int(match.group(1)), RankTrace(int(match.group(1))))
            for rec in records:
                _add(trace, rec)
            new += len(records)
        return new


def follow(
    trace_dir: str | os.PathLike,
    *,
    interval_s: float = 1.0,
    max_seconds: float | None = None,
    max_polls: int | None = None,
    thresholds: Thresholds | None = None,
    out: TextIO | None = None,
) -> list:
    """Poll until ``max_seconds`` / ``max_polls`` (forever when both are None); return the alerted findings."""
    if problem := seconds_problem(interval_s):
        raise ValueError(f"interval_s {problem}")
    out = out or sys.stdout
    tail, alerted, seen = Tail(trace_dir), [], set()
    start, polls = time.monotonic(), 0
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("always", TraceWarning)
            new = tail.poll()
        polls += 1
        if new and tail.traces:
            tables = build_tables(tail.traces)
            for f in diagnose(tables, thresholds):
                key = (f.kind, tuple(f.ranks))
                if key not in seen:
                    seen.add(key)
                    alerted.append(f)
                    print(
                        f"ALERT at step {tables.steps[-1]}: {f.kind} ranks {f.ranks} since step {f.onset_step} "
                        f"(confidence {f.confidence:.2f}): {f.detail}",
                        file=out,
                        flush=True,
                    )
        if max_polls is not None and polls >= max_polls:
            return alerted
        if max_seconds is not None and time.monotonic() - start >= max_seconds:
            return alerted
        time.sleep(interval_s)
