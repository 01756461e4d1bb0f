"""The ``train`` command's flags (``moonep train``, ``python -m k3 train``, ``python -m k3.train``): argparse only,
so ``k3.cli`` stays light and ``k3.train`` can parse its own command line without importing the CLI."""

from __future__ import annotations

import argparse


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Add the training run's flags to ``p`` (``k3.train.train_command`` reads them)."""
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
    _add_fault_flags(p)


def _add_fault_flags(p: argparse.ArgumentParser) -> None:
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


def config_fields(args: argparse.Namespace) -> dict:
    """The ``TrainConfig`` fields the flags of ``add_train_flags`` set (the injected faults parsed).

    Args:
        args: the parsed flags.

    Returns:
        keyword arguments for ``TrainConfig`` (ValueError, one line, for a malformed fault spec).
    """
    from collectives.faults import parse_data_delays, parse_link_delay_specs, parse_slowdowns  # heavy: torch

    return {
        "preset": args.preset,
        "world_size": args.world_size,
        "cp": args.cp,
        "device": args.device,
        "steps": args.steps,
        "schedule_steps": args.schedule_steps,
        "seed": args.seed,
        "data": args.data,
        "run_dir": args.run_dir or f"out/k3-{args.preset}",
        "resume": args.resume,
        "balance": args.balance,
        "optimizer": args.optimizer,
        "progress": not args.no_progress,
        "trace_dir": args.trace_dir,
        "slowdowns": tuple(parse_slowdowns(args.inject_slowdown)),
        "data_delays": tuple(parse_data_delays(args.inject_data_delay)),
        "link_delays": tuple(parse_link_delay_specs(args.inject_link_delay)),
    }


__all__ = ["add_train_flags", "config_fields"]
