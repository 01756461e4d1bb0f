"""One trace line -> a valid record, or why it is not (``tools.traces`` reads the folder).

Lines are parsed with ``json.loads`` only (never pickle). A line that is not a valid record (not JSON, wrong
types, NaN or infinite times, a group that is not a list of ranks, a count that is not a number) is dropped with
a warning naming ``file:line``, and the rest of the file is kept: one damaged line never hides a rank.
"""

from __future__ import annotations

import json
import math
import warnings

WARN_LINES = 5
"""Dropped lines of one file warned about one by one; the rest are counted in one more warning."""
_REQUIRED = {"op": str, "rank": int, "t_enter": (int, float), "t_exit": (int, float)}
MAX_RANKS = 2**20
"""Most ranks a trace may name, a million (far past any job): a rank or world size past it is damage, and
would have the diagnosis walk every rank up to it (``world_size: 10**20`` in a header hung ``diagnose``)."""


class TraceWarning(UserWarning):
    """A trace file or line was skipped; the message names the file."""


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def finite(x) -> bool:
    """A number a float holds finitely: not NaN, not infinite, not a JSON integer past a float's range."""
    try:
        return number(x) and math.isfinite(x)
    except OverflowError:  # an integer of hundreds of digits (a damaged file)
        return False


def count(x) -> bool:
    """A finite number >= 0 (bytes, tokens, nanoseconds)."""
    return finite(x) and x >= 0


def whole(x) -> bool:
    """An integer, not a bool (JSON's true is an int to Python)."""
    return isinstance(x, int) and not isinstance(x, bool)


def rank_id(x) -> bool:
    """A rank a trace may name: an integer in [0, ``MAX_RANKS``)."""
    return whole(x) and 0 <= x < MAX_RANKS


def _problem(rec) -> str | None:
    """Why ``rec`` is not a valid trace record (None when it is)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("kind") == "header":
        ws, run, rank = rec.get("world_size"), rec.get("run_id"), rec.get("rank")
        good = (ws is None or (whole(ws) and 1 <= ws <= MAX_RANKS)) and (run is None or isinstance(run, str))
        good = good and (rank is None or rank_id(rank))
        return None if good else "bad header"
    for key, kind in _REQUIRED.items():
        if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
            return f"field {key!r} missing or of the wrong type"
    if not rank_id(rec["rank"]):
        return f"rank {rec['rank']!r:.40} is not in [0, {MAX_RANKS})"
    for key in ("t_enter", "t_exit", "cpu_s"):
        if key in rec and number(rec[key]) and not finite(rec[key]):
            return f"{key} is {rec[key]!r:.40} (not finite)"
    step = rec.get("step")
    if not (step is None or whole(step)):
        return "step is not an integer"
    group = rec.get("group")
    if group is not None and not (isinstance(group, list) and all(rank_id(g) for g in group)):
        return "group is not a list of ranks"
    for key in ("bytes", "tokens"):  # counts a writer may leave out, never of another type
        if rec.get(key) is not None and not count(rec[key]):
            return f"{key} is not a count"
    return None if rec["t_exit"] >= rec["t_enter"] else "t_exit before t_enter"


def parse_lines(path: str, text: str, dropped: list[str] | None = None) -> list[dict]:
    """Valid records of one file's text. Each invalid line is dropped and appended to ``dropped`` (when given)
    as ``path:line: why``; the first ``WARN_LINES`` of a file are each a ``TraceWarning``, the rest one more
    warning with their count (a file of another schema is one warning, not one a line)."""
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]  # text after the last newline was cut mid-write
    records, bad = [], []
    for line_no, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec, why = None, "not JSON"
        else:
            why = _problem(rec)
        if why is None:
            records.append(rec)
            continue
        bad.append(f"{path}:{line_no}: {why}; line dropped")
    if tail.strip():
        bad.append(f"{path}:{len(lines)}: last line truncated (run still writing, or killed); line dropped")
    for message in bad[:WARN_LINES]:
        warn_dropped(message, dropped)
    if len(bad) > WARN_LINES:  # a file of another schema (a per-step timing log): one summary, not a warning a line
        what = "no line is a trace record (not this format?)" if not records else "more lines dropped"
        warn_dropped(
            f"{path}: {len(bad) - WARN_LINES} {what}; {len(bad)} of {len(bad) + len(records)} lines dropped", None
        )
        if dropped is not None:
            dropped.extend(bad[WARN_LINES:])
    return records


def warn_dropped(message: str, dropped: list[str] | None) -> None:
    warnings.warn(message, TraceWarning, stacklevel=3)
    if dropped is not None:
        dropped.append(message)
