"""``moonep train`` (and ``python -m k3 train``): argparse only at module level, so ``moonep --help`` is fast."""

from __future__ import annotations

import argparse
import sys

from k3.train_flags import add_train_flags
from moonep_base import write_json


def register(commands, bench) -> None:
    """Add ``train`` to ``commands``, and ``train`` and ``k3-memory`` to ``bench`` (``moonep_base``'s plumbing)."""
    p = commands.add_parser("train", help="train Kimi K3 (default: tiny preset, 4 local CPU ranks, EP + DP)")
    add_train_flags(p)
    p.set_defaults(func=_train)

    b = bench.add_parser("train", help="K3 training tokens/s and peak memory at EP = 1, 2, 4")
    b.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    b.add_argument("--steps", type=int, default=5, help="timed steps per world size")
    b.add_argument("--world-sizes", default="1,2,4")
    b.add_argument("--quick", action="store_true", help="2 timed steps at EP = 1, 2 (seconds; for tests)")
    b.add_argument("--json", default=None, help="write the results here")
    b.set_defaults(func=_bench)
    _register_memory_bench(bench)


def _register_memory_bench(bench) -> None:
    m = bench.add_parser(
        "k3-memory", help="bytes K3 layers save for the backward, per token per layer, by module (and at K3 widths)"
    )
    m.add_argument("--widths", default="2,4", help="model widths in 1/32 of K3's, two or more (32 is K3)")
    m.add_argument("--seq-lens", default="120,240", help="sequence lengths (per-token bytes must not grow)")
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="activation dtype")
    m.add_argument("--quick", action="store_true", help="widths 1,2 and sequence lengths 40,72 (seconds; tests)")
    m.add_argument("--json", default=None, help="write the results here")
    m.set_defaults(func=_memory_bench)


def _train(args: argparse.Namespace) -> int:
    from k3.train import train_command  # heavy: the trainer (torch)

    return train_command(args)


def _world_sizes(text: str, flag: str = "--world-sizes", what: str = "world size") -> tuple[int, ...]:
    """``--world-sizes`` "1,2,4" -> (1, 2, 4); ValueError naming a part that is not an integer >= 1."""
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{flag}: {part!r} is not a {what} (give integers >= 1, e.g. 1,2,4)")
        sizes.append(int(part))
    return tuple(sizes)


def _bench(args: argparse.Namespace) -> int:
    from k3.bench import run_bench  # heavy: torch

    try:
        sizes = (1, 2) if args.quick else _world_sizes(args.world_sizes)
        if args.steps < 1:
            raise ValueError(f"--steps: must be >= 1, got {args.steps}")
        out = run_bench(args.preset, sizes, 2 if args.quick else args.steps)
    except ValueError as exc:  # bad flags (sizes the preset's batch does not split over): one line
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    for r in out["results"]:
        print(
            f"EP={r['world_size']}: {r['tokens_per_s']:.0f} tokens/s, {r['step_s'] * 1e3:.0f} ms/step, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB per rank"
        )
    if args.json:
        write_json(args.json, out)
    return 0


def _memory_bench(args: argparse.Namespace) -> int:
    from collectives import launch  # heavy: torch
    from k3.saved_memory import check_bench_args, format_table, memory_bench_rank  # heavy: torch

    try:
        widths = (1, 2) if args.quick else _world_sizes(args.widths, "--widths", "width")
        seq_lens = (40, 72) if args.quick else _world_sizes(args.seq_lens, "--seq-lens", "sequence length")
        check_bench_args(widths, seq_lens)
    except ValueError as exc:  # bad flags: one line naming the flag, before any rank starts
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    # one launched rank: the MoE layers run moonep's EP step (what training runs) over a world-size-1 group
    out = launch(memory_bench_rank, 1, timeout=600, widths=widths, seq_lens=seq_lens, dtype=args.dtype)
    print("\n".join(format_table(out)))
    if args.json:
        write_json(args.json, out)
        print(f"the simulator's K3 spec beside it: moonep simulate saved-bytes --measured {args.json}")
    return 0
