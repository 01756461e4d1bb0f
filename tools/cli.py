"""``moonep diagnose | probe | straggler-demo`` and ``moonep bench telemetry | detector`` (also ``python -m tools``).

    moonep diagnose TRACE_DIR [--json out.json] [--plot DIR] [--probe-json probe.json]
    moonep diagnose --follow TRACE_DIR [--interval 1] [--max-seconds S]
    moonep probe --world-size 4 [--json probe.json]        # also: moonep diagnose probe --world-size 4
    moonep straggler-demo --world-size 4 --steps 40 --inject-slowdown rank=2,factor=1.3,from_step=10
    moonep bench telemetry --json telemetry.json
    moonep bench detector --json detector.json

Each way of running ``diagnose`` refuses the flags it would ignore (``DIAGNOSE_MODES``).

Exit status: 0 no finding, 1 findings (scripts can alert on it), 2 usage or input errors, and for an empty
trace or (without ``--partial``) an incomplete one: an expected rank missing, a rank short of steps, a dropped line,
or fewer steps than a finding needs (``steps.needed`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import warnings

from collectives.faults import parse_data_delays, parse_link_delay_specs, parse_slowdowns
from moonep_base import check_folder, seconds_problem, write_json
from tools.bench import bench_telemetry
from tools.bench_detector import bench_detector
from tools.detect import Thresholds
from tools.follow import follow
from tools.plots import plot
from tools.probe import ProbeConfig, run_probe
from tools.report import analyse, format_report, too_short
from tools.trace_lines import MAX_RANKS
from tools.traces import TraceFormatError
from tools.workload import WorkloadConfig, run_local

DIAGNOSE_DESCRIPTION = """Which rank or link slows the job, why, since when, and what it costs.

Accepted formats (chosen by content; one folder may hold several):
  rank<N>.jsonl         our JSON lines (collectives tracing, moonep train, tools.detector.StragglerDetector)
  *.json, *.json.gz     PyTorch profiler (Kineto) traces: export_chrome_trace or tensorboard_trace_handler
                        files, one or many per rank; rank from distributedInfo, --rank-from, or rank<N> in the name
  Flight Recorder       torch's collective ring buffer dumps (TORCH_FR_BUFFER_SIZE), JSON or pickle (read
                        without running any object), named <prefix><rank>: hangs, mismatches, late arrivals

