"""Command-line hooks of cp_kda: the ``kda`` benchmark target (``moonep bench kda``).

Only argparse and ``moonep_base`` (standard library) are imported at module level, so ``moonep --help`` stays fast
and loads no torch; the handler imports the benchmark.
"""

from __future__ import annotations

import argparse
import sys

from moonep_base import write_json


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
    bad = [f"--{n}: must be >= 1, got {v}" for n, v in _sizes(args) if v < 1]
    if bad:  # before any work: a 0 ended in a ZeroDivisionError or a kernel's ValueError traceback
        print(f"error: {bad[0]}", file=sys.stderr)
        return 2
    from cp_kda.bench import run_bench  # heavy: torch (cp_kda.cli must not load it: moonep --help imports this module)

    result = run_bench(quick=args.quick, H=args.heads, K=args.head_dim, V=args.head_dim, chunk_size=args.chunk_size)
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


def _sizes(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [("heads", args.heads), ("head-dim", args.head_dim), ("chunk-size", args.chunk_size)]
