"""A failed rank's own error, from the rank to the user: the rank leaves its traceback and a one-line JSON summary
in ``<run_dir>/errors`` (``record_error``), and the command line turns a ``LaunchError`` into the one line it
prints and its exit status (``rank_error``)."""

from __future__ import annotations

import json
import os
import traceback

from moonep_base import write_json


def record_error(run_dir: str, rank: int, exc: BaseException) -> str:
    """Write this rank's traceback (and a one-line JSON summary) under ``run_dir/errors``; returns the path.

    Args:
        run_dir: the run folder.
        rank: this rank (names the files ``rank<R>.traceback`` and ``rank<R>.json``).
        exc: the exception being handled (its traceback is the current one).

    Returns:
        the traceback file's path.
    """
    folder = os.path.join(run_dir, "errors")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}.traceback")
    with open(path, "w") as f:
        f.write(traceback.format_exc())
    summary = {"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else ""}
    write_json(os.path.join(folder, f"rank{rank}.json"), {**summary, "bad_input": isinstance(exc, ValueError)})
    return path


def rank_error(run_dir: str, exc, started: float = 0.0) -> tuple[str, int]:
    """(one line for the user, exit status) for a ``LaunchError``: the failing rank's own message and the path of
    the traceback it left in ``run_dir/errors`` (``record_error``; one older than ``started`` is another run's
    and is not used); 2 when the rank rejected its input.

    Args:
        run_dir: the run folder.
        exc: the ``collectives.launch.LaunchError`` (``rank``: the failing rank or None; ``details``: its output).
        started: when the run started (``time.time()``).

    Returns:
        (the line, the exit status: 2 for bad input, else 1).
    """
    summary = os.path.join(run_dir, "errors", f"rank{exc.rank}.json")
    if exc.rank is not None and os.path.exists(summary) and os.path.getmtime(summary) >= started - 1:
        with open(summary) as f:  # our own rank wrote it, just now
            info = json.load(f)
        trace = os.path.join(run_dir, "errors", f"rank{exc.rank}.traceback")
        line = f"error: rank {exc.rank}: {info['type']}: {info['message']} (traceback: {trace})"
        return line, 2 if info["bad_input"] else 1
    details = [s for s in exc.details.strip().splitlines() if s.strip()]
    where = f"rank {exc.rank}" if exc.rank is not None else "a rank"
    return f"error: {where} failed: {details[-1] if details else 'no details'}", 1


__all__ = ["rank_error", "record_error"]