Exit status: 0 nothing found, 1 findings, 2 bad input, an empty trace or (without --partial) an incomplete one."""


def register(commands, bench) -> None:
    d = commands.add_parser(
        "diagnose",
        help="straggler diagnosis of a trace folder (which rank or link, why, since when, what it costs)",
        description=DIAGNOSE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument(
        "trace_dir", metavar="TRACE_DIR", help="folder of traces in any accepted format (or 'probe', see below)"
    )
    d.add_argument(
        "--rank-from",
        metavar="REGEX",
        help="read each file's rank from its name with this regex (first group), for profiler traces without "
        "distributedInfo and Flight Recorder dumps not named <prefix><rank>",
    )
    d.add_argument("--json", metavar="FILE", help="write the stable findings JSON here")
    d.add_argument("--plot", metavar="DIR", help="write the timeline, heatmap and wait-matrix PNGs here")
    d.add_argument("--probe-json", metavar="FILE", help="a `moonep probe --json` result to name slow-link pairs")
    d.add_argument("--follow", action="store_true", help="tail a running job's rank<N>.jsonl files, print alerts")
    d.add_argument("--interval", type=float, help="--follow: seconds between polls (default 1)")
    d.add_argument("--max-seconds", type=float, help="--follow: stop after this long (default: until Ctrl-C)")
    d.add_argument(
        "--world-size",
        type=int,
        help="ranks the job had (default: the trace's header); `diagnose probe --world-size N` runs the probe",
    )
    d.add_argument(
        "--partial",
        action="store_true",
        help="diagnose an incomplete trace (missing ranks or steps, dropped lines) instead of exiting 2",
    )
    _probe_args(d, with_world=False)
    d.set_defaults(func=_diagnose)

    p = commands.add_parser("probe", help="time send/recv between every pair of local ranks (slow-link finder)")
    _probe_args(p, with_world=True)
    p.set_defaults(func=_probe)

    demo = commands.add_parser(
        "straggler-demo", help="run a synthetic MoE step on local ranks with injected faults, then diagnose its trace"
    )
    demo.add_argument("--world-size", type=int, default=4)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--trace-dir", help="keep the trace here (default: a temporary folder)")
    demo.add_argument("--inject-slowdown", default="", metavar="rank=R,factor=F[,from_step=N]")
    demo.add_argument("--inject-data-delay", default="", metavar="rank=R,ms=M[,from_step=N]")
    demo.add_argument("--inject-link-delay", default="", metavar="src=A,dst=B,ms=M[,from_step=N]")
    demo.add_argument("--skew", type=float, default=0.0, help="fraction of rows routed to --hot-rank (imbalance)")
    demo.add_argument("--hot-rank", type=int, default=0)
    demo.add_argument("--probe", action="store_true", help="also run the pairwise probe (same link delays)")
    demo.add_argument("--json", metavar="FILE", help="write the findings JSON here")
    demo.add_argument("--plot", metavar="DIR", help="write the plots here")
    demo.set_defaults(func=_demo)

    _bench_args(bench)


def _bench_args(bench) -> None:
    b = bench.add_parser("telemetry", help="step time with vs without telemetry sampling (goal <= 2%% slower)")
    b.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks (1: no cross-rank coupling, so host noise does not drown a 2%% effect)",
    )
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--blocks", type=int, default=20, help="alternating off/on blocks of steps")
    b.add_argument("--interval", type=float, default=0.05, help="sampling period, seconds (default harsh: 50 ms)")
    b.add_argument("--json", metavar="FILE", help="write the result JSON here")
    b.set_defaults(func=_bench)

    det = bench.add_parser(
        "detector", help="a training loop with vs without the in-loop StragglerDetector (goal < 1%%)"
    )
    det.add_argument("--steps", type=int, default=400)
    det.add_argument("--blocks", type=int, default=10, help="alternating off/on blocks of steps (even)")
    det.add_argument("--step-ms", type=float, default=50.0, help="busy work per step, milliseconds")
    det.add_argument("--every", type=int, default=50, help="steps between the detector's gathers")
    det.add_argument("--json", metavar="FILE", help="write the result JSON here")
    det.set_defaults(func=_bench_detector)


def _probe_args(p, with_world: bool) -> None:
    if with_world:
        p.add_argument("--world-size", type=int, required=True, help="local ranks to launch")
        p.add_argument("--json", metavar="FILE", help="write the probe JSON here")
    p.add_argument("--rounds", type=int, help="probe: timed sends per ordered pair (default 5)")
    p.add_argument("--nbytes", type=int, help="probe: bytes per send (default 4096)")
    if with_world:
        p.add_argument(
            "--inject-link-delay", default="", metavar="src=A,dst=B,ms=M", help="fault injection for demos and tests"
        )
    else:
        p.add_argument("--inject-link-delay", default="", help=argparse.SUPPRESS)


def _err(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _run_probe(args) -> dict:
    given = {k: getattr(args, k) for k in ("rounds", "nbytes") if getattr(args, k, None) is not None}
    return run_probe(args.world_size, ProbeConfig(**given), link_delay=args.inject_link_delay)


def _print_probe(result: dict) -> None:
    print(f"median one-way {result['median_s'] * 1e3:.3f} ms over {len(result['one_way_s'])} ranks")
    for pair in result["slow_pairs"]:
        print(
            f"slow pair {pair['ranks'][0]} -> {pair['ranks'][1]}: {pair['seconds'] * 1e3:.2f} ms "
            f"({pair['ratio']:.1f}x the median)"
        )
    if not result["slow_pairs"]:
        print("no slow pair")


def _probe(args) -> int:
    try:
        result = _run_probe(args)
    except ValueError as exc:
        return _err(str(exc))
    _print_probe(result)
    if args.json:
        write_json(args.json, result)
    return 1 if result["slow_pairs"] else 0


PROBE_MODE, FOLLOW_MODE = "diagnose probe --world-size N", "diagnose --follow"
FOLDER_MODE = "diagnose of a trace folder"
DIAGNOSE_MODES = {
    PROBE_MODE: ("world_size", "rounds", "nbytes", "inject_link_delay", "json"),
    FOLLOW_MODE: ("follow", "interval", "max_seconds"),
    FOLDER_MODE: ("json", "plot", "probe_json", "world_size", "partial", "rank_from"),
}
"""The flags each way of running ``diagnose`` reads; any other flag given is an error, not silently dropped
(``--follow --json f`` wrote nothing, ``--interval`` without ``--follow`` did nothing)."""


def _unused_flags(args, mode: str) -> str | None:
    """One line naming the flags given that ``mode`` (a key of ``DIAGNOSE_MODES``) would ignore; None if none."""
    every = {f for flags in DIAGNOSE_MODES.values() for f in flags}
    extra = [f for f in sorted(every - set(DIAGNOSE_MODES[mode])) if getattr(args, f) not in (None, False, "")]
    if not extra:
        return None
    names = ", ".join("--" + f.replace("_", "-") for f in extra)
    return f"{names}: not used by {mode}; leave {'it' if len(extra) == 1 else 'them'} out"


def _diagnose_mode(args) -> str:
    """Which way of running ``diagnose`` the flags ask for (a key of ``DIAGNOSE_MODES``)."""
    if args.trace_dir == "probe" and args.world_size is not None:
        return PROBE_MODE
    return FOLLOW_MODE if args.follow else FOLDER_MODE


def _diagnose(args) -> int:
    mode = _diagnose_mode(args)
    if problem := _unused_flags(args, mode):
        return _err(problem)
    if mode == PROBE_MODE:
        return _probe(args)
    if mode == FOLLOW_MODE:  # the job may not have created the folder yet: Tail waits for it
        interval = 1.0 if args.interval is None else args.interval
        if problem := seconds_problem(interval):
            return _err(f"--interval: {problem}")
        if args.max_seconds is not None and (problem := seconds_problem(args.max_seconds)):
            return _err(f"--max-seconds: {problem}")
        try:
            found = follow(args.trace_dir, interval_s=interval, max_seconds=args.max_seconds)
        except KeyboardInterrupt:
            return 0
        return 1 if found else 0
    if not os.path.isdir(args.trace_dir):
        return _err(f"{args.trace_dir}: not a folder")
    probe = None
    if args.probe_json:
        probe, problem = load_probe(args.probe_json)
        if problem:
            return _err(f"--probe-json {args.probe_json}: {problem}")
    if args.world_size is not None and not 1 <= args.world_size <= MAX_RANKS:
        return _err(f"--world-size: must be in [1, {MAX_RANKS}], got {args.world_size}")
    return _finish(
        args.trace_dir,
        probe,
        args.json,
        args.plot,
        world_size=args.world_size,
        partial=args.partial,
        rank_from=args.rank_from,
    )


def load_probe(path: str) -> tuple[dict | None, str]:
    """(the probe JSON ``moonep probe --json`` wrote, "") or (None, what is wrong with it)."""
    try:
        with open(path, encoding="utf-8") as f:
            probe = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        return None, f"not JSON ({str(exc).splitlines()[0]})"
    one_way = probe.get("one_way_s") if isinstance(probe, dict) else None
    if not isinstance(one_way, list) or not one_way or any(not isinstance(r, list) for r in one_way):
        return None, "not a probe result: no one_way_s [R][R] table (write it with moonep probe --json)"
    R, pairs = len(one_way), probe.get("slow_pairs")
    if not isinstance(pairs, list):
        return None, "not a probe result: slow_pairs is not a list"
    for p in pairs:
        ranks = p.get("ranks") if isinstance(p, dict) else None
        ok = isinstance(ranks, list) and len(ranks) == 2 and all(isinstance(r, int) and 0 <= r < R for r in ranks)
        if not ok or not all(isinstance(p.get(k), (int, float)) for k in ("seconds", "ratio")):
            return None, f"slow_pairs entry {p!r} needs ranks [src, dst] in 0..{R - 1}, seconds and ratio"
    return probe, ""


def _finish(trace_dir: str, probe, json_path, plot_dir, *, world_size=None, partial=False, rank_from=None) -> int:
    """Print (and write) the report; exit 2 when the trace cannot back a verdict (module docstring)."""
    if rank_from is not None:
        try:
            re.compile(rank_from)
        except re.error as exc:
            return _err(f"--rank-from {rank_from!r}: not a regular expression ({exc})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report lists dropped lines itself
        try:
            report, tables = analyse(trace_dir, probe=probe, world_size=world_size, rank_from=rank_from)
        except TraceFormatError as exc:
            return _err(str(exc))
    report = finite_json(report)
    expected = report["coverage"]["expected_ranks"]
    if probe and expected and len(probe["one_way_s"]) != expected:  # its pairs would name other ranks
        return _err(f"the probe covers {len(probe['one_way_s'])} ranks, the trace {expected}")
    print(format_report(report))
    if json_path:
        write_json(json_path, report)
    if plot_dir and tables.steps:
        for path in plot(tables, plot_dir, report["findings"]):
            print(f"plot: {path}")
    cov = report["coverage"]
    if (not cov["ranks"] or not cov["steps"]) and not report["findings"]:  # a hang's verdict needs no steps
        return _err(f"{trace_dir}: no trace records with steps in any accepted format: nothing to diagnose")
    if not cov["complete"] and not partial and cov["ranks"] and cov["steps"]:
        return _err(f"{trace_dir}: incomplete trace ({_gaps(cov)}); pass --partial to diagnose what it holds")
    short = too_short(report)
    if short and not report["findings"] and not partial:
        return _err(f"{trace_dir}: {short}, or pass --partial")
    return 1 if report["findings"] else 0


def _gaps(cov: dict) -> str:
    gaps = [f"missing ranks {cov['missing_ranks']}"] if cov["missing_ranks"] else []
    gaps += [f"ranks {cov['extra_ranks']} beyond the {cov['expected_ranks']} expected"] if cov["extra_ranks"] else []
    gaps += [f"ranks short of steps {cov['ranks_missing_steps']}"] if cov["ranks_missing_steps"] else []
    gaps += [f"{cov['lines_dropped']} lines dropped"] if cov["lines_dropped"] else []
    return ", ".join(gaps)


def finite_json(obj):
    """``obj`` with every NaN or infinite float replaced by None (JSON has neither; ``json`` would write
    ``NaN``/``Infinity``, which strict readers reject)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _demo(args) -> int:
    try:
        cfg = WorkloadConfig(
            steps=args.steps,
            skew=args.skew,
            hot_rank=args.hot_rank,
            slowdowns=tuple(parse_slowdowns(args.inject_slowdown)),
            data_delays=tuple(parse_data_delays(args.inject_data_delay)),
            link_delays=tuple(parse_link_delay_specs(args.inject_link_delay)),
        )
    except ValueError as exc:
        return _err(str(exc))
    need = Thresholds().min_evidence_steps
    if cfg.steps < need:
        return _err(
            f"--steps {cfg.steps}: the diagnosis needs {need} (a slowdown must last {need} steps to be told from noise)"
        )
    for fault in (*cfg.slowdowns, *cfg.data_delays, *cfg.link_delays):
        if cfg.steps - fault.from_step < need:  # a legitimate experiment (blips are ignored), so a note, not an error
            last = cfg.steps - fault.from_step
            note = f"note: the fault from step {fault.from_step} lasts {last} steps; a finding needs {need}"
            print(f"{note}, so it will go unnamed")
    if args.trace_dir:
        try:
            check_folder("--trace-dir", args.trace_dir)
        except ValueError as exc:
            return _err(str(exc))
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="moonep-demo-trace-")
    try:
        run_local(cfg, args.world_size, trace_dir)
    except ValueError as exc:
        return _err(str(exc))
    print(f"trace written to {trace_dir}")
    probe = None
    if args.probe:
        args.rounds, args.nbytes = None, None  # the probe's defaults
        probe = _run_probe(args)
        _print_probe(probe)
    return _finish(trace_dir, probe, args.json, args.plot)


