"""``moonep bench collectives`` and ``moonep roundtrip`` (the local demo)."""

from __future__ import annotations

import argparse
import os
import sys

from collectives import launch
from collectives.base import Communicator
from collectives.bench import (
    FULL_SIZES,
    QUICK_SIZES,
    bench_collectives,
    format_round_trip,
    format_table,
    round_trip,
    round_trip_bytes,
)
from moonep_base import memory_bytes, seconds_problem, write_json


def register(commands, bench) -> None:
    p = bench.add_parser(
        "collectives",
        help="all-to-all / all-gather bandwidth: our layer vs the raw backend",
        description="All-to-all and all-gather bandwidth over 4 KiB .. 64 MiB, our Communicator "
        "vs the raw backend call on the same ranks, interleaved in one run.",
    )
    _job_arguments(p)
    p.add_argument("--quick", action="store_true", help="three small sizes, three iterations (smoke run)")
    p.set_defaults(func=_bench)

    p = commands.add_parser(
        "roundtrip",
        help="demo: local ranks send bf16 rows with uneven splits and back",
        description="The smallest real end-to-end job: local ranks over gloo (or MPI) "
        "dispatch rows with uneven splits, return them, verify, and print "
        "a bandwidth table.",
    )
    _job_arguments(p)
    p.add_argument("--hidden", type=int, default=1024, help="row width (bf16 elements)")
    p.set_defaults(func=_roundtrip)


def _job_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("torch", "mpi"), default="torch", help="communication engine")
    p.add_argument("--world-size", type=int, default=4, help="local ranks to spawn (ignored under torchrun/mpiexec)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one collective may take")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _bench_rank(comm: Communicator, quick: bool) -> dict:
    return bench_collectives(comm, QUICK_SIZES if quick else FULL_SIZES, quick=quick)


def _round_trip_rank(comm: Communicator, hidden: int) -> dict:
    return round_trip(comm, hidden=hidden)


def _job_problem(args) -> str:
    """One line naming a bad job argument ('' when fine): checked before any rank starts."""
    if args.world_size < 1:
        return f"--world-size: must be >= 1, got {args.world_size}"
    if problem := seconds_problem(args.timeout):
        return f"--timeout: {problem}"
    if getattr(args, "hidden", 1) < 1:
        return f"--hidden: must be >= 1, got {args.hidden}"
    need = round_trip_bytes(args.world_size, args.hidden) if hasattr(args, "hidden") else 0
    if need > (have := memory_bytes()):  # --hidden 10**20 was an OverflowError on every rank, 10**9 the OOM killer
        return (
            f"--hidden {args.hidden}: {args.world_size} ranks' rows need {need / 2**30:.1f} GiB, more than this "
            f"machine's {have / 2**30:.1f} GiB"
        )
    return ""


def _run(args, fn, **kwargs):
    return launch(fn, args.world_size, backend=args.backend, timeout=args.timeout, **kwargs)


def _emit(args, report, table: str) -> None:
    if report is None:  # a non-zero rank under torchrun/mpiexec: rank 0 prints
        return
    print(table)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")


def _is_rank0() -> bool:
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in os.environ:
            return os.environ[key] == "0"
    return True


def _refuse(args) -> int:
    problem = _job_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


def _bench(args) -> int:
    if _refuse(args):
        return 2
    report = _run(args, _bench_rank, quick=args.quick)
    if _is_rank0():
        _emit(args, report, format_table(report))
    return 0


def _roundtrip(args) -> int:
    if _refuse(args):
        return 2
    report = _run(args, _round_trip_rank, hidden=args.hidden)
    if _is_rank0():
        _emit(args, report, format_round_trip(report))
    return 0 if all(r["verified"] for r in report["results"]) else 1
