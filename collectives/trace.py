"""Per-rank, per-op tracing to JSON-lines files (read by the straggler tools).

Off by default. Turned on by the environment variable ``MOONEP_TRACE_DIR`` (a folder) or by passing
``trace_dir=`` to ``collectives.launch`` / ``collectives.init``. Each rank appends to
``<dir>/rank<global_rank>.jsonl`` one JSON object per operation:

=============  ======  =================================================================================
field          type    meaning
=============  ======  =================================================================================
``op``         str     ``all_to_all_single``, ``all_gather``, ``all_reduce``, ``reduce_scatter``,
                       ``broadcast``, ``barrier``, ``send``, ``recv``, or ``validate`` (argument header)
``bytes``      int     payload bytes this rank contributed (input size; output size for ``all_gather``)
``group``      [int]   global ranks of the group the op ran on, in group-rank order
``rank``       int     global rank of the writer
``seq``        int     0, 1, 2, ... per writer, in issue order
``t_enter``    float   wall-clock seconds (``time.time()``) when the op was entered
``t_exit``     float   wall-clock seconds when it returned or raised
``ok``         bool    false when the op raised (timeout, peer failure)
``step``       int     training step set by the caller (``tracer.step = n``), ``null`` when unset
``peer``       int     ``send``/``recv`` only: global rank of the other side
=============  ======  =================================================================================

The first line a tracer writes is its header, ``{"op": "header", "kind": "header", "rank", "world_size", ...}``
(``world_size``: ranks of the job, set by the world communicator; null when the tracer never met one;
``run_id``: the job's id, the same on every rank), so a reader knows which rank files should be there (``moonep
diagnose`` reports missing ones) and refuses files of two runs in one folder. ``read_trace`` skips it.

Workloads add their own records (compute phases, data loading) with ``Tracer.record_event(op, t_enter, t_exit,
**fields)``: same fields, ``bytes`` 0 and ``group`` ``[rank]`` unless given, plus whatever ``fields`` holds
(for example ``{"op": "forward", "layer": "moe", ...}``). Readers must ignore fields they do not know.

Times are each host's wall clock: ranks on one host compare directly; across hosts the reader must allow for
clock offset. Lines are buffered and flushed every ``flush_every`` records, at least once a second, and at close, so
tracing costs a
dict and a list append per op; with tracing off the cost is one ``is None`` test.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

TRACE_ENV = "MOONEP_TRACE_DIR"
RUN_ID_ENV = "MOONEP_RUN_ID"


class Tracer:
    """Appends op records for one rank to ``<trace_dir>/rank<rank>.jsonl``."""

    def __init__(self, trace_dir: str | os.PathLike, rank: int, flush_every: int = 256):
        os.makedirs(trace_dir, exist_ok=True)
        self.path = os.path.join(os.fspath(trace_dir), f"rank{rank}.jsonl")
        self.rank = rank
        self.flush_every = flush_every
        self._seq = 0
        self._pending: list[str] = []
        self.step: int | None = None
        """Training step stamped on every record (set by the training loop)."""
        self.flush_seconds = 1.0
        self._last_flush = time.time()
        self.world_size: int | None = None
        """Ranks of the job, for the header (the world communicator sets it before the first record)."""
        self.run_id: str | None = os.environ.get(RUN_ID_ENV) or None
        """The job's run id, the same on every rank (``$MOONEP_RUN_ID``, set by ``collectives.launch`` for the
        ranks it spawns, or agreed by ``collectives.init``); in the header, so a reader refuses mixed runs."""
        self._header_written = False

    def record(
        self,
        op: str,
        nbytes: int,
        group: Sequence[int],
        t_enter: float,
        t_exit: float,
        ok: bool = True,
        peer: int | None = None,
    ) -> None:
        record = {
            "op": op,
            "bytes": int(nbytes),
            "group": list(group),
            "rank": self.rank,
            "seq": self._seq,
            "t_enter": t_enter,
            "t_exit": t_exit,
            "ok": ok,
            "step": self.step,
        }
        if peer is not None:
            record["peer"] = peer
        self._append(record)

    def record_event(self, op: str, t_enter: float, t_exit: float, **fields) -> None:
        """A workload's own record (compute phase, data loading): the op fields plus ``fields``."""
        record = {
            "op": op,
            "bytes": 0,
            "group": [self.rank],
            "rank": self.rank,
            "seq": self._seq,
            "t_enter": t_enter,
            "t_exit": t_exit,
            "ok": True,
            "step": self.step,
        }
        record.update(fields)
        self._append(record)

    def _append(self, record: dict) -> None:
        self._pending.append(json.dumps(record))
        self._seq += 1
        # By count, and at least once a second, so a live reader (moonep diagnose --follow) sees fresh records.
        if len(self._pending) >= self.flush_every or record["t_exit"] - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.time()
        if self._pending and not self._header_written:
            self._header_written = True
            now = time.time()
            header = {"op": "header", "kind": "header", "rank": self.rank, "world_size": self.world_size}
            header["run_id"] = self.run_id
            header.update(t_enter=now, t_exit=now, step=None)
            self._pending.insert(0, json.dumps(header))
        if self._pending:
            with open(self.path, "a") as f:
                f.write("\n".join(self._pending) + "\n")
            self._pending.clear()

    def close(self) -> None:
        self.flush()


_TRACERS: dict[tuple[str, int], Tracer] = {}


def tracer_from_env(rank: int, trace_dir: str | os.PathLike | None = None) -> Tracer | None:
    """A tracer when ``trace_dir`` or ``$MOONEP_TRACE_DIR`` names a folder, else ``None`` (tracing off).

    One tracer per (folder, rank) per process, shared by a communicator and its sub-groups, so ``seq`` is one
    sequence per file.
    """
    trace_dir = trace_dir or os.environ.get(TRACE_ENV)
    if not trace_dir:
        return None
    key = (os.path.abspath(os.fspath(trace_dir)), rank)
    if key not in _TRACERS:
        _TRACERS[key] = Tracer(trace_dir, rank)
    return _TRACERS[key]


def read_trace(path: str | os.PathLike) -> list[dict]:
    """Op records of one ``rank<N>.jsonl`` file (plain JSON, never pickle); header lines are left out."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("kind") != "header"]