def _bench(args) -> int:
    # inf killed each rank's sampling thread; the bench then timed no sampler
    if problem := seconds_problem(args.interval):
        return _err(f"--interval: {problem}")
    try:
        result = bench_telemetry(args.world_size, args.steps, args.blocks, args.interval)
    except ValueError as exc:
        return _err(str(exc))
    print(
        f"telemetry ({result['source']}, every {result['interval_s']} s): step {result['median_step_off_s'] * 1e3:.2f}"
        f" ms off, {result['median_step_on_s'] * 1e3:.2f} ms on, ratio {result['ratio']:.4f} "
        f"(goal <= {result['goal_ratio']}); sampler thread duty {result['sampler_duty'] * 100:.2f}%"
    )
    if args.json:
        write_json(args.json, result)
    return 0


def _bench_detector(args) -> int:
    try:
        result = bench_detector(args.steps, args.blocks, args.step_ms, args.every)
    except ValueError as exc:
        return _err(str(exc))
    print(
        f"detector (every {result['every']} steps): step {result['median_step_off_s'] * 1e3:.2f} ms off, "
        f"{result['median_step_on_s'] * 1e3:.2f} ms on, ratio {result['ratio']:.4f}; its own cost "
        f"{result['overhead_ms_per_step']:.3f} ms/step = {result['overhead_fraction'] * 100:.2f}% of the step "
        f"(goal < {result['goal_fraction'] * 100:.0f}%; gather + diagnosis {result['gather_ms_each']:.1f} ms each)"
    )
    if args.json:
        write_json(args.json, result)
    return 0 if result["passed"] else 1
