"""Command-line hooks of cp_kda: the ``kda`` benchmark target (``moonep bench kda``).

Only argparse and ``moonep_base`` (standard library) are imported at module level, so ``moonep --help`` stays fast
and loads no torch; the handler imports the benchmark.
"""

from __future__ import annotations

import argparse
import re
import sys

from moonep_base import MAX_SIZE, memory_bytes, write_json


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    """Add ``bench kda`` to the ``bench`` sub-parsers (cp_kda adds no top-level command)."""
    p = bench.add_parser(
        "kda",
        help="KDA: chunked vs recurrent, and context-parallel scan vs ring",
        description="Chunked vs recurrent KDA at T = 1k, 8k, 32k and context-parallel "
        "KDA (scan, ring) at CP = 1, 2, 4, T = 32k; one thread per rank.",
    )
    p.add_argument("--json", metavar="PATH", help="write the results here as JSON")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds): checks the pipeline and schema")
    p.add_argument("--heads", type=int, default=2, help="H, heads (default 2; --quick uses 1)")
    p.add_argument("--head-dim", type=int, default=128, help="K = V, head dimension (default 128, as K3; --quick: 16)")
    p.add_argument("--chunk-size", type=int, default=64, help="chunk length C (default 64)")
    p.set_defaults(func=bench_kda)


def bench_kda(args: argparse.Namespace) -> int:
    from cp_kda.bench import run_bench  # heavy: torch (cp_kda.cli must not load it: moonep --help imports this module)

    problem = _size_problem(args)
    if problem:  # before any work: a 0 ended in a ZeroDivisionError or a kernel's ValueError traceback, 10**20 in
        print(f"error: {problem}", file=sys.stderr)  # an OverflowError, --heads 10**5 in an allocator's traceback
        return 2
    try:
        result = run_bench(quick=args.quick, H=args.heads, K=args.head_dim, V=args.head_dim, chunk_size=args.chunk_size)
    except (MemoryError, RuntimeError) as exc:  # a rank's failure (LaunchError) is a RuntimeError too
        if not isinstance(exc, MemoryError) and _NO_MEMORY not in str(exc):
            raise
        said = f"the benchmark needs more memory than this machine has ({_no_memory(exc)})"
        print(f"error: {_flags(args)}: {said}", file=sys.stderr)
        return 2
    for T, row in result["chunk_vs_recurrent"].items():
        print(
            f"T={T:>6}  chunk {row['chunk']:.3f}s  recurrent {row['recurrent']:.3f}s  x{row['speedup']:.1f}  "
            f"(CPU time: {row['chunk_cpu']:.3f}s vs {row['recurrent_cpu']:.3f}s, x{row['speedup_cpu']:.1f})"
        )
    for e in result["cp"]:
        print(
            f"CP={e['world_size']} {e['strategy']:<4} T={e['T']}  {e['seconds']:.3f}s  "
            f"{e['bytes_per_rank']} B/rank (expected {e['expected_bytes_per_rank']})"
        )
    print("summary:", result["summary"])
    if args.json:
        write_json(args.json, result)
    return 0


_NO_MEMORY = "can't allocate memory"
"""torch's CPU allocator's words for a failed allocation (a RuntimeError; ``--chunk-size 5000`` asks 125 GB)."""


def _no_memory(exc: BaseException) -> str:
    """What failed, from the allocator's own words: how many bytes it was asked for."""
    asked = re.search(r"allocate (\d+) bytes", str(exc))
    return f"an allocation of {int(asked[1]) / 2**30:.1f} GiB failed" if asked else f"{type(exc).__name__}"


def _size_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the size flags, checked before any work; None when they fit this machine."""
    from cp_kda.bench import bench_sizes, input_bytes  # heavy: torch (see run_bench above)

    for name, v in _sizes(args):
        if not 1 <= v <= MAX_SIZE:
            return f"--{name}: must be in [1, {MAX_SIZE}], got {v}"
    shortest = bench_sizes(args.quick)[0][0]
    if args.chunk_size > shortest:  # a chunk past the sequence is all padding, and a chunk's work grows as its cube
        return f"--chunk-size {args.chunk_size}: must be at most the shortest sequence benchmarked, {shortest} tokens"
    need = 0 if args.quick else input_bytes(False, args.heads, args.head_dim, args.head_dim)
    have = memory_bytes()
    if need > have:
        return (
            f"{_flags(args)}: the benchmark's inputs alone need {need / 2**30:.1f} GiB, more than this machine's "
            f"{have / 2**30:.1f} GiB"
        )
    return None


def _flags(args: argparse.Namespace) -> str:
    """The size flags that count (``--quick`` sets heads and head size itself)."""
    return " ".join(f"--{n} {v}" for n, v in _sizes(args) if not args.quick or n == "chunk-size")


def _sizes(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [("heads", args.heads), ("head-dim", args.head_dim), ("chunk-size", args.chunk_size)]
