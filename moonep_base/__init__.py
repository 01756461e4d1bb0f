"""The toolkit's ground floor: standard library only, imports no toolkit package, so every package may import it.

It holds what every package shares:

- ``write_json(path, obj)``: JSON written atomically (temp file + ``os.replace``), so readers never see half a
  file. Library code uses it too (``K3Config.to_json``, checkpoints, the simulator's plots).
- the argparse plumbing. A package's ``cli.py`` defines ``register(commands, bench)``: ``commands`` and ``bench``
  are sub-parser actions, so it adds top-level commands (``plan``) and benchmark targets (``bench planner``); every
  leaf parser sets ``func=handler`` with ``handler(args) -> int``. ``build_parser`` builds the tree from any list of
  such functions and ``run`` parses and dispatches. ``python -m <package>`` passes its own ``register`` alone
  (``run_package``); the ``moonep`` console script (``moonep.console``) gathers every package's.
- ``UsageError``: a user mistake that only a library call below the command line can see (``collectives.launch``
  asked for more local ranks than this machine's limits hold). ``run`` prints it as one line, exit 2.
- ``JobFailed``: a rank of a job a command launched failed; ``run`` prints the rank's own report, exit 1.
- ``memory_bytes``: the memory a new job can have here, which benchmarks check their sizes against before any work.
- ``seconds_problem``: the one rule for a wait a user gives in seconds (a collective timeout, a sampling or polling
  period): a number in (0, a year]. Past a year a thread's wait and gloo's timers overflow.
- ``MAX_SIZE``: the largest size a flag or a config field takes (``2**31 - 1``), for the simulator's specs and the
  benchmarks' size flags alike.
- ``lazy_exports`` (``moonep_base.lazy``): the PEP 562 ``__getattr__`` / ``__dir__`` pair that lets a package's
  public names resolve on first use, so ``import <package>.cli`` stays light.

Not ``moonep``: that is the expert-parallel package, above ``planner`` and ``collectives``, which must run their
command lines without it (see ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from moonep_base.lazy import lazy_exports

__all__ = [
    "MAX_SECONDS",
    "MAX_SIZE",
    "JobFailed",
    "UsageError",
    "build_parser",
    "check_folder",
    "lazy_exports",
    "memory_bytes",
    "run",
    "run_package",
    "seconds_problem",
    "write_json",
]

MAX_SECONDS = 365 * 86400
"""Longest wait in seconds a flag or a call takes, a year: ``threading``'s waits and gloo's clock overflow before
infinity (``--timeout inf`` and ``--interval 1e300`` were tracebacks)."""
MAX_SIZE = 2**31 - 1
"""Largest size a flag or a config field takes (widths, counts, lengths, chunk sizes): far above any model, far
below float overflow."""


def memory_bytes() -> int:
    """Memory a new job can have on this machine now (Linux ``MemAvailable``; elsewhere the physical memory): what
    a benchmark's size flags are checked against before any work (past it, an allocator's traceback or the OOM
    killer)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def seconds_problem(value: Any) -> str | None:
    """Why ``value`` is not a wait in seconds (a number in (0, ``MAX_SECONDS``]); None when it is. Callers prefix
    the name: ``f"--timeout: {problem}"``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
        return f"must be a number of seconds in (0, {MAX_SECONDS}] (a year), got {value!r}"
    return None


class UsageError(ValueError):
    """Bad input from the user, found by library code under a command: ``run`` prints it as one line, exit 2."""


class JobFailed(RuntimeError):
    """A process of a job that a command started failed (``collectives.launch``'s ``LaunchError``). Its message
    names the rank and holds the rank's own traceback or exit status, so ``run`` prints that, exit 1, without the
    launcher's traceback, which only says where the command launched."""


Register = Callable[[Any, Any], None]
"""``register(commands, bench)`` of a package's ``cli.py``."""


def build_parser(registers: Sequence[Register], prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """The argparse tree: one ``commands`` level, with ``bench`` holding every benchmark target."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = commands.add_parser("bench", help="benchmarks (JSON output with --json)")
    bench = bench_parser.add_subparsers(dest="target", metavar="TARGET")
    bench_parser.set_defaults(func=lambda args: _usage(bench_parser))
    for register in registers:
        register(commands, bench)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and call the chosen handler; help and exit 2 without one. A
    ``UsageError`` is one line and exit 2, as is an ``OSError`` on a path the user gave (``--json`` naming a
    folder, an unwritable ``--plot``); any other ``OSError`` propagates. A ``JobFailed`` prints the failed rank's
    report without the launcher's traceback, exit 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        return _usage(parser)
    try:
        return int(func(args) or 0)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        given = _path_given(argv, exc)
        if given is None:
            raise
        print(f"error: {given}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _path_given(argv: list[str], exc: OSError) -> str | None:
    """``--flag PATH`` (or ``PATH``, positional) when ``exc`` is about a path on the command line, a file written
    under it, or its temp twin from ``write_json``; None otherwise."""
    hit = [os.path.abspath(os.fspath(n)) for n in (exc.filename, exc.filename2) if n is not None]
    for i, word in enumerate(argv):
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if not value or value.startswith("-"):
            continue
        given = os.path.abspath(value)
        if any(h == given or h.startswith((given + os.sep, given + ".tmp.")) for h in hit):
            if value is not word:
                return word.replace("=", " ", 1)
            flag = argv[i - 1] if i and argv[i - 1].startswith("--") else ""
            return f"{flag} {value}".strip()
    return None


def run_package(register: Register, prog: str, argv: Sequence[str] | None = None) -> int:
    """``python -m <package>``: that package's commands alone."""
    return run(build_parser([register], prog), argv)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def check_folder(name: str, path: str) -> None:
    """ValueError naming ``name`` when ``path``, or the nearest part of it that exists, is not a folder (a run or
    trace folder the job will create): caught before any rank starts, not as a NotADirectoryError /
    FileExistsError traceback from a rank or the launcher."""
    full = existing = os.path.abspath(path)
    while not os.path.lexists(existing):  # the root always exists: this ends
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = path if existing == full else f"{path} (its part {existing})"
        raise ValueError(f"{name}: {where} exists and is not a folder")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (temp file + rename), so readers never see half a file."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # json.dump raised (an object JSON cannot hold): no temp file left behind
            os.remove(tmp)
