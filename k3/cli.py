"""``moonep train`` (and ``python -m k3 train``): argparse only at module level, so ``moonep --help`` is fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from moonep_base import write_json


def register(commands, bench) -> None:
    p = commands.add_parser("train", help="train Kimi K3 (default: tiny preset, 4 local CPU ranks, EP + DP)")
    p.add_argument("--preset", default="tiny", choices=("tiny", "small", "full"))
    p.add_argument("--world-size", type=int, default=4, help="local ranks (ignored under torchrun/mpiexec)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over this many ranks")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: one GPU per rank (NCCL), e.g. under torchrun --nproc_per_node=<GPUs>",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--schedule-steps",
        type=int,
        default=None,
        help="LR schedule length (cosine floor reached here); default: the first run's --steps, kept on --resume",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text folder (default: this Python's standard library)")
    p.add_argument("--run-dir", default=None, help="run folder (default out/k3-<preset>)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--balance", default="qb", choices=("qb", "sign", "none"))
    p.add_argument("--optimizer", default="muon", choices=("muon", "adamw"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--trace-dir",
        default=None,
        help="write per-rank traces here for `moonep diagnose` (default: $MOONEP_TRACE_DIR, or no tracing)",
    )
    p.add_argument(
        "--inject-slowdown",
        default="",
        metavar="rank=R,factor=F[,from_step=N]",
        help="fault injection (tests, demos): rank R computes F x slower from step N",
    )
    p.add_argument(
        "--inject-data-delay",
        default="",
        metavar="rank=R,ms=M[,from_step=N]",
        help="fault injection: rank R's data loading takes M ms longer from step N",
    )
    p.add_argument(
        "--inject-link-delay",
        default="",
        metavar="src=A,dst=B,ms=M[,from_step=N]",
        help="fault injection: data A sends to B arrives M ms late from step N",
    )
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
    from collectives.faults import parse_data_delays, parse_link_delay_specs, parse_slowdowns  # heavy: torch
    from collectives.launch import LaunchError  # heavy: torch
    from k3.train import TrainConfig, train  # heavy: the trainer (torch)

    try:
        tc = TrainConfig(
            preset=args.preset,
            world_size=args.world_size,
            cp=args.cp,
            device=args.device,
            steps=args.steps,
            schedule_steps=args.schedule_steps,
            seed=args.seed,
            data=args.data,
            run_dir=args.run_dir or f"out/k3-{args.preset}",
            resume=args.resume,
            balance=args.balance,
            optimizer=args.optimizer,
            progress=not args.no_progress,
            trace_dir=args.trace_dir,
            slowdowns=tuple(parse_slowdowns(args.inject_slowdown)),
            data_delays=tuple(parse_data_delays(args.inject_data_delay)),
            link_delays=tuple(parse_link_delay_specs(args.inject_link_delay)),
        )
        started = time.time()
        out = train(tc)
    except ValueError as exc:  # bad flags or run folder: one line naming the problem, no traceback
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except LaunchError as exc:  # a rank failed: its one line, and where its own traceback is
        line, code = rank_error(tc.run_dir, exc, started)
        print(line, file=sys.stderr)
        return code
    if out["rank"] != 0:  # under torchrun/mpiexec every rank returns here; rank 0 speaks
        return 0
    print(f"final train loss {out['losses'][-1]:.4f}" if out["losses"] else "nothing to do (already at --steps)")
    if out["val_loss"] is not None:
        print(f"validation loss {out['val_loss']:.4f}")
    for path in out["plots"]:
        print(f"plot: {path}")
    print(f"run folder: {out['run_dir']}")
    return 0


def rank_error(run_dir: str, exc, started: float = 0.0) -> tuple[str, int]:
    """(one line for the user, exit status) for a ``LaunchError``: the failing rank's own message and the path of
    the traceback it left in ``run_dir/errors`` (k3.train.record_error; one older than ``started`` is another
    run's and is not used); 2 when the rank rejected its input."""
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
